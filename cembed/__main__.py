from cembed.cli import main

main()
