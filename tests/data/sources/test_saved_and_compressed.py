"""Data as libraries save it (issue 39 item 5): a ``datasets`` ``save_to_disk`` folder (a Dataset, a
DatasetDict with its split chosen by name, or the DatasetDict's split folder given directly) reads
exactly as ``datasets.load_from_disk`` reads it, memory-mapped; JSON Lines and CSV compressed with
gzip, bzip2, xz or Zstandard read as the plain file; a shard cembed cannot read is refused by name in
``validate`` as in ``train``, never skipped while its siblings train."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import sys
from pathlib import Path

import datasets
import pytest
import yaml
from safetensors.torch import load_file as load_weights
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import config_from_dict
from cembed.data.sources.registry import load_source
from cembed.errors import UserError
from cembed.train.recipe import check_run_inputs, run_training


def _rows(n: int, tag: str = "") -> list[dict]:
    return [{"anchor": f"topic {i % 13}{tag}", "positive": f"passage number {i}{tag}", "id": i} for i in range(n)]


def _source(train, base: Path):
    return config_from_dict({"data": {"train": train}}, base=base).data.sources()[0].source


def _refusal(read, *args) -> str:
    with pytest.raises(UserError) as err:
        read(*args)
    return str(err.value)


def _compress(text: bytes, suffix: str) -> bytes:
    if suffix == ".zst":
        import zstandard

        return zstandard.ZstdCompressor().compress(text)
    return {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress, "": bytes}[suffix](text)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(_compress(text, next((s for s in (".gz", ".bz2", ".xz", ".zst") if path.name.endswith(s)), "")))
    return path


# --- save_to_disk folders --------------------------------------------------------------------------------


def test_a_saved_dataset_reads_as_load_from_disk_memory_mapped(tmp_path):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(_rows(20)).save_to_disk(str(saved), num_shards=2)
    source = _source("saved", tmp_path)
    assert source.kind == "saved"
    loaded = load_source(source)
    reference = datasets.load_from_disk(str(saved))
    assert loaded.to_list() == reference.to_list() == _rows(20)
    assert loaded.features == reference.features
    # memory-mapped from the folder's own Arrow files, not copied into memory or a cache
    assert sorted(f["filename"] for f in loaded.cache_files) == sorted(str(p) for p in saved.glob("*.arrow"))


def test_a_saved_dataset_dict_reads_the_split_chosen_by_name_default_train(tmp_path):
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(_rows(12)), "validation": datasets.Dataset.from_list(_rows(5, " (v)"))}
    ).save_to_disk(str(folder))
    reference = datasets.load_from_disk(str(folder))
    assert load_source(_source("dd", tmp_path)).to_list() == reference["train"].to_list()
    picked = load_source(_source({"path": "dd", "split": "validation"}, tmp_path))
    assert picked.to_list() == reference["validation"].to_list() == _rows(5, " (v)")
    assert load_source(_source("dd/train", tmp_path)).to_list() == reference["train"].to_list()  # its split folder
    message = _refusal(load_source, _source({"path": "dd", "split": "test"}, tmp_path))
    assert message == (
        f"{folder}: the saved DatasetDict has no split 'test' (its splits: train, validation); "
        "set data.train.split to one of them"
    )


def test_a_split_for_a_saved_dataset_of_one_split_must_be_its_own(tmp_path):
    datasets.Dataset.from_list(_rows(6)).save_to_disk(str(tmp_path / "one"))
    assert load_source(_source({"path": "one", "split": "train"}, tmp_path)).num_rows == 6  # the default, accepted
    message = _refusal(load_source, _source({"path": "one", "split": "validation"}, tmp_path))
    assert message == (
        f"{tmp_path / 'one'}: a saved Dataset (one split), not a DatasetDict: data.train.split 'validation' "
        "picks nothing; remove split, or give the DatasetDict's folder"
    )


def test_a_folder_that_is_not_a_saved_dataset_is_refused(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    message = _refusal(load_source, _source({"kind": "saved", "path": "plain"}, tmp_path))
    assert message == (
        f"{tmp_path / 'plain'}: not a folder datasets' save_to_disk wrote (no state.json with dataset_info.json, "
        "no dataset_dict.json)"
    )


def test_validate_accepts_a_saved_folder_it_once_read_as_its_state_json(tmp_path, tiny_model_dir):
    datasets.Dataset.from_list(_rows(24)).save_to_disk(str(tmp_path / "saved"))
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": "saved", "columns": {"ignore": ["id"]}, "cache_dir": str(tmp_path / "cache")},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
                "train": {"max_steps": 1, "output_dir": str(tmp_path / "run")},
            }
        )
    )
    r = CliRunner().invoke(app, ["validate", str(config)])
    assert r.exit_code == 0, r.output
    assert "24 rows" in r.output and "_fingerprint" not in r.output


# --- compressed files --------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_compressed_file_reads_as_the_plain_one(tmp_path, suffix, fmt):
    rows = [{"anchor": r["anchor"], "positive": r["positive"]} for r in _rows(9)]
    if fmt == "jsonl":
        text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    else:
        text = ("anchor,positive\n" + "".join(f"{r['anchor']},{r['positive']}\n" for r in rows)).encode()
    (tmp_path / f"plain.{fmt}").write_bytes(text)
    (tmp_path / f"packed.{fmt}{suffix}").write_bytes(_compress(text, suffix))
    plain = load_source(_source(f"plain.{fmt}", tmp_path))
    packed_source = _source(f"packed.{fmt}{suffix}", tmp_path)
    assert packed_source.kind == "file"  # inferred: a local file by its extension
    assert load_source(packed_source).to_list() == plain.to_list() == rows


def test_a_folder_mixing_gz_and_zst_shards_reads_every_row(tmp_path):
    rows = _rows(40)
    _jsonl(tmp_path / "mixed" / "part-0.jsonl.gz", rows[:20])
    _jsonl(tmp_path / "mixed" / "part-1.jsonl.zst", rows[20:])
    cfg = {
        "data": {"train": "mixed", "columns": {"ignore": ["id"]}},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
    }
    data = check_run_inputs(config_from_dict(cfg, base=tmp_path))[1]
    assert data.rows_read == 40 and data.sources[0].files == 2 and data.sources[0].skipped == ()
    assert data.dataset["positive"] == [r["positive"] for r in rows]


def _validate_and_train(tmp_path, tiny_model_dir, train) -> list:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": train, "cache_dir": str(tmp_path / "cache")},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
                "train": {"max_steps": 1, "output_dir": str(tmp_path / "run")},
            }
        )
    )
    return [CliRunner().invoke(app, [command, str(config)]) for command in ("validate", "train")]


def test_a_shard_compressed_in_a_way_cembed_cannot_read_is_refused_by_name(tmp_path, tiny_model_dir):
    rows = _rows(40)
    _jsonl(tmp_path / "mixed" / "part-0.jsonl.gz", rows[:20])
    lz4 = tmp_path / "mixed" / "part-1.jsonl.lz4"
    lz4.write_bytes(b"\x04\x22\x4d\x18 not really lz4")
    for r in _validate_and_train(tmp_path, tiny_model_dir, str(tmp_path / "mixed")):
        assert r.exit_code == 2, r.output
        assert r.output.strip().splitlines()[-1] == (
            f"error: {lz4}: a .lz4 file: cembed reads JSON Lines, JSON, CSV and TSV plain or compressed with .gz, "
            ".bz2, .xz or .zst, and Parquet plain; decompress it, or compress it with one of those"
        ), r.output


def test_which_files_are_refused_and_which_skipped_in_a_folder(tmp_path):
    """A data file compressed another way is refused (a .parquet compressed whole too); a file that is
    not data (a checksum, notes) is still skipped and listed."""
    from cembed.config.sources import FileSource
    from cembed.data.sources.file_kind import resolve_shards
    from cembed.data.sources.text import foreign_compression

    assert [foreign_compression(Path(n)) for n in ("a.jsonl.lz4", "a.CSV.zip", "a.parquet.gz", "a.jsonl.zst")] == [
        ".lz4",
        ".zip",
        ".gz",
        None,
    ]
    assert foreign_compression(Path("notes.zip")) is None and foreign_compression(Path("a.json.crc")) is None
    folder = tmp_path / "job"
    _jsonl(folder / "part-0.jsonl.xz", _rows(4))
    (folder / "part-0.jsonl.crc").write_text("crc")
    (folder / "notes.zip").write_bytes(b"PK")
    shards = resolve_shards(FileSource(path=str(folder)))
    assert shards.files == [folder / "part-0.jsonl.xz"]
    assert shards.skipped == ("notes.zip (not a data file)", "part-0.jsonl.crc (not a data file)")
    (folder / "part-1.parquet.gz").write_bytes(b"\x1f\x8b")
    assert _refusal(resolve_shards, FileSource(path=str(folder))).startswith(
        f"{folder / 'part-1.parquet.gz'}: a .gz file: cembed reads"
    )


def test_zst_without_zstandard_is_one_line_naming_the_package(tmp_path, tiny_model_dir, monkeypatch):
    rows = _rows(40)
    _jsonl(tmp_path / "mixed" / "part-0.jsonl.gz", rows[:20])
    zst = _jsonl(tmp_path / "mixed" / "part-1.jsonl.zst", rows[20:])
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard -> ImportError
    for r in _validate_and_train(tmp_path, tiny_model_dir, str(tmp_path / "mixed")):
        assert r.exit_code == 2, r.output
        assert r.output.strip().splitlines()[-1] == (
            f"error: {zst}: a Zstandard-compressed file needs the zstandard package: pip install zstandard "
            "(or pip install 'cembed[zstd]')"
        ), r.output


# --- acceptance: the same rows train to the same weights --------------------------------------------------


@pytest.mark.slow
def test_a_saved_dataset_a_dataset_dict_and_the_jsonl_train_to_equal_weights(tmp_path, tiny_model_dir):
    rows = [{"anchor": r["anchor"], "positive": r["positive"]} for r in _rows(24)]
    _jsonl(tmp_path / "rows.jsonl", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        {"validation": datasets.Dataset.from_list(rows[:8]), "train": datasets.Dataset.from_list(rows)}
    ).save_to_disk(str(tmp_path / "dd"))

    def train(source, out: str):
        cfg = config_from_dict(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": source, "cache_dir": str(tmp_path / "cache")},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
                "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
                "train": {"max_steps": 3, "logging_steps": 1, "output_dir": str(tmp_path / out), "seed": 5},
            },
            base=tmp_path,
        )
        plan, data = check_run_inputs(cfg)
        summary = run_training(cfg, plan, data)
        return summary, load_weights(str(tmp_path / out / "model.safetensors"))

    reference, weights = train("rows.jsonl", "from-jsonl")
    for source in ("saved", "dd", {"path": "dd", "split": "train"}):
        summary, other = train(source, f"from-{len(list(tmp_path.glob('from-*')))}")
        assert summary["step_losses"] == reference["step_losses"]
        assert max((other[k] - weights[k]).abs().max().item() for k in weights) == 0.0, source
