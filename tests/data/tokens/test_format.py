"""What read_manifest says about a folder where ``cembed prepare-data --part K/N`` ran but the parts
were not joined yet: the whole line a user reads (parts done, parts missing, the commands to run)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import xxhash

from cembed.data.tokens.format import (
    MANIFEST,
    PreparedManifest,
    PreparedPart,
    PromptedRows,
    part_manifest_name,
    parts_fingerprint,
    read_folder,
    read_manifest,
    read_parts,
    write_manifest,
)
from cembed.errors import UserError
from cembed.files import display_path


def _refusal(folder, done: list[int], n: int) -> str:
    folder.mkdir()
    for k in done:
        (folder / part_manifest_name(k, n)).write_text("{}")
    return _refused(folder)


@pytest.mark.parametrize(
    ("done", "n", "says"),
    [
        (
            [0],
            3,
            "not complete: part 0 of 3 is prepared, parts 1, 2 are missing: run cembed prepare-data CONFIG "
            "--output {w} --part 1/3, --part 2/3 (the last part to finish writes cembed_prepared.json)",
        ),
        (
            [0, 2],
            3,
            "not complete: parts 0, 2 of 3 are prepared, part 1 is missing: run cembed prepare-data CONFIG "
            "--output {w} --part 1/3 (the last part to finish writes cembed_prepared.json)",
        ),
        (
            [0, 1, 2],
            3,
            "all 3 parts are prepared but not joined (no cembed_prepared.json): run the last part's "
            "cembed prepare-data command again",
        ),
    ],
)
def test_an_unjoined_preparation_says_which_parts_are_done_and_what_to_run(tmp_path, done, n, says):
    folder = tmp_path / "prepared"
    where = display_path(folder)
    assert _refusal(folder, done, n) == f"{where}: " + says.format(w=where)


# --- the reader on a folder built by hand (no model): every refusal's whole line ---------------------


def _write_part(folder, name: str, columns: dict[str, list]) -> PreparedPart:
    """One Arrow stream part holding ``columns`` (``<role>_input_ids`` lists as list<int32>)."""
    table = pa.table(
        {c: pa.array(v, type=pa.list_(pa.int32()) if c.endswith("_input_ids") else None) for c, v in columns.items()}
    )
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return PreparedPart(name, len(table), (folder / name).stat().st_size)


def _hand_made(folder, parts: list[dict[str, list]], columns=("anchor", "positive")) -> PreparedManifest:
    """A prepared folder of ``parts`` (each a dict of columns), its manifest written last."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [_write_part(folder, f"part-{i:05d}.arrow", cols) for i, cols in enumerate(parts)]
    manifest = PreparedManifest(
        columns=list(columns), tokenizer="0123456789abcdef", max_seq_length=8,
        rows=sum(p.rows for p in written), parts=written,
    )  # fmt: skip
    write_manifest(folder, manifest)
    return manifest


PAIRS = {"anchor_input_ids": [[2, 7, 3], [2, 8, 9, 3]], "positive_input_ids": [[2, 5, 3], [2, 6, 3]]}
ONE = {"anchor_input_ids": [[2, 4, 3]], "positive_input_ids": [[2, 1, 3]]}


def test_read_folder_gives_the_parts_rows_in_the_manifests_order(tmp_path):
    folder = tmp_path / "prepared"
    written = _hand_made(folder, [PAIRS, ONE])
    manifest, rows = read_folder(folder)
    assert manifest == written and manifest.fingerprint == parts_fingerprint(written)
    assert rows["anchor_input_ids"] == [[2, 7, 3], [2, 8, 9, 3], [2, 4, 3]]
    assert rows["positive_input_ids"] == [[2, 5, 3], [2, 6, 3], [2, 1, 3]]


def test_a_part_datasets_cannot_open_is_named_with_the_first_200_characters_of_why(tmp_path, monkeypatch):
    import datasets

    folder = tmp_path / "prepared"
    manifest = _hand_made(folder, [PAIRS])

    def refuse(path, in_memory=None):
        raise ValueError("x" * 250 + "\nsecond line")

    monkeypatch.setattr(datasets.Dataset, "from_file", refuse)
    assert _message(read_parts, folder, manifest) == (
        f"{display_path(folder)}: part part-00000.arrow: not an Arrow stream file ({'x' * 200}); prepare it again"
    )


def test_a_part_holding_other_rows_than_the_manifest_says_is_named(tmp_path):
    folder = tmp_path / "prepared"
    manifest = _hand_made(folder, [PAIRS])
    manifest.parts[0].rows = 3
    assert _message(read_parts, folder, manifest) == (
        f"{display_path(folder)}: part part-00000.arrow: holds 2 rows, the manifest says 3; prepare it again"
    )


def test_a_manifest_without_parts_has_nothing_to_train_on(tmp_path):
    folder = tmp_path / "prepared"
    manifest = _hand_made(folder, [])
    assert (
        _message(read_parts, folder, manifest)
        == f"{display_path(folder)}: the prepared source has no parts; nothing to train on"
    )


def test_a_part_without_a_roles_ids_is_named_with_its_columns(tmp_path):
    folder = tmp_path / "prepared"
    manifest = _hand_made(folder, [PAIRS, {"anchor_input_ids": [[2, 4, 3]], "anchor_hash": [7]}])
    assert _message(read_parts, folder, manifest) == (
        f"{display_path(folder)}: part part-00001.arrow: no column positive_input_ids "
        "(columns: anchor_input_ids, anchor_hash); prepare it again"
    )


def test_parts_with_other_columns_than_the_first_are_named_with_both(tmp_path):
    folder = tmp_path / "prepared"
    manifest = _hand_made(folder, [PAIRS, {**ONE, "anchor_prompt_length": [2]}, ONE])
    assert _message(read_parts, folder, manifest) == (
        f"{display_path(folder)}: part part-00001.arrow's columns (anchor_input_ids, positive_input_ids, "
        "anchor_prompt_length) differ from part-00000.arrow's (anchor_input_ids, positive_input_ids); prepare it again"
    )


def _message(read, *args) -> str:
    """The one-line message of the UserError ``read(*args)`` raises."""
    with pytest.raises(UserError) as refused:
        read(*args)
    return str(refused.value)


def _refused(folder) -> str:
    return _message(read_manifest, folder)


def test_what_is_not_a_prepared_folder_is_refused_naming_the_fix(tmp_path):
    folder = tmp_path / "prepared"
    where = display_path(folder)
    assert (
        _refused(folder) == f"{where}: does not exist; give the folder `cembed prepare-data CONFIG --output DIR` wrote"
    )
    folder.write_text("")
    assert _refused(folder) == f"{where}: not a folder; a prepared source is the folder `cembed prepare-data` wrote"
    folder.unlink()
    folder.mkdir()
    (folder / "part-00000.arrow").write_text("")  # a part, no part manifest: not a --part run
    assert _refused(folder) == (
        f"{where}: not a prepared source (no cembed_prepared.json; a preparation still running or killed leaves "
        "none): prepare it with `cembed prepare-data CONFIG --output DIR`"
    )


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"format": "other"}, "format 'other', expected 'cembed-prepared'"),
        ({"format": None}, "format None, expected 'cembed-prepared'"),
        ({"version": 3}, "version 3, this cembed reads 1 and 2"),
        ({"version": None}, "version None, this cembed reads 1 and 2"),
        ({"parts": [{"file": "part-00000.arrow", "rows": 2}]}, None),
        ({"colour": "red"}, None),
    ],
)
def test_a_foreign_or_unreadable_manifest_is_refused(tmp_path, change, why):
    folder = tmp_path / "prepared"
    _hand_made(folder, [PAIRS])
    path = folder / MANIFEST
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    refusal = _refused(folder)
    start, end = f"{display_path(path)}: unreadable prepared-source manifest (", "); prepare it again"
    assert refusal.startswith(start) and refusal.endswith(end)
    if why is not None:
        assert refusal == start + why + end
    path.write_text("{not json")
    assert _refused(folder).startswith(start + "Expecting property name")


def test_a_version_1_manifest_reads(tmp_path):
    folder = tmp_path / "prepared"
    written = _hand_made(folder, [PAIRS])
    path = folder / MANIFEST
    old = json.loads(path.read_text())
    for key in ("cache_key", "data_fingerprint", "text_columns", "source_prompts"):
        del old[key]
    path.write_text(json.dumps({**old, "version": 1}))
    manifest = read_manifest(folder)
    assert manifest.version == 1 and manifest.source_prompts == [] and manifest.parts == written.parts


def test_parts_that_do_not_match_the_manifest_are_refused(tmp_path):
    folder = tmp_path / "prepared"
    manifest = _hand_made(folder, [PAIRS, ONE])
    where, path = display_path(folder), display_path(folder / MANIFEST)
    data = (folder / "part-00001.arrow").read_bytes()
    (folder / "part-00001.arrow").write_bytes(data + b"\0")
    assert _refused(folder) == (
        f"{where}: part part-00001.arrow is {len(data) + 1} bytes, the manifest says {len(data)}; "
        "copy the whole folder or prepare it again"
    )
    (folder / "part-00001.arrow").unlink()
    assert _refused(folder) == (f"{where}: part part-00001.arrow is missing; copy the whole folder or prepare it again")
    (folder / "part-00001.arrow").mkdir()  # not a file
    assert _refused(folder) == (f"{where}: part part-00001.arrow is missing; copy the whole folder or prepare it again")
    (folder / "part-00001.arrow").rmdir()
    (folder / "part-00001.arrow").write_bytes(data)
    manifest.rows = 4
    (folder / MANIFEST).write_text(json.dumps({**manifest.to_json(), "rows": 4}))
    assert _refused(folder) == f"{path}: the parts' rows do not add up to 4; prepare it again"
    (folder / MANIFEST).write_text(json.dumps({**manifest.to_json(), "rows": 3, "max_seq_length": 9}))
    assert _refused(folder) == f"{path}: fingerprint does not match the parts; prepare it again"


def test_the_fingerprint_covers_what_decides_the_rows(tmp_path):
    manifest = _hand_made(tmp_path / "prepared", [PAIRS, ONE])
    key = {
        "parts": [[p.file, p.rows, p.bytes] for p in manifest.parts],
        "tokenizer": "0123456789abcdef",
        "max_seq_length": 8,
        "columns": ["anchor", "positive"],
        "prompts": {},
    }
    assert manifest.fingerprint == xxhash.xxh64_hexdigest(json.dumps(key, sort_keys=True).encode("utf-8"))
    manifest.source_prompts = [PromptedRows(2, {"anchor": "q: "}), PromptedRows(1)]
    key["source_prompts"] = [[2, {"anchor": "q: "}], [1, {}]]
    assert parts_fingerprint(manifest) == xxhash.xxh64_hexdigest(json.dumps(key, sort_keys=True).encode("utf-8"))
    assert len(manifest.fingerprint) == 16
    assert json.loads((tmp_path / "prepared" / MANIFEST).read_text())["fingerprint"] == manifest.fingerprint
