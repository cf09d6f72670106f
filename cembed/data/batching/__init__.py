"""How rows become batches: the one-batch no-duplicates test (``fits``), the full-table sampler
(``full_table``), the windowed rule over a stream (``windowed``) and training from a stream
(``stream``), mixtures of sources (``mixture``), predicting which rows no batch can take
(``placement``), and the registry of batching rules a run picks by ``sampler.rule`` (``rules``).

May import: every ``cembed.data`` module below it (rows, load, prompts, tokens, sources, identity),
``cembed.model``, ``cembed.config``, ``cembed.errors``; never the back ends (starter, inspect, mining,
prepare_folder).
"""
