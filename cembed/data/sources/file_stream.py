"""A file source read as a stream (``datasets``' streaming loader): its rows in file order, lazily;
the file kind's ``open_stream`` hook (:func:`cembed.data.sources.registry.open_stream`)."""

from __future__ import annotations


def open_file_stream(source):
    """A :class:`cembed.config.sources.FileSource`'s files (:func:`cembed.data.sources.file_kind.source_files`
    order: skipped paths and 0-row shards left out) as one ``datasets.IterableDataset``, read lazily
    in file order, after the shard checks a loaded source gets (one format, the same columns:
    :func:`cembed.data.sources.file_kind.check_shards`).

    Raises:
        UserError: the files are missing or of an unsupported type; shards that cannot be one source
            (naming the first that differs).
    """
    import datasets

    from cembed.data.sources.file_kind import builder_for, check_shards, is_sharded, source_files
    from cembed.data.sources.text import check_codec
    from cembed.files import display_path

    files = source_files(source)
    for file in files:
        check_codec(file)
    if is_sharded(source):
        check_shards(files, display_path(source.label))
    builder, kwargs = builder_for(files[0])
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False  # a local file is nobody's download
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True, **kwargs)
