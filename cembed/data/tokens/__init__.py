"""How token ids sit on disk and reach the model: the one on-disk format (``format``: Arrow parts +
a typed manifest), tokenize-once (``tokenize``), the folder writer (``writer``), the check that
stored ids are the model's (``model_check``) and the collators that pad them (``collator``).

May import: ``cembed.data.identity``, ``cembed.model``, ``cembed.config``, ``cembed.files``,
``cembed.errors``; never sources, rows, batching or the back ends.
"""
