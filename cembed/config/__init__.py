"""The config: one strict pydantic schema per section, the data section's source kinds, the model kinds'
config half (``model.kind``), the loss configs and the YAML file (overrides, line numbers in errors, paths).

Job: YAML + ``k=v`` overrides -> a validated :class:`cembed.config.schema.CembedConfig`; nothing here knows
the machine. May import: ``cembed.errors``, ``cembed.samples``, ``cembed.plugins``. Imports no torch, datasets, transformers or
sentence-transformers (``import cembed.config.file`` stays fast; the ``config-light`` contract holds it).
"""
