"""Rows -> checked rows -> token ids -> duplicate-free batches: the source kinds' loaders, BEIR files,
column mapping and cell checks, tokenize-once with its cache, the collator, the no-duplicates sampler,
the source mixture, placement, and the back ends of ``cembed init`` and ``cembed mine-negatives``.

May import: ``cembed.model``, ``cembed.plan``, ``cembed.config``, ``cembed.files``, ``cembed.samples``,
``cembed.errors`` (never losses, eval, probe, train or cli).
"""
