"""The ``mini_batch_size`` probe (may import: losses, model, plan, config, distributed, files, errors):
the search (``search``), its trials and their runners (``trials``), one worst-case step
(``worst_case``), what a trial measured (``setup``) and running a probe or ``batch.mini_batch_size:
auto`` (``auto``)."""
