"""The ``saved`` source kind: a folder ``datasets``' ``save_to_disk`` wrote, read as
``datasets.load_from_disk`` reads it (its Arrow files memory-mapped, nothing copied)."""

from __future__ import annotations

from pathlib import Path

from cembed.config.sources import SavedSource, saved_dataset_kind
from cembed.data.sources.logs import captured_library_logs, library_cause
from cembed.errors import UserError
from cembed.files import display_path

DEFAULT_SPLIT = "train"


def load_saved(source: SavedSource):
    """The rows of a ``save_to_disk`` folder as one ``datasets.Dataset``: a Dataset's folder as it is
    (a DatasetDict's split folder given directly is one), a DatasetDict's split ``source.split``
    (default ``train``). ``datasets.load_from_disk`` reads it, memory-mapping its Arrow files.

    Raises:
        UserError: the folder is missing or not one ``save_to_disk`` wrote; a DatasetDict without the
            split (naming its splits); a split other than a Dataset's own given for a Dataset; a
            library error while reading (one line, its cause).
    """
    import datasets

    datasets.disable_progress_bars()
    folder = Path(source.path)
    shown = display_path(folder)
    if not folder.is_dir():
        raise UserError(f"{shown}: folder not found (data paths resolve relative to the config file)")
    kind = saved_dataset_kind(folder)
    if kind is None:
        raise UserError(
            f"{shown}: not a folder datasets' save_to_disk wrote (no state.json with dataset_info.json, "
            "no dataset_dict.json)"
        )
    try:
        with captured_library_logs():
            loaded = datasets.load_from_disk(str(folder))
    except Exception as err:  # datasets and pyarrow raise many types
        raise UserError(f"{shown}: cannot read the saved {kind}: {library_cause(err)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = source.split or DEFAULT_SPLIT
        if split not in loaded:
            raise UserError(
                f"{shown}: the saved DatasetDict has no split {split!r} (its splits: {', '.join(loaded)}); "
                "set data.train.split to one of them"
            )
        return loaded[split]
    own = str(loaded.split) if loaded.split is not None else None
    if source.split is not None and source.split not in (own, DEFAULT_SPLIT if own is None else own):
        raise UserError(
            f"{shown}: a saved Dataset (one split), not a DatasetDict: data.train.split {source.split!r} picks "
            "nothing; remove split, or give the DatasetDict's folder"
        )
    return loaded
