"""Where rows come from: one module per source kind (``file_kind``, ``hub``, ``beir``, ``prepared``,
``saved``, the stream reader ``file_stream``) and the registry that maps a configured kind to its loader (``registry``),
with the standard-library readers and diagnosis that name a bad file's line (``text``, ``diagnose``,
``locate``, ``logs``).

May import: ``cembed.data.tokens`` (a prepared folder's format), ``cembed.data.identity``,
``cembed.config``, ``cembed.files``, ``cembed.samples``, ``cembed.errors``; never the checked rows,
batching or the back ends above it.
"""
