"""The ``cembed`` command: a Typer app that registers one command per line (``app``), one module per
command in ``commands/`` holding its options and its body (load, call one library function, print),
the rendering several commands share and the training run's display in ``display/``, and what
every command shares (consoles, the config argument, the UserError handler) in ``common``.

The only package that imports rich or typer; may import everything.
"""
