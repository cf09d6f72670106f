"""How rows become batches: the one-batch no-duplicates test (``fits``), the full-table sampler
(``full_table``), the windowed rule over a stream (``windowed``) and training from a stream
(``stream``), mixtures of sources (``mixture``), and predicting which rows no batch can take
(``placement``).

May import: every ``cembed.data`` module below it (rows, load, prompts, tokens, sources, identity),
``cembed.model``, ``cembed.config``, ``cembed.errors``; never the back ends (starter, inspect, mining,
prepare_folder).
"""
