"""Field cases for ``cembed eval`` of a dense folder saved with its own similarity (a90532d), each built from a
public bug report about the same feature in the field's tools and compared with a reference computed without
cembed: sentence-transformers' own ``InformationRetrievalEvaluator`` (no ``score_functions``: the model's
``similarity``) on the same folder. The qrels are binary, so its NDCG is cembed's graded one."""

from __future__ import annotations

import json

import pytest
from conftest import save_with_similarity, write_toy_beir
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.eval.score import score_dims, score_model

DOCS = {f"d{i}": f"document number {i} about {t}" for i, t in enumerate(["cats", "dogs", "cars", "boats", "trees"])}
QUERIES = {"q1": "cats", "q2": "boats", "q3": "a tree"}
QRELS = {"q1": {"d0"}, "q2": {"d3"}, "q3": {"d4"}}


def _beir(root):
    return write_toy_beir(root, DOCS, QUERIES, QRELS)


def _stock(folder, **model_kwargs) -> dict:
    """sentence-transformers' own evaluator on ``folder`` (the reference)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    model = SentenceTransformer(str(folder), device="cpu", **model_kwargs)
    evaluator = InformationRetrievalEvaluator(QUERIES, DOCS, QRELS, mrr_at_k=[10], ndcg_at_k=[10], name="toy-test")
    return evaluator(model)


def test_a_dot_folder_with_a_normalize_module_is_scored_by_dot(tiny_model_dir, tmp_path):
    """embeddings-benchmark/mteb#1731 (non-cosine similarity of SentenceTransformer models ignored, always
    cos_sim) and huggingface/sentence-transformers#2467 (a dot model whose embeddings are normalized: dot and
    cosine agree). A folder with a Normalize module saved as ``dot``: the keys say dot, the numbers equal
    sentence-transformers' evaluator."""
    folder = save_with_similarity(tiny_model_dir, tmp_path / "m", "dot", normalize=True)
    report = score_model(str(folder), [_beir(tmp_path / "toy")], [], device="cpu", cache_dir=tmp_path / "c")
    stock = _stock(folder)
    metrics = report.sets["toy-test"]["metrics"]
    assert metrics["toy-test_dot_ndcg@10"] == pytest.approx(stock["toy-test_dot_ndcg@10"], abs=1e-9)
    assert metrics["toy-test_dot_mrr@10"] == pytest.approx(stock["toy-test_dot_mrr@10"], abs=1e-9)
    assert not any("_cosine_" in k for k in metrics)


def test_a_folder_saved_without_a_similarity_is_scored_by_cosine(tiny_model_dir, tmp_path):
    """embeddings-benchmark/mteb#1731: older folders (facebook/contriever-msmarco) carry no
    ``similarity_fn_name`` (null in config_sentence_transformers.json). sentence-transformers reads that as
    cosine; so must cembed (cosine keys, equal numbers), not fail on a None name."""
    folder = save_with_similarity(tiny_model_dir, tmp_path / "m", "cosine")
    config = folder / "config_sentence_transformers.json"
    data = json.loads(config.read_text())
    data["similarity_fn_name"] = None
    config.write_text(json.dumps(data))
    report = score_model(str(folder), [_beir(tmp_path / "toy")], [], device="cpu", cache_dir=tmp_path / "c")
    stock = _stock(folder)
    assert "toy-test_cosine_ndcg@10" in stock
    metrics = report.sets["toy-test"]["metrics"]
    assert metrics["toy-test_cosine_ndcg@10"] == pytest.approx(stock["toy-test_cosine_ndcg@10"], abs=1e-9)


def test_eval_json_of_a_dot_folder_names_its_metrics_by_dot(tiny_model_dir, tmp_path):
    """The same report through the CLI a user runs: ``cembed eval --json`` of a dot folder writes
    ``<set>_dot_*`` keys whose values are sentence-transformers' evaluator's."""
    folder = save_with_similarity(tiny_model_dir, tmp_path / "m", "dot")
    out = tmp_path / "eval.json"
    args = ["eval", "-m", str(folder), "-r", str(_beir(tmp_path / "toy")), "--device", "cpu"]
    r = CliRunner().invoke(app, [*args, "--json", str(out), "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    metrics = json.loads(out.read_text())["sets"]["toy-test"]["metrics"]
    stock = _stock(folder)
    for key in ("toy-test_dot_ndcg@10", "toy-test_dot_mrr@10", "toy-test_dot_map@100"):
        assert metrics[key] == pytest.approx(stock[key], abs=1e-9), key
    assert not any("_cosine_" in k for k in metrics)


def test_a_dot_folder_with_prompts_is_scored_as_stock(tiny_model_dir, tmp_path):
    """huggingface/sentence-transformers#1643 / #2441 (a model's saved config should drive how it is scored):
        a dot folder saved with ``query`` / ``document`` prompts. sentence-transformers' evaluator encodes through
        ``encode_query`` / ``encode_document`` (the prompts) and scores by dot; cembed must give the same numbers
    (here the prompts change NDCG@10: 0.833 with them, 1.0 without)."""
    prompts = {"query": "query: ", "document": "passage: "}
    folder = save_with_similarity(tiny_model_dir, tmp_path / "m", "dot", prompts=prompts)
    report = score_model(str(folder), [_beir(tmp_path / "toy")], [], device="cpu", cache_dir=tmp_path / "c")
    stock = _stock(folder)
    assert report.prompts["query"]["prompt"] == "query: " and report.prompts["document"]["prompt"] == "passage: "
    assert stock["toy-test_dot_ndcg@10"] != _stock(tiny_model_dir, similarity_fn_name="dot")["toy-test_dot_ndcg@10"]
    metrics = report.sets["toy-test"]["metrics"]
    assert metrics["toy-test_dot_ndcg@10"] == pytest.approx(stock["toy-test_dot_ndcg@10"], abs=1e-9)
    assert metrics["toy-test_dot_mrr@10"] == pytest.approx(stock["toy-test_dot_mrr@10"], abs=1e-9)


def test_eval_dims_of_a_dot_folder_equals_stock_truncate_dim(tiny_model_dir, tmp_path):
    """huggingface/blog#2024 and Snowflake-Labs/arctic-embed#8 (is cutting the embedding the same as
    sentence-transformers' ``truncate_dim``?): ``cembed eval --dims 8`` of a dot folder slices the cached
    full-size corpus; the reference loads the folder with ``truncate_dim=8`` and runs the stock evaluator,
    the dot product of the first 8 dimensions (not renormalized)."""
    folder = save_with_similarity(tiny_model_dir, tmp_path / "m", "dot")
    dims = score_dims(str(folder), [_beir(tmp_path / "toy")], [], [8], device="cpu", cache_dir=tmp_path / "c")
    stock = _stock(folder, truncate_dim=8)
    assert dims.scores[8]["toy-test"]["NDCG@10"] == pytest.approx(stock["toy-test_dot_ndcg@10"], abs=1e-9)
    assert dims.scores[8]["toy-test"]["MRR@10"] == pytest.approx(stock["toy-test_dot_mrr@10"], abs=1e-9)
