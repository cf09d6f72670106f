"""How token ids sit on disk and reach the model: the one on-disk format (``format``: Arrow parts +
a typed manifest, and its reader), the tokenizing map that writes the parts (``encode``), the folder
writer (``writer``), tokenize-once, whose cache entries are such folders (``tokenize``), the check that
stored ids are the model's (``model_check``) and the collators that pad them (``collator``).

Inside, imports run one way (``pyproject.toml``'s ``tokens-inside`` contract, top to bottom):
``tokenize`` -> ``writer`` -> ``model_check`` -> ``encode`` -> ``format`` / ``collator``.

May import: ``cembed.data.identity``, ``cembed.model``, ``cembed.config``, ``cembed.files``,
``cembed.errors``; never sources, rows, batching or the back ends.
"""
