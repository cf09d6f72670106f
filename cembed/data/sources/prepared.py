"""The ``prepared`` source kind: a folder of token ids written by ``cembed prepare-data`` (:mod:`cembed.data.tokens.format`)."""

from __future__ import annotations

from cembed.config.sources import (
    PreparedSource,
)
from cembed.data.sources.logs import captured_library_logs


def load_prepared(source: PreparedSource):
    """A prepared source's token ids (:mod:`cembed.data.tokens.format`) as one ``datasets.Dataset``,
    read by the format's own reader (:func:`cembed.data.tokens.format.read_folder`: the manifest
    checked against the parts, each part memory-mapped, concatenated in order). The manifest is the
    dataset's ``cembed_manifest`` attribute (its role columns, tokenizer, prompts, samples).

    Raises:
        UserError: no manifest, a missing or resized part, a fingerprint that does not match (see
            ``read_manifest``), a part that is not an Arrow stream, parts without a role's
            ``<role>_input_ids`` column or with other columns than the first part's, or rows that
            differ from the manifest's (naming the part: see ``read_parts``).
    """
    import datasets

    from cembed.data.tokens.format import read_folder

    datasets.disable_progress_bars()
    with captured_library_logs():
        manifest, dataset = read_folder(source.path)
    dataset.cembed_manifest = manifest
    return dataset
