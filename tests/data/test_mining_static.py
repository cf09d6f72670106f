"""``cembed mine-negatives`` with a StaticEmbedding model (issue 39 item 2): a model whose
``max_seq_length`` is infinite (``int(model.max_seq_length)`` raised OverflowError before).

sentence-transformers' own hard-negative tests (``tests/util/test_hard_negatives.py``, run there on
the StaticEmbedding model static-retrieval-mrl-en-v1) ported to cembed's miner: each case whose
options cembed exposes (text pairs, ``sampling_strategy="top"``, ``columns`` = its ``n-tuple``,
``rows`` = its ``triplet``) runs cembed's miner and sentence-transformers' ``mine_hard_negatives``
on the same data, model and options, on a random StaticEmbedding built here (no download), and
the written rows must be the library's rows; its refusals must be one-line UserErrors."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from conftest import make_static_model

from cembed.data.mining import mine_negatives
from cembed.errors import UserError

# sentence-transformers' test data (tests/util/test_hard_negatives.py)
QUERIES = [
    "What is the capital of France?",
    "Who wrote the novel 1984?",
    "What is the largest planet in our solar system?",
    "Who painted the Mona Lisa?",
    "What is the speed of light?",
    "What is the chemical symbol for gold?",
    "Who developed the theory of relativity?",
    "What is the tallest mountain in the world?",
]
PASSAGES = [
    "Paris is the capital of France and one of the most populated cities in Europe.",
    "George Orwell wrote the dystopian novel Nineteen Eighty-Four (1984), which was published in 1949.",
    "Jupiter is the largest planet in our solar system and the fifth planet from the sun.",
    "Leonardo da Vinci painted the Mona Lisa between 1503 and 1519.",
    "The speed of light in vacuum is approximately 299,792,458 meters per second.",
    "The chemical symbol for gold is Au, derived from the Latin word 'Aurum'.",
    "Albert Einstein developed the theory of relativity, which revolutionized our understanding of space, time, "
    "and gravity.",
    "Mount Everest is the tallest mountain in the world, with a peak that reaches 8,848 meters (29,029 feet) above "
    "sea level.",
]
Q, P = QUERIES, PASSAGES

# (sentence-transformers' test it ports, queries, passages, options): every case whose options cembed has
CASES = [
    ("test_basic_functionality", Q, P, {}),
    ("test_basic_functionality/triplet", Q, P, {"output_format": "rows"}),
    ("test_range_parameters", Q, P, {"range_min": 1, "range_max": 4}),
    ("test_margin_parameters/absolute", Q, P, {"absolute_margin": 0.1}),
    ("test_margin_parameters/relative", Q, P, {"relative_margin": 0.05}),
    ("test_num_negatives", Q, P, {"num_negatives": 2}),
    ("test_output_formats/triplet", Q, P, {"output_format": "rows", "num_negatives": 2}),
    ("test_multiple_positives_per_query", Q[:3] + Q[:2], P[:3] + P[5:7], {"range_max": 3, "output_format": "rows"}),
    ("multiple_positive_queries_dataset", Q + Q, [f"Copy {i}, {p}" for i in range(2) for p in P], {}),
    ("multiple_positive_passages_dataset", [f"Copy {i}, {q}" for i in range(2) for q in Q], P + P, {}),
    ("multiple_positive_dataset", Q + Q, P + P, {"output_format": "rows"}),
    (
        "test_larger_dataset_with_combinations",
        [f"{q} {i}" for i in range(4) for q in Q],
        P * 4,
        {"range_min": 1, "range_max": 15, "absolute_margin": 0.05, "num_negatives": 2, "batch_size": 4},
    ),
    ("test_tiny_corpus", Q[:2], P[:2], {"num_negatives": 1, "range_max": 1, "output_format": "rows"}),
    ("test_num_negatives_matching_range_window_is_allowed", Q, P, {"num_negatives": 3, "range_max": 3}),
]


@pytest.fixture(scope="module")
def static_dir(tmp_path_factory):
    return make_static_model(tmp_path_factory.mktemp("static") / "model")


def _write_pairs(path, queries, passages):
    path.write_text("".join(json.dumps({"query": q, "passage": p}) + "\n" for q, p in zip(queries, passages)))
    return path


def _library(model, queries, passages, options: dict, prompts=("", "")) -> list[dict]:
    """sentence-transformers' mine_hard_negatives on the same pairs, as cembed calls it (top ranks)."""
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    options = dict(options)
    fmt = options.pop("output_format", "columns")
    with contextlib.redirect_stdout(io.StringIO()):
        mined = mine_hard_negatives(
            Dataset.from_dict({"query": queries, "passage": passages}),
            model,
            sampling_strategy="top",
            output_format="n-tuple" if fmt == "columns" else "triplet",
            query_prompt=prompts[0],
            corpus_prompt=prompts[1],
            verbose=False,
            **options,
        )
    return mined.to_list()


def _cembed(model_dir, data, out, options: dict, **extra) -> tuple[list[dict], object]:
    report = mine_negatives(str(data), str(model_dir), out, anchor_column="query", positive_column="passage",
                            device="cpu", **{"no_cache": True, **options, **extra})  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()], report


def _multiset(rows: list[dict]) -> list[str]:
    # cembed writes the pairs in input order, the library groups them by anchor: compared as multisets
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_static_model_mines_what_sentence_transformers_mines(static_dir, tmp_path, case):
    from sentence_transformers import SentenceTransformer

    _, queries, passages, options = case
    data = _write_pairs(tmp_path / "pairs.jsonl", queries, passages)
    ours, report = _cembed(static_dir, data, tmp_path / "mined.jsonl", options)
    ref = _library(SentenceTransformer(str(static_dir), device="cpu"), queries, passages, options)
    assert len(ref) > 0 and _multiset(ours) == _multiset(ref)
    neg_cols = [c for c in ref[0] if c.startswith("negative")]
    assert report.rows_out == len(ref) and report.negatives == len(ref) * len(neg_cols)


def test_static_model_with_prompts_and_cache(tmp_path):
    """sentence-transformers' test_prompts and test_cache: the model's own query/document prompts are
    used (as the library's query_prompt/corpus_prompt), and a second run reads the corpus
    embeddings from the cache and writes the same rows."""
    from sentence_transformers import SentenceTransformer

    model_dir = make_static_model(tmp_path / "prompted", prompts={"query": "query: ", "document": "passage: "})
    data = _write_pairs(tmp_path / "pairs.jsonl", Q, P)
    options = {"num_negatives": 2}
    first, report = _cembed(model_dir, data, tmp_path / "a.jsonl", options, no_cache=False, cache_dir=tmp_path / "c")
    ref = _library(SentenceTransformer(str(model_dir), device="cpu"), Q, P, options, ("query: ", "passage: "))
    unprompted = _library(SentenceTransformer(str(model_dir), device="cpu"), Q, P, options)
    assert report.prompts == {"query": "query: ", "document": "passage: "}
    assert _multiset(first) == _multiset(ref) != _multiset(unprompted)  # the prompts change what is mined
    again, second = _cembed(model_dir, data, tmp_path / "b.jsonl", options, no_cache=False, cache_dir=tmp_path / "c")
    assert (report.cache_hit, second.cache_hit, again) == (False, True, first)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # test_num_negatives_exceeds_range_window, test_range_min_must_be_non_negative,
        # test_range_min_must_be_below_range_max, test_num_negatives_must_be_positive
        ({"num_negatives": 10, "range_max": 3}, "range_max - range_min >= num_negatives"),
        ({"range_min": -5, "range_max": 8}, "range_min >= 0"),
        ({"range_min": 3, "range_max": 3}, "range_max - range_min >= num_negatives"),
        ({"range_min": 5, "range_max": 3}, "range_max - range_min >= num_negatives"),
        ({"num_negatives": 0}, "num_negatives >= 1"),
        ({"num_negatives": -1}, "num_negatives >= 1"),
    ],
)
def test_static_model_refusals_are_one_line(static_dir, tmp_path, options, message):
    data = _write_pairs(tmp_path / "pairs.jsonl", Q, P)
    with pytest.raises(UserError, match=message) as err:
        _cembed(static_dir, data, tmp_path / "o.jsonl", options)
    assert "\n" not in str(err.value)


def test_empty_data_is_refused(static_dir, tmp_path):
    """sentence-transformers' test_empty_dataset (a ValueError there): a one-line refusal here."""
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match=r"empty.jsonl"):
        _cembed(static_dir, tmp_path / "empty.jsonl", tmp_path / "o.jsonl", {})


def test_static_model_compares_texts_by_its_tokenizers_own_limit(tmp_path):
    """A StaticEmbedding whose tokenizer truncates at 4 tokens embeds "a man sitting at a table" and
    "a man sitting at the bus" alike: the second, another row's positive, is the first row's positive
    as the model sees it, so it is never that row's negative (sentence-transformers, comparing strings,
    ranks it first for the query "a man sitting": it scores exactly as the positive)."""
    from sentence_transformers import SentenceTransformer

    model_dir = make_static_model(tmp_path / "truncating", truncation=4)
    model = SentenceTransformer(str(model_dir), device="cpu")
    queries = ["a man sitting", "a red bus near a car", "the cat sat on a plate", "people in a room"]
    passages = ["a man sitting at a table", "a man sitting at the bus", "a white plate with food", "a small blue car"]
    same = model.encode(passages[:2], convert_to_tensor=True)
    assert bool((same[0] == same[1]).all())  # the model cannot tell them apart
    data = _write_pairs(tmp_path / "pairs.jsonl", queries, passages)
    rows, report = _cembed(model_dir, data, tmp_path / "o.jsonl", {"num_negatives": 1, "output_format": "rows"})
    assert report.variants == 1 and report.corpus == 3
    assert all({r["passage"], r["negative"]} != set(passages[:2]) for r in rows), rows
    library = _library(model, queries, passages, {"num_negatives": 1, "output_format": "rows"})
    assert {"query": queries[0], "passage": passages[0], "negative": passages[1]} in library  # what it avoids


def test_token_limit_of_a_model_without_a_finite_length():
    from types import SimpleNamespace

    from cembed.data.mining import token_limit

    huge = SimpleNamespace(model_max_length=int(1e30))  # transformers' VERY_LARGE_INTEGER: no limit saved
    assert token_limit(64, huge) == 64 and token_limit(64.0, huge) == 64
    assert token_limit(math.inf, SimpleNamespace(model_max_length=128)) == 128
    assert token_limit(None, SimpleNamespace(model_max_length=512)) == 512
    assert token_limit(math.inf, huge) == token_limit(None, SimpleNamespace()) >= 10**12  # every token


def test_a_library_failure_is_one_line(static_dir, tmp_path, monkeypatch):
    """Any error inside sentence-transformers' mine_hard_negatives (here a RuntimeError with a
    second line) ends `cembed mine-negatives` with one line naming the model and the error, exit 2."""
    import sentence_transformers.util
    from typer.testing import CliRunner

    from cembed.cli.app import app

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nSee the documentation")

    monkeypatch.setattr(sentence_transformers.util, "mine_hard_negatives", fail)
    data = _write_pairs(tmp_path / "pairs.jsonl", Q, P)
    r = CliRunner().invoke(app, ["mine-negatives", str(data), "--model", str(static_dir), "-o", str(tmp_path / "o.jsonl"),
                                 "--anchor-column", "query", "--positive-column", "passage", "--no-cache",
                                 "--device", "cpu"], terminal_width=400)  # fmt: skip
    lines = [line for line in r.output.splitlines() if line.strip() and not line.startswith(("Batches", "Computing"))]
    assert r.exit_code == 2 and lines == [
        f"error: mine-negatives --model {static_dir}: sentence-transformers' mine_hard_negatives failed: "
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    ], r.output


def test_the_cache_key_holds_a_static_tokenizers_own_limit(tmp_path):
    """Two StaticEmbedding models that differ only in their tokenizer's truncation embed texts
    differently, so the mining cache folder (the model fingerprint) must differ; the same model
    loaded twice keeps one folder."""
    from sentence_transformers import SentenceTransformer

    from cembed.data.mining import mining_cache_folder

    def folder(path):
        return mining_cache_folder(SentenceTransformer(str(path), device="cpu"), tmp_path)

    plain, cut = make_static_model(tmp_path / "plain"), make_static_model(tmp_path / "cut", truncation=4)
    assert folder(plain) == folder(plain) != folder(cut)
