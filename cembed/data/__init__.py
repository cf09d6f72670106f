"""Training data, by question: where rows come from (``sources/``), how token ids sit on disk
(``tokens/``) and how rows become duplicate-free batches (``batching/``); beside them the in-memory
rows (``rows``), loading and checking them (``load``, ``columns``, ``batchable``), the row identity
every stage shares (``identity``), prompts and truncation reports, and the back ends of ``cembed
init`` (``starter``), ``inspect-data`` (``inspect``), ``prepare-data`` (``prepare_folder``) and
``mine-negatives`` (``mining``).

Inside, modules import downward only (``pyproject.toml``'s ``data-inside`` contract, top to bottom):
back ends -> ``batching`` -> ``truncation`` -> ``load`` / ``prompts`` / ``batchable`` -> ``rows`` ->
``sources`` / ``columns`` -> ``tokens`` -> ``identity``.

May import: ``cembed.model``, ``cembed.plan``, ``cembed.config``, ``cembed.files``, ``cembed.samples``,
``cembed.errors`` (never losses, eval, probe, train or cli).
"""
