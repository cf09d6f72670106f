"""Field cases (issue 39 item 10) for the data paths: data as libraries save it and ``mine-negatives``,
each built from a public bug report about the same feature in the field's tools and compared with a
reference computed without cembed (Python's gzip/bz2/lzma/json/csv readers, ``zstandard``,
``datasets.load_from_disk``, a by-hand cosine ranking, the tokenizer's own ids). The report each case
comes from is named in its docstring; docs/development.md lists the round."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import string

import datasets
import numpy as np
import pytest
import zstandard
from conftest import WORDS, make_static_model

from cembed.config.file import config_from_dict
from cembed.data.mining import mine_negatives
from cembed.data.sources.registry import load_source
from cembed.data.starter import make_starter

ROWS = [{"anchor": f"topic {i % 13}", "positive": f"passage number {i}"} for i in range(30)]
TEXT = "".join(json.dumps(r) + "\n" for r in ROWS).encode()


def _read(train, base) -> list[dict]:
    return load_source(config_from_dict({"data": {"train": train}}, base=base).data.sources()[0].source).to_list()


def _delimited(rows: list[dict], delimiter: str) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, ["anchor", "positive"], delimiter=delimiter)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def _zstd_stream(text: bytes) -> bytes:
    # As the Pile's .jsonl.zst files are written: a streaming compressor, no content size in the frame
    # header (zstandard's one-shot decompress() refuses such a frame).
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
        writer.write(text)
    return out.getvalue()


def _zstd_frames(text: bytes) -> bytes:
    # Two frames back to back (zstd's output appended to, or shards concatenated with cat).
    one = zstandard.ZstdCompressor()
    return one.compress(text[:100]) + one.compress(text[100:])


def _reference_zstd(raw: bytes) -> str:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True)
    return reader.read().decode()


# (name, file, its bytes, the reference rows from Python's own readers); the report each comes from:
# datasets#2572 and #2578 (Zstandard, streamed .jsonl.zst of the Pile), datasets#4421 (bzip2 files),
# datasets#2977 ("Impossible to load compressed csv": .csv.bz2), datasets#5088 (a .json.gz read as 0 rows).
COMPRESSED = [
    (
        "gzip of two members (cat a.gz b.gz)",
        "members.jsonl.gz",
        gzip.compress(TEXT[:200]) + gzip.compress(TEXT[200:]),
        lambda raw: [json.loads(line) for line in gzip.decompress(raw).decode().splitlines()],
    ),
    (
        "bzip2 of two streams (pbzip2)",
        "streams.jsonl.bz2",
        bz2.compress(TEXT[:100]) + bz2.compress(TEXT[100:]),
        lambda raw: [json.loads(line) for line in bz2.decompress(raw).decode().splitlines()],
    ),
    (
        "zstd frame without its content size (streamed)",
        "streamed.jsonl.zst",
        _zstd_stream(TEXT),
        lambda raw: [json.loads(line) for line in _reference_zstd(raw).splitlines()],
    ),
    (
        "zstd of two frames",
        "frames.jsonl.zst",
        _zstd_frames(TEXT),
        lambda raw: [json.loads(line) for line in _reference_zstd(raw).splitlines()],
    ),
    (
        "a JSON array gzipped (.json.gz)",
        "array.json.gz",
        gzip.compress(json.dumps(ROWS).encode()),
        lambda raw: json.loads(gzip.decompress(raw)),
    ),
    (
        "CSV in bzip2",
        "pairs.csv.bz2",
        bz2.compress(_delimited(ROWS, ",")),
        lambda raw: list(csv.DictReader(io.StringIO(bz2.decompress(raw).decode()))),
    ),
    (
        "TSV in xz",
        "pairs.tsv.xz",
        lzma.compress(_delimited(ROWS, "\t")),
        lambda raw: list(csv.DictReader(io.StringIO(lzma.decompress(raw).decode()), delimiter="\t")),
    ),
]


@pytest.mark.parametrize("case", COMPRESSED, ids=[c[0] for c in COMPRESSED])
def test_compressed_files_read_as_pythons_readers_read_them(tmp_path, case):
    _, name, raw, reference = case
    (tmp_path / name).write_bytes(raw)
    expected = reference(raw)
    assert len(expected) == 30 and _read(name, tmp_path) == expected


def test_a_folder_of_json_arrays_and_json_lines_reads_every_row(tmp_path):
    """datasets#6410: ``.json`` and ``.jsonl`` files in one folder go to the same builder; a JSON array
    beside JSON Lines files must give each file's rows, in path order (the reference: json.load and
    json.loads per line, file by file)."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(ROWS[:10]))
    (folder / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[10:20]))
    (folder / "c.json").write_text(json.dumps(ROWS[20:]))
    expected = json.loads((folder / "a.json").read_text())
    expected += [json.loads(line) for line in (folder / "b.jsonl").read_text().splitlines()]
    expected += json.loads((folder / "c.json").read_text())
    assert _read("mixed", tmp_path) == expected == ROWS


@pytest.mark.parametrize("fmt", ["numpy", "pandas", "torch"])
def test_a_dataset_saved_with_a_format_reads_its_rows_as_text(tmp_path, fmt):
    """datasets#5050: ``save_to_disk`` keeps the format a dataset was given (``set_format("torch")``
    before saving, as training scripts do) and ``load_from_disk`` restores it; the rows cembed reads
    are still the texts (the reference: load_from_disk with the format reset)."""
    saved = datasets.Dataset.from_list(ROWS)
    saved.set_format(fmt)
    saved.save_to_disk(str(tmp_path / "formatted"))
    reference = datasets.load_from_disk(str(tmp_path / "formatted"))
    assert reference.format["type"] == fmt  # the case: the format comes back
    reference.reset_format()
    assert _read("formatted", tmp_path) == reference.to_list() == ROWS


def test_a_dataset_saved_after_shuffle_and_select_reads_its_rows_in_order(tmp_path):
    """datasets#2197 (``load_from_disk`` and the indices mapping of a selected dataset): a dataset
    shuffled and cut with ``select`` before ``save_to_disk`` reads its 20 rows in the saved order."""
    datasets.Dataset.from_list(ROWS).shuffle(seed=1).select(range(20)).save_to_disk(str(tmp_path / "cut"))
    reference = datasets.load_from_disk(str(tmp_path / "cut")).to_list()
    assert len(reference) == 20 and reference != ROWS[:20]
    assert _read("cut", tmp_path) == reference


# --- the commands that take a data path of their own: init and mine-negatives ----------------------


@pytest.fixture
def saved_folders(tmp_path):
    """A Dataset's folder, a DatasetDict's folder and its train/ folder, as save_to_disk writes them."""
    rows = [{"anchor": f"question number {i}", "positive": f"answer text {i}"} for i in range(32)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    splits = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:4])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    return tmp_path, rows


@pytest.mark.parametrize("folder", ["saved", "dd", "dd/train"])
def test_init_reads_a_saved_folder_as_load_from_disk(saved_folders, folder):
    """datasets#6642, #3700 and axolotl#1430: a ``save_to_disk`` folder read as files gives the rows
    of its ``state.json`` (``_data_files, _fingerprint, ...``). ``cembed init --data <folder>`` reads
    it as ``datasets.load_from_disk`` does (a DatasetDict's train split): 32 rows, the two text
    columns proposed as anchor and positive."""
    base, rows = saved_folders
    reference = datasets.load_from_disk(str(base / folder))
    reference = reference["train"] if isinstance(reference, datasets.DatasetDict) else reference
    assert reference.to_list() == rows
    starter = make_starter(base / "c.yaml", "all-MiniLM-L6-v2", base / folder)
    assert starter.rows == len(reference) == 32
    assert starter.roles == {"anchor": "anchor", "positive": "positive"}


def test_mine_negatives_reads_a_saved_folder_as_load_from_disk(saved_folders, tmp_path):
    """sentence-transformers#3483 (mining a dataset as ``datasets`` 4 hands it over) and datasets#6642:
    ``cembed mine-negatives <save_to_disk folder>`` mines the folder's rows (a DatasetDict's train
    split), as it mines the same rows written as JSON Lines."""
    base, rows = saved_folders
    model = make_static_model(tmp_path / "static")
    plain = tmp_path / "pairs.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mined = {}
    for name, data in (("jsonl", plain), ("saved", base / "saved"), ("dd", base / "dd")):
        out = tmp_path / f"{name}.jsonl"
        report = mine_negatives(str(data), str(model), out, num_negatives=2, device="cpu", no_cache=True)
        assert report.rows_in == 32, name
        mined[name] = out.read_text()
    assert mined["saved"] == mined["dd"] == mined["jsonl"] and mined["jsonl"]


# --- mining against a by-hand ranking ----------------------------------------------------------------


def _by_hand_negatives(model, anchors: list[str], positives: list[str], k: int) -> list[list[str]]:
    """Each pair's k nearest corpus texts by cosine of the model's (unnormalised) embeddings, leaving
    out the anchor's positives and the anchor's own text: mine_hard_negatives' rule, in numpy."""
    corpus = list(dict.fromkeys(positives))
    a = model.encode(anchors, convert_to_numpy=True)
    c = model.encode(corpus, convert_to_numpy=True)
    scores = (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (c / np.linalg.norm(c, axis=1, keepdims=True)).T
    own = {}
    for anchor, positive in zip(anchors, positives):
        own.setdefault(anchor, set()).update({positive, anchor})
    out = []
    for i, anchor in enumerate(anchors):
        order = [j for j in np.argsort(-scores[i], kind="stable") if corpus[j] not in own[anchor]]
        out.append([corpus[j] for j in order[:k]])
    return out


def test_mining_with_an_unnormalised_static_model_ranks_by_cosine(tmp_path):
    """sentence-transformers#2944 ("Ensure that the embeddings from hard negative mining are
    normalized": an unnormalised model gave wrong scores): a StaticEmbedding model's embeddings are
    sums of token vectors, not unit length; cembed's negatives are the by-hand cosine ranking's."""
    from sentence_transformers import SentenceTransformer

    model_dir = make_static_model(tmp_path / "static", dim=8, seed=3)
    model = SentenceTransformer(str(model_dir), device="cpu")
    anchors = [f"{WORDS[i]} {WORDS[i + 7]} {WORDS[i + 13]}" for i in range(12)]
    positives = [f"{WORDS[i + 1]} {WORDS[i + 20]} next to {WORDS[(i * 5) % 40]}" for i in range(12)]
    norms = np.linalg.norm(model.encode(positives, convert_to_numpy=True), axis=1)
    assert norms.max() - norms.min() > 0.1  # the case: lengths differ, so dot product and cosine rank apart
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in zip(anchors, positives)))
    out = tmp_path / "mined.jsonl"
    mine_negatives(str(data), str(model_dir), out, num_negatives=3, device="cpu", no_cache=True)
    mined = [json.loads(line) for line in out.read_text().splitlines()]
    expected = _by_hand_negatives(model, anchors, positives, 3)
    assert [[r["negative_1"], r["negative_2"], r["negative_3"]] for r in mined] == expected


def _cased_static_model(path):
    """A StaticEmbedding over a cased WordPiece vocabulary (upper- and lower-case letters)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from transformers import BertTokenizerFast

    chars = list(string.ascii_letters + string.digits + ".,'!?-")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + WORDS
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}, do_lower_case=False)
    torch.manual_seed(0)
    SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=16)], device="cpu").save(str(path))
    return path


@pytest.mark.parametrize("cased", [False, True])
def test_texts_are_one_candidate_exactly_when_the_tokenizer_gives_them_one_id_sequence(tmp_path, cased):
    """sentence-transformers#1346 (a query's positive id among its mined negatives) and the review of
    #2818 (one text twice in the corpus): "Paris is a city" and "paris is a city" are one text to an
    uncased tokenizer, never a negative of either anchor; to a cased one they are two texts (other
    ids), each the other's nearest candidate. The reference: the tokenizer's own ids compared by hand,
    and the by-hand cosine ranking over the texts as the model tells them apart."""
    from sentence_transformers import SentenceTransformer

    model_dir = _cased_static_model(tmp_path / "cased") if cased else make_static_model(tmp_path / "uncased")
    model = SentenceTransformer(str(model_dir), device="cpu")
    pairs = [
        ("the capital city", "Paris is a city"),
        ("a city in france", "paris is a city"),
        ("a red bus", "the bus is red"),
        ("a black dog", "the dog is black"),
        ("two women", "two women on a train"),
        ("a cat on a table", "the cat sat on the table"),
    ]
    anchors, positives = [a for a, _ in pairs], [p for _, p in pairs]
    ids = [model[0].tokenizer.encode(p, add_special_tokens=False).ids for p in positives[:2]]
    assert (ids[0] == ids[1]) is (not cased)  # one id sequence exactly when uncased
    # by hand: a text the model cannot tell from an earlier one is that text
    seen: dict[tuple, str] = {}
    same = [seen.setdefault(tuple(model[0].tokenizer.encode(p, add_special_tokens=False).ids), p) for p in positives]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in pairs))
    out = tmp_path / "mined.jsonl"
    report = mine_negatives(str(data), str(model_dir), out, num_negatives=3, device="cpu", no_cache=True)
    mined = [json.loads(line) for line in out.read_text().splitlines()]
    assert report.variants == (0 if cased else 1) and report.corpus == len(set(same)) == (6 if cased else 5)
    assert [[r["negative_1"], r["negative_2"], r["negative_3"]] for r in mined] == _by_hand_negatives(
        model, anchors, same, 3
    )
    first = {r["negative_1"] for r in mined[:2]}
    assert first == ({"Paris is a city", "paris is a city"} if cased else first - {"Paris is a city"})
