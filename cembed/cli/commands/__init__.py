"""One module per ``cembed`` command (accelerate's ``commands/`` layout): its options, its body (load
the config, call the library function that does the work) and, when only it prints them, its own
few lines of output. What several commands print, and the training run's display, is in
:mod:`cembed.cli.display`.

May import :mod:`cembed.cli.display`, :mod:`cembed.cli.common` and (inside a command) any cembed
package; never :mod:`cembed.cli.app` nor another command's module.
"""
