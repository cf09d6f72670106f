from cembed.cli.app import main

main()
