"""The CLI's rendering that is more than a command's few lines: the training run's display and its
closing lines (``run``), ``validate``'s report and summary (``validate``), the mini-batch probe's
table (``probe``, shown by ``probe-minibatch`` and ``train``) and a model check's truncation table
(``truncation``, shown by ``validate --verbose`` and ``probe-minibatch``). Functions here take the
values the library returned and print them; they compute nothing a test of the library would check.

May import :mod:`cembed.cli.common`; never a command module nor :mod:`cembed.cli.app`.
"""
