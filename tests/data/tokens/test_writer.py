"""``cembed prepare-data``'s library side (:mod:`cembed.data.tokens.writer`): the folder it writes is a
prepared source whose ids equal the training path's, its reported sizes are the files', a failure
leaves no manifest and a rerun completes, and N parts join into the one-part folder's rows."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from datasets import Dataset, concatenate_datasets

import cembed.data.tokens.encode as T
from cembed.config.file import load_config
from cembed.data.load import load_training_data
from cembed.data.prepare_folder import prepare_folder
from cembed.data.prompts import training_prompts
from cembed.data.tokens.format import MANIFEST, PreparedManifest, PreparedPart, part_manifest_name, read_manifest
from cembed.data.tokens.tokenize import pretokenize
from cembed.data.tokens.writer import PrepareResult, check_folder, join_parts, parse_part, publish_part
from cembed.errors import UserError
from cembed.model.load import load_model
from cembed.model.prompts import prompt_lengths

ROWS = 2600  # two map batches of 2048 rows: a failure after the first leaves a partial output


@pytest.fixture
def corpus(pairs_file):
    return pairs_file(
        [
            {
                "query": f"question {i} about a {'red ' * (i % 5)}car",
                "text": f"answer {i} on the street {'x ' * (i % 7)}",
            }
            for i in range(ROWS)
        ]
    )


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """datasets' own cache for the test: prepare-data must leave nothing in it."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", cache / "downloads" / "extracted")
    return cache


def _cfg(write_config, model_dir, corpus, **data):
    return load_config(
        write_config(
            {
                "model": {"name_or_path": str(model_dir), "device": "cpu", "max_seq_length": 16},
                "data": {"train": str(corpus), "columns": {"anchor": "query", "positive": "text"}, **data},
                "batch": {"per_device_train_batch_size": 64},
            }
        )
    )


def _parts(folder: Path):
    manifest = read_manifest(folder)
    parts = [Dataset.from_file(str(folder / p.file)) for p in manifest.parts]
    return manifest, concatenate_datasets(parts)


def test_prepared_folder_is_the_training_ids(tiny_model_dir, write_config, corpus, tmp_path, hf_cache):
    cfg = _cfg(write_config, tiny_model_dir, corpus, prompts={"anchor": "query: "})
    out = tmp_path / "prepared"
    result = prepare_folder(cfg, out)
    manifest, stored = _parts(out)  # read_manifest checks sizes and fingerprint
    # No copy of the input stays in datasets' cache (its JSON -> Arrow copy went to a temporary one).
    assert [p for p in hf_cache.rglob("*") if p.is_file()] == []

    # The training path's pre-tokenized columns of the same data, model and prompts.
    data = load_training_data(cfg.data)
    model = load_model(cfg.model, "cpu")
    prompts = training_prompts(data, model, cfg.data.prompts).columns
    train = pretokenize(
        data.dataset,
        ["anchor", "positive"],
        model.tokenizer,
        model.max_seq_length,
        tmp_path / "cache",
        num_proc=1,
        prompts=prompts,
        prompt_lengths=prompt_lengths(model, prompts),
    ).dataset
    assert stored.column_names == [
        "anchor_input_ids",
        "anchor_hash",
        "positive_input_ids",
        "positive_hash",
        "anchor_prompt_length",
    ]  # no text
    for column in stored.column_names:
        assert stored[column] == train[column], column
    assert manifest.rows == ROWS and manifest.columns == ["anchor", "positive"]
    assert manifest.prompts == {"anchor": "query: "} and manifest.max_seq_length == 16
    assert manifest.samples["anchor"][:2] == ["question 0 about a car", "question 1 about a red car"]
    assert len(manifest.samples["positive"]) == 64
    assert (manifest.rows_read, manifest.rows_dropped, manifest.input_files) == (ROWS, 0, 1)
    assert manifest.model == str(tiny_model_dir) and manifest.source.endswith("pairs.jsonl")

    # The reported sizes are the files' sizes; the raw ids are 4 B per token and per row and column.
    files = [p for p in out.iterdir() if p.is_file()]
    assert result.complete and result.total_rows == ROWS and result.total_files == len(manifest.parts)
    assert result.disk_bytes == sum(p.stat().st_size for p in files)
    assert result.bytes == sum(p.bytes for p in manifest.parts)
    tokens = sum(len(x) for c in ("anchor_input_ids", "positive_input_ids") for x in train[c])
    assert result.total_token_bytes == 4 * tokens + 4 * 2 * ROWS
    assert result.bytes_per_row == pytest.approx(result.disk_bytes / ROWS)
    assert result.ratio == pytest.approx(result.disk_bytes / result.total_token_bytes)
    # No temporary folder or other file stays in DIR.
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".arrow")) == [MANIFEST]


def test_three_parts_join_into_the_one_part_folder(tiny_model_dir, write_config, corpus, tmp_path, hf_cache):
    cfg = _cfg(write_config, tiny_model_dir, corpus)
    one = prepare_folder(cfg, tmp_path / "one")
    shared = tmp_path / "shared"
    results = []
    for k in (2, 0, 1):  # the nodes finish in any order
        results.append(prepare_folder(cfg, shared, (k, 3)))
        done = k == 1
        assert (shared / MANIFEST).exists() is done, k
        assert results[-1].complete is done
    assert results[0].waiting == [0, 1] and results[1].waiting == [1]
    a, rows_a = _parts(tmp_path / "one")
    b, rows_b = _parts(shared)
    assert [p.file for p in b.parts][:1] == ["part-00000-of-00003-00000.arrow"] and len(b.parts) == 3
    assert [p.rows for p in b.parts] == [867, 867, 866]
    for column in rows_a.column_names:
        assert rows_b[column] == rows_a[column], column
    for key in ("columns", "tokenizer", "max_seq_length", "prompts", "samples", "rows", "rows_read", "source"):
        assert getattr(b, key) == getattr(a, key), key
    assert results[-1].total_rows == ROWS and results[-1].total_token_bytes == one.total_token_bytes
    assert [p for p in hf_cache.rglob("*") if p.is_file()] == []


def test_failure_while_tokenizing_leaves_no_manifest_and_a_rerun_completes(
    tiny_model_dir, write_config, corpus, tmp_path, hf_cache, monkeypatch
):
    cfg = _cfg(write_config, tiny_model_dir, corpus)
    out = tmp_path / "prepared"
    real, done = T._tokenize_batch, [0]

    def fail_after_one_batch(batch, indices, *args, **kwargs):
        if done[0]:
            raise RuntimeError("killed")
        done[0] += len(indices)
        return real(batch, indices, *args, **kwargs)

    monkeypatch.setattr(T, "_tokenize_batch", fail_after_one_batch)
    with pytest.raises(RuntimeError, match="killed"):
        prepare_folder(cfg, out)
    assert done[0] == 2048  # the failure came in the middle
    assert not out.exists()  # the folder it made is gone
    with pytest.raises(UserError, match="does not exist"):
        read_manifest(out)
    monkeypatch.setattr(T, "_tokenize_batch", real)

    # What a SIGKILL leaves (the temporary folder, a moved part), then the rerun.
    (out / ".tmp-00000-abc" / "ids").mkdir(parents=True)
    (out / ".tmp-00000-abc" / "ids" / "ids.arrow").write_bytes(b"x" * 100)
    (out / "part-00003.arrow").write_bytes(b"x" * 100)
    result = prepare_folder(cfg, out)
    assert result.complete and result.total_rows == ROWS
    manifest, stored = _parts(out)
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST] + [p.file for p in manifest.parts])
    clean = prepare_folder(cfg, tmp_path / "clean")
    assert stored["anchor_input_ids"] == _parts(tmp_path / "clean")[1]["anchor_input_ids"]
    assert manifest.fingerprint == read_manifest(tmp_path / "clean").fingerprint and clean.complete


def test_a_killed_part_is_redone_and_the_others_kept(tiny_model_dir, write_config, corpus, tmp_path, hf_cache):
    cfg = _cfg(write_config, tiny_model_dir, corpus)
    shared = tmp_path / "shared"
    prepare_folder(cfg, shared, (0, 2))
    kept = (shared / part_manifest_name(0, 2)).stat().st_mtime_ns
    (shared / "part-00001-of-00002-00000.arrow").write_bytes(b"half")  # part 1 was killed after moving a file
    result = prepare_folder(cfg, shared, (1, 2))
    assert result.complete and (shared / part_manifest_name(0, 2)).stat().st_mtime_ns == kept
    assert read_manifest(shared).rows == ROWS


def test_refusals(tiny_model_dir, write_config, corpus, tmp_path, hf_cache):
    two = load_config(
        write_config(
            {
                "model": {"name_or_path": str(tiny_model_dir)},
                "data": {
                    "train": {"a": str(corpus), "b": str(corpus)},
                    "columns": {"anchor": "query", "positive": "text"},
                },
            },
            name="two.yaml",
        )
    )
    with pytest.raises(UserError, match=r"^data\.train: 2 sources; .*prepare each separately"):
        prepare_folder(two, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    cfg = _cfg(write_config, tiny_model_dir, corpus)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        prepare_folder(cfg, foreign)
    done = tmp_path / "done"
    prepare_folder(cfg, done)
    with pytest.raises(UserError, match="already a prepared source"):
        prepare_folder(cfg, done)
    with pytest.raises(UserError, match="--overwrite with --part"):
        prepare_folder(cfg, done, (0, 2), overwrite=True)
    assert prepare_folder(cfg, done, overwrite=True).complete


def test_more_parts_than_rows(tiny_model_dir, write_config, pairs_file, tmp_path, hf_cache):
    """A part with no rows writes no file and still counts as done: the join lists the others."""
    corpus = pairs_file([{"query": f"q {i}", "text": f"t {i}"} for i in range(3)], name="three.jsonl")
    cfg = _cfg(write_config, tiny_model_dir, corpus)
    results = [prepare_folder(cfg, tmp_path / "shared", (k, 4)) for k in range(4)]
    assert [r.rows for r in results] == [1, 1, 1, 0] and results[-1].files == [] and results[-1].complete
    manifest, stored = _parts(tmp_path / "shared")
    assert manifest.rows == 3 and len(manifest.parts) == 3
    assert stored["anchor_input_ids"] == _parts(prepare_folder(cfg, tmp_path / "one").folder)[1]["anchor_input_ids"]


def test_part_rows_are_datasets_contiguous_shards():
    from cembed.data.tokens.writer import part_rows

    ds = Dataset.from_dict({"x": list(range(10))})
    for n in (1, 3, 4, 10):
        for k in range(n):
            start, end = part_rows(10, k, n)
            assert list(range(start, end)) == ds.shard(n, k, contiguous=True)["x"], (k, n)
    assert part_rows(3, 3, 4) == (3, 3)


def test_parse_part():
    assert parse_part(None) == (0, 1) and parse_part("2/4") == (2, 4)
    assert parse_part("auto", {"RANK": "5", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "8"}) == (2, 4)
    for bad in ("4/4", "x", "1/0"):
        with pytest.raises(UserError, match="--part"):
            parse_part(bad)
    with pytest.raises(UserError, match="torchrun"):
        parse_part("auto", {})


def _small(pairs_file, rows=40):
    return pairs_file([{"query": f"q {i}", "text": f"t {i}"} for i in range(rows)], name="small.jsonl")


def test_a_streaming_source_is_refused_naming_the_field(tiny_model_dir, write_config, pairs_file, tmp_path, hf_cache):
    """A stream reads only its first check_rows rows at the data stage: preparing it would silently
    keep those alone, so the run is refused and no folder is made."""
    corpus = _small(pairs_file, 1200)
    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {
                    "train": {"path": str(corpus), "streaming": True},
                    "columns": {"anchor": "query", "positive": "text"},
                },
                "train": {"max_steps": 2},
            },
            name="stream.yaml",
        )
    )
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"^data\.train\.streaming: .*remove") as err:
        prepare_folder(cfg, out)
    assert "\n" not in str(err.value) and not out.exists()


def test_a_prepared_source_is_refused_naming_its_folder(tiny_model_dir, write_config, pairs_file, tmp_path, hf_cache):
    cfg = _cfg(write_config, tiny_model_dir, _small(pairs_file))
    one = tmp_path / "one"
    prepare_folder(cfg, one)
    again = load_config(
        write_config(
            {"model": {"name_or_path": str(tiny_model_dir)}, "data": {"train": {"prepared": str(one)}}},
            name="again.yaml",
        )
    )
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"^data\.train: .*already a prepared source") as err:
        prepare_folder(again, out)
    assert str(one) in str(err.value) and not out.exists()


def test_parts_of_another_count_are_refused(tiny_model_dir, write_config, pairs_file, tmp_path, hf_cache):
    """Part files carry N; a --part K/N run into a folder holding parts (or part manifests) of another
    N is refused naming the file, before anything is written."""
    cfg = _cfg(write_config, tiny_model_dir, _small(pairs_file))
    shared = tmp_path / "shared"
    prepare_folder(cfg, shared, (0, 2))
    assert [p.name for p in shared.glob("*.arrow")] == ["part-00000-of-00002-00000.arrow"]
    before = sorted(p.name for p in shared.iterdir())
    for k in range(3):
        with pytest.raises(UserError, match=rf"--part K/2; this run is --part {k}/3: give a new folder, or remove"):
            prepare_folder(cfg, shared, (k, 3))
    assert sorted(p.name for p in shared.iterdir()) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "part-00001-of-00002-00000.arrow").write_bytes(b"x")  # a killed node's part
    with pytest.raises(UserError, match=r"part-00001-of-00002-00000\.arrow"):
        prepare_folder(cfg, other, (0, 3))
    with pytest.raises(UserError, match=r"part-00001-of-00002-00000\.arrow"):
        prepare_folder(cfg, other)  # one process: its parts would be mixed with node 1's


def test_read_manifest_says_what_is_missing(tiny_model_dir, write_config, pairs_file, tmp_path, hf_cache):
    with pytest.raises(UserError, match=r"nope: does not exist"):
        read_manifest(tmp_path / "nope")
    cfg = _cfg(write_config, tiny_model_dir, _small(pairs_file))
    shared = tmp_path / "shared"
    prepare_folder(cfg, shared, (0, 2))
    with pytest.raises(
        UserError, match=r"part 0 of 2 is prepared, part 1 is missing: run cembed prepare-data .*--part 1/2"
    ):
        read_manifest(shared)


# --- the writer's steps without a model: parts moved and counted, part manifests joined, folders refused


def test_parse_part_refusals_say_the_whole_fix():
    from cembed.data.tokens.writer import parse_part

    for bad in ("x", "1/2/3", "a/b"):
        with pytest.raises(UserError) as err:
            parse_part(bad)
        assert str(err.value) == f"--part {bad}: give K/N (node K of N, K = 0..N-1) or auto"
    for bad in ("4/4", "-1/4", "0/0"):
        with pytest.raises(UserError) as err:
            parse_part(bad)
        assert str(err.value) == f"--part {bad}: K must be 0..N-1 and N at least 1"
    assert parse_part("0/1") == (0, 1) and parse_part("3/4") == (3, 4)
    for env in ({}, {"RANK": "1", "LOCAL_WORLD_SIZE": "x", "WORLD_SIZE": "2"}):
        with pytest.raises(UserError) as err:
            parse_part("auto", env)
        assert str(err.value) == (
            "--part auto: RANK, LOCAL_WORLD_SIZE and WORLD_SIZE are not set (torchrun sets them); "
            "give --part K/N instead"
        )
    assert parse_part("auto", {"RANK": "3", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "2"}) == (0, 1)
    assert parse_part("auto", {"RANK": "7", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "8"}) == (3, 4)


def test_part_file_names_carry_k_and_n_and_are_read_back():
    from cembed.data.tokens.writer import part_count, part_file

    assert part_file(0, 1, 3) == "part-00003.arrow" and part_file(2, 12, 1) == "part-00002-of-00012-00001.arrow"
    names = {
        "part-00003.arrow": 1,
        "part-00002-of-00012-00001.arrow": 12,
        "cembed_prepared.part-00001-of-00003.json": 3,
        ".cembed_prepared.part-00001-of-00003.json.tmp": 3,
        "part-1-2.arrow": 0,
        "part-00003.arrow.tmp": 0,
        ".tmp-00000-abc": None,
        ".lock": None,
        "notes-part-00003.arrow": None,
    }
    assert {name: part_count(name) for name in names} == names


def test_manifest_values_read_as_a_message_shows_them():
    from cembed.data.tokens.writer import manifest_value

    assert manifest_value({"anchor": "query: ", "positive": ""}) == "anchor 'query: ', positive ''"
    assert manifest_value({}) == "none" and manifest_value(["anchor", "positive"]) == "anchor, positive"
    assert manifest_value(64) == "64" and manifest_value(None) == "None"


def _ids_file(path: Path, anchors: list[list[int]], batch: int = 2) -> None:
    """A map output file: Arrow stream of ``anchor_input_ids`` (list<int32>) in batches of ``batch`` rows."""
    import pyarrow as pa

    table = pa.table({"anchor_input_ids": pa.array(anchors, type=pa.list_(pa.int32()))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=batch)


def _manifest(rows: int) -> PreparedManifest:
    return PreparedManifest(columns=["anchor"], tokenizer="t", max_seq_length=8, rows=rows, parts=[], source="s")


def test_publish_part_moves_the_maps_files_counts_rows_bytes_and_token_ids(tmp_path):
    from cembed.data.tokens.writer import token_bytes

    ids_dir, folder = tmp_path / "ids", tmp_path / "out"
    ids_dir.mkdir()
    folder.mkdir()
    _ids_file(ids_dir / "a.arrow", [[2, 5, 3], [2, 3], [2, 6, 7, 3]])  # batches of 2 rows: 2 + 1
    _ids_file(ids_dir / "b.arrow", [[2, 9, 9, 9, 3]])
    sizes = [(ids_dir / f).stat().st_size for f in ("a.arrow", "b.arrow")]
    # ids: 3 + 2 + 4 + 5 = 14 tokens and 4 rows of offsets, 4 bytes each
    assert token_bytes([ids_dir / "a.arrow", ids_dir / "b.arrow"], ["anchor"]) == 4 * 14 + 4 * 4
    manifest = _manifest(4)
    result = publish_part(folder, 0, 1, ids_dir, ["a.arrow", "b.arrow"], manifest, 3)
    assert manifest.parts == [
        PreparedPart("part-00000.arrow", 3, sizes[0]),
        PreparedPart("part-00001.arrow", 1, sizes[1]),
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["part-00000.arrow", "part-00001.arrow"]
    assert list(ids_dir.iterdir()) == []
    assert result == PrepareResult(
        folder, 0, 1, 4, ["part-00000.arrow", "part-00001.arrow"], sum(sizes), 72, 0.0, 3, False
    )
    assert result.bytes_per_row == sum(sizes) / 4 and result.ratio == sum(sizes) / 72


def test_parts_of_n_write_part_manifests_and_the_last_joins_them_in_k_order(tmp_path):
    import json

    folder = tmp_path / "out"
    folder.mkdir()
    results = []
    for k, anchors in ((1, [[2, 7, 3]]), (0, [[2, 5, 3], [2, 6, 3]])):  # part 1 finishes first
        ids_dir = tmp_path / f"ids-{k}"
        ids_dir.mkdir()
        _ids_file(ids_dir / "x.arrow", anchors)
        result = publish_part(folder, k, 2, ids_dir, ["x.arrow"], _manifest(len(anchors)), 1)
        envelope = json.loads((folder / part_manifest_name(k, 2)).read_text())
        assert envelope["part"] == k and envelope["of"] == 2 and envelope["token_bytes"] == result.token_bytes
        assert envelope["manifest"]["parts"] == [
            {"file": f"part-{k:05d}-of-00002-00000.arrow", "rows": len(anchors), "bytes": result.bytes}
        ]
        join_parts(folder, 2, result)
        results.append(result)
    assert results[0].waiting == [0] and not results[0].complete
    assert results[1].complete and results[1].waiting == [] and results[1].total_token_bytes == 16 + 32
    top = read_manifest(folder)
    assert [(p.file, p.rows) for p in top.parts] == [
        ("part-00000-of-00002-00000.arrow", 2),
        ("part-00001-of-00002-00000.arrow", 1),
    ]
    assert top.rows == 3 and top.source == "s"
    again = PrepareResult(folder, 1, 2, 1, [], 0, 0, 0.0, 1, False)
    before = (folder / MANIFEST).stat().st_mtime_ns
    join_parts(folder, 2, again)  # joined already: complete, the manifest left as it is
    assert again.complete and again.total_token_bytes == 48 and (folder / MANIFEST).stat().st_mtime_ns == before


def test_parts_prepared_with_another_config_are_not_joined(tmp_path):
    import json

    folder = tmp_path / "out"
    folder.mkdir()
    for k, prompts in ((0, {"anchor": "query: "}), (1, {})):
        manifest = {**_manifest(0).to_json(), "prompts": prompts}
        (folder / part_manifest_name(k, 2)).write_text(
            json.dumps({"part": k, "of": 2, "token_bytes": 0, "manifest": manifest})
        )
    with pytest.raises(UserError) as err:
        join_parts(folder, 2, PrepareResult(folder, 1, 2, 0, [], 0, 0, 0.0, 1, False))
    where = str(folder)
    assert str(err.value) == (
        f"{where}: prompts differs between the parts: none in part 1 of 2 (cembed_prepared.part-00001-of-00002.json), "
        f"anchor 'query: ' in part 0; every node must prepare with the same config and model: remove {where} "
        "and prepare again"
    )
    assert not (folder / MANIFEST).exists()


def _refusal(folder: Path, k: int = 0, n: int = 1, overwrite: bool = False) -> str:
    with pytest.raises(UserError) as err:
        check_folder(folder, k, n, overwrite)
    return str(err.value)


def test_check_folder_refusals_name_the_folder_and_the_fix(tmp_path):
    folder = tmp_path / "out"
    folder.write_text("")
    assert _refusal(folder) == f"--output {folder}: not a folder; give a folder path"
    folder.unlink()
    folder.mkdir()
    (folder / MANIFEST).write_text("{}")
    assert _refusal(folder) == f"--output {folder}: already a prepared source; give another folder or --overwrite"
    assert _refusal(folder, 0, 2, overwrite=True) == (
        f"--overwrite with --part: remove {folder} before the nodes start (a node cannot tell another "
        "node's new part from an old one)"
    )
    (folder / MANIFEST).unlink()
    (folder / "notes.txt").write_text("mine")
    assert _refusal(folder) == (
        f"--output {folder}: the folder is not empty (notes.txt...); give an empty or new folder, or --overwrite"
    )
    (folder / "notes.txt").unlink()
    for name, n, says in (
        ("part-1-2.arrow", 1, "another number of parts; this run is one process (no --part)"),
        ("part-00000.arrow", 2, "one process (no --part); this run is --part 1/2"),
        ("part-00000-of-00003-00000.arrow", 2, "--part K/3; this run is --part 1/2"),
        ("cembed_prepared.part-00000-of-00003.json", 1, "--part K/3; this run is one process (no --part)"),
    ):
        (folder / name).write_text("")
        assert _refusal(folder, n - 1, n) == (
            f"--output {folder}: holds {name}, written by {says}: give a new folder, or remove {folder} "
            "and prepare every part again"
        )
        (folder / name).unlink()
    check_folder(tmp_path / "new", 0, 1, False)  # a new folder is fine (made later)


def test_check_folder_removes_this_parts_leftovers_and_keeps_the_others(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    mine = [
        ".tmp-00001-x",
        "part-00001-of-00002-00000.arrow",
        part_manifest_name(1, 2),
        "." + part_manifest_name(1, 2) + ".tmp",
    ]
    theirs = [".tmp-00000-x", "part-00000-of-00002-00000.arrow", part_manifest_name(0, 2), ".lock"]
    for name in mine + theirs:
        (folder / name).mkdir() if name.startswith(".tmp-") else (folder / name).write_text("")
    check_folder(folder, 1, 2, False)
    assert sorted(p.name for p in folder.iterdir()) == sorted(theirs)
    one = tmp_path / "one"
    one.mkdir()
    # a one-process run owns every name a preparation writes (of N = 1, or of no N)
    for name in (
        ".tmp-x",
        "part-00000.arrow",
        ".cembed_prepared.json.tmp",
        "cembed_prepared.part-x.json",
        ".cembed_prepared.part-x.json.tmp",
    ):
        (one / name).mkdir() if name.startswith(".tmp-") else (one / name).write_text("")
    (one / ".lock").write_text("")
    check_folder(one, 0, 1, False)
    assert [p.name for p in one.iterdir()] == [".lock"]
    (one / MANIFEST).write_text("{}")
    (one / "sub").mkdir()
    (one / "link").symlink_to(one / "sub")
    check_folder(one, 0, 1, True)  # --overwrite: everything goes, a link without its target
    assert list(one.iterdir()) == []


def test_datasets_cache_points_into_the_folder_while_the_block_runs_and_is_restored(tmp_path, hf_cache):
    from cembed.data.tokens.writer import temporary_datasets_cache

    before = (datasets.config.HF_DATASETS_CACHE, datasets.config.DOWNLOADED_DATASETS_PATH)
    before += (datasets.config.EXTRACTED_DATASETS_PATH,)
    with temporary_datasets_cache(tmp_path / "t" / "cache") as folder:
        assert folder == tmp_path / "t" / "cache" and folder.is_dir()
        downloads = folder / datasets.config.DOWNLOADED_DATASETS_DIR
        assert datasets.config.HF_DATASETS_CACHE == folder and datasets.config.DOWNLOADED_DATASETS_PATH == downloads
        assert datasets.config.EXTRACTED_DATASETS_PATH == downloads / datasets.config.EXTRACTED_DATASETS_DIR
    after = (datasets.config.HF_DATASETS_CACHE, datasets.config.DOWNLOADED_DATASETS_PATH)
    assert after + (datasets.config.EXTRACTED_DATASETS_PATH,) == before


def test_a_joined_results_figures_are_the_whole_folders(tmp_path):
    from cembed.data.tokens.writer import folder_bytes

    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"x" * 5)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c").write_bytes(b"x" * 100)  # not in the folder itself
    assert folder_bytes(tmp_path) == 15
    joined = PrepareResult(tmp_path, 1, 2, 2, [], 40, 30, 0.0, 1, True, total_rows=4, disk_bytes=100)
    joined.total_token_bytes = 80
    assert joined.bytes_per_row == 25 and joined.ratio == 1.25
    part = PrepareResult(tmp_path, 1, 2, 2, [], 40, 30, 0.0, 1, False, total_rows=4, disk_bytes=100)
    assert part.bytes_per_row == 20 and part.ratio == 40 / 30
    empty = PrepareResult(tmp_path, 3, 4, 0, [], 0, 0, 0.0, 1, False)
    assert empty.bytes_per_row == 0 and empty.ratio == 0


def test_parse_part_auto_reads_torchruns_environment(monkeypatch):
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert part_manifest_name(*parse_part("auto")) == "cembed_prepared.part-00003-of-00004.json"


def test_ids_that_differ_from_the_models_preprocessing_are_refused(tmp_path, monkeypatch):
    import cembed.data.tokens.writer as W

    _ids_file(tmp_path / "a.arrow", [[2, 5, 3], [2, 6, 3]])
    rows = Dataset.from_dict({"anchor": ["a", "b"]})
    seen = []

    def differs(model, collator, head, prompts):
        seen.append((head.column_names, len(head), prompts))
        return False

    monkeypatch.setattr(W, "matches_model_preprocessing", differs)
    with pytest.raises(UserError) as err:
        W.check_equivalence("model", "collator", rows, tmp_path, ["a.arrow"], {"anchor": "q: "}, "tiny")
    assert str(err.value) == (
        "model tiny: the stored ids differ from the model's own preprocessing; a prepared source needs a model "
        "whose inputs are plain token ids: train from the text source instead"
    )
    assert seen == [(["anchor", "anchor_input_ids"], 2, {"anchor": "q: "})]
    W.check_equivalence("model", "collator", rows.select([]), tmp_path, [], {}, "tiny")  # no rows: nothing to check
    assert len(seen) == 1
