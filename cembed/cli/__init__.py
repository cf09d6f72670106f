"""The ``cembed`` command: a Typer app that registers one command per line, and one module per command
group holding its options, its body (load, call one library function) and its rendering.

The only package that imports rich or typer; may import everything.
"""
