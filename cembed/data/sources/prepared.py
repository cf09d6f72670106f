"""The ``prepared`` source kind: a folder of token ids written by ``cembed prepare-data`` (:mod:`cembed.data.tokens.format`)."""

from __future__ import annotations

from pathlib import Path

from cembed.config.sources import (
    PreparedSource,
)
from cembed.data.sources.logs import captured_library_logs
from cembed.errors import UserError, first_line
from cembed.files import display_path


def load_prepared(source: PreparedSource):
    """A prepared source's token ids (:mod:`cembed.data.tokens.format`) as one ``datasets.Dataset``:
    the manifest read and checked against the parts (:func:`cembed.data.tokens.format.read_manifest`),
    each part memory-mapped (``Dataset.from_file``, no copy), concatenated in order. The manifest
    is the dataset's ``cembed_manifest`` attribute (its role columns, tokenizer, prompts, samples).

    Raises:
        UserError: no manifest, a missing or resized part, a fingerprint that does not match (see
            ``read_manifest``), a part that is not an Arrow stream, parts without a role's
            ``<role>_input_ids`` column or with other columns than the first part's, or rows that
            differ from the manifest's (naming the part).
    """
    import datasets

    from cembed.data.identity import TOKEN_SUFFIX
    from cembed.data.tokens.format import read_manifest

    datasets.disable_progress_bars()
    folder = Path(source.path)
    manifest = read_manifest(folder)
    parts = []
    for part in manifest.parts:
        where = f"{display_path(folder)}: part {part.file}"
        try:
            with captured_library_logs():
                table = datasets.Dataset.from_file(str(folder / part.file), in_memory=False)
        except Exception as err:  # pyarrow's ArrowInvalid and others: not an Arrow stream
            raise UserError(f"{where}: not an Arrow stream file ({first_line(err, 200)}); prepare it again") from None
        if len(table) != part.rows:
            raise UserError(f"{where}: holds {len(table)} rows, the manifest says {part.rows}; prepare it again")
        missing = [c + TOKEN_SUFFIX for c in manifest.columns if c + TOKEN_SUFFIX not in table.column_names]
        if missing:
            raise UserError(
                f"{where}: no column {missing[0]} (columns: {', '.join(table.column_names)}); prepare it again"
            )
        parts.append(table)
    if not parts:
        raise UserError(f"{display_path(folder)}: the prepared source has no parts; nothing to train on")
    for part, table in zip(manifest.parts, parts):
        if table.features != parts[0].features:
            raise UserError(
                f"{display_path(folder)}: part {part.file}'s columns ({', '.join(table.column_names)}) differ from "
                f"{manifest.parts[0].file}'s ({', '.join(parts[0].column_names)}); prepare it again"
            )
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    dataset.cembed_manifest = manifest
    return dataset
