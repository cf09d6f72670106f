"""A sparse model trains through cembed's whole run (issue 41 items 1, 3): ``model.kind: sparse`` with its
default loss ``cached_splade``; the regularizer weights ramp up as sentence-transformers' scheduler callback
ramps them (the trainer runs the loss's callback, with the config's schedule); the meter reports the
sparse cache (active dimensions per column, bytes per row, dense fallbacks) and counts the MLM head's
FLOPs; it evaluates by exact dot-product retrieval before, during and after training and keeps the best
checkpoint by a ``<set>_dot_*`` metric; the saved folder loads in plain sentence-transformers as a
``SparseEncoder``, gives the trained model's sparse embeddings and scores as ``cembed eval`` scores it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import distinct_pairs, make_tiny_splade
from sentence_transformers import SparseEncoder

from cembed.config.file import config_from_dict
from cembed.train import recipe as T
from cembed.train.flops import encoder_shape

pytestmark = pytest.mark.slow  # trains

STEPS, WARMUP = 4, 0.5


def beir_folder(folder, rows: list[dict]):
    """A BEIR folder of the first 24 rows: their positives the documents, the first 8 anchors the queries."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = {f"d{i}": r["positive"] for i, r in enumerate(rows[:24])}
    queries = {f"q{i}": r["anchor"] for i, r in enumerate(rows[:8])}
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in docs.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (folder / "qrels").mkdir(exist_ok=True)
    rels = "".join(f"q{i}\td{i}\t1\n" for i in range(8))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + rels)
    return folder


def test_a_sparse_run_ramps_its_regularizers_meters_its_cache_and_saves_a_sparse_encoder(tmp_path, pairs_file):
    make_tiny_splade(tmp_path / "m", bias=-0.2)
    beir = beir_folder(tmp_path / "beir", distinct_pairs(64))
    key = "beir-test_dot_ndcg@10"
    cfg = config_from_dict(
        {
            "model": {"kind": "sparse", "name_or_path": str(tmp_path / "m" / "hf"), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(64)))},
            "eval": {"retrieval": [str(beir)], "eval_steps": 2, "metric_for_best_model": f"eval_{key}"},
            "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 8},
            "loss": {
                "regularizer_warmup_ratio": WARMUP,
                "regularizer_schedule": "linear",
                "query_regularizer_weight": 0.1,
            },
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": STEPS, "logging_steps": 1},
            "optim": {"learning_rate": 1e-3},
        }
    )
    assert cfg.loss.name == "cached_splade"
    plan, data = T.check_run_inputs(cfg)
    seen, trainers = [], []

    class Recording(T.CembedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            trainers[:] = [self]
            loss = self.loss
            seen.append((self.state.global_step, loss.document_regularizer_weight, loss.query_regularizer_weight))
            return super().training_step(model, inputs, num_items_in_batch)

    summary = T.run_training(cfg, plan, data, trainer_cls=Recording)
    # linear warm-up over int(4 * 0.5) = 2 steps: 0, half, then the full weights
    assert seen == [(0, 0.0, 0.0), (1, 1.5e-5, 0.05), (2, 3e-5, 0.1), (3, 3e-5, 0.1)]
    t = summary["throughput"]
    assert 0 < t["active_dims_query"] <= 127 and 0 < t["active_dims_document"] <= 127
    assert t["cache_bytes_per_row"] > 0 and 0.0 <= t["dense_fallback_share"] <= 1.0
    model = SparseEncoder(str(tmp_path / "run"), device="cpu")
    card = (tmp_path / "run" / "README.md").read_text()  # sentence-transformers' sparse model card
    assert "- **Model Type:** SPLADE Sparse Encoder" in card and '"cache_form": "auto"' in card
    assert f"| **{key.split('_', 1)[1]}**" in card and "| corpus_active_dims" in card  # the final evaluation
    n, _, _ = encoder_shape(model)
    assert t["flop_model"]["non_embedding_params"] == n + 32 * 127  # the tied decoder's hidden x vocab
    ev = summary["eval"]
    assert [e["step"] for e in ev["during"]] == [2, 4] and ev["best"]["metric"] == key
    for when in ("before", "after"):
        assert ev[when][key] > 0 and 0 < ev[when]["beir-test_corpus_active_dims"] <= 127, when
        assert 0 < ev[when]["beir-test_query_active_dims"] <= 127, when
    texts = ["question number 3", "answer text 7 and more words"]
    trained = trainers[0].model.eval()
    for encode in ("encode_query", "encode_document"):
        mine = getattr(trained, encode)(texts, convert_to_tensor=True).to_dense()
        plain = getattr(model, encode)(texts, convert_to_tensor=True).to_dense()
        assert (mine != 0).any() and torch.allclose(plain, mine, atol=1e-5, rtol=0)

    # plain sentence-transformers' own sparse evaluator on the saved folder gives cembed eval's numbers
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    from cembed.eval.score import score_model
    from cembed.eval.sets import load_beir

    rs = load_beir(beir)
    stock = SparseInformationRetrievalEvaluator(rs.queries, rs.corpus, rs.relevant_docs, name=rs.name)(model)
    metrics = score_model(str(tmp_path / "run"), [beir], [], device="cpu", no_cache=True).sets[rs.name]["metrics"]
    for k in ("dot_ndcg@10", "dot_mrr@10", "dot_map@100", "dot_recall@10", "query_active_dims", "corpus_active_dims"):
        assert metrics[f"{rs.name}_{k}"] == pytest.approx(stock[f"{rs.name}_{k}"], abs=1e-5), k
    assert metrics[key] == pytest.approx(ev["after"][key], abs=1e-5)  # the run's own last evaluation


def test_an_inference_free_run_trains_its_static_query_side_the_same_from_stored_ids_and_from_texts(
    tmp_path, pairs_file
):
    """Queries go down the static route (sentence-transformers' router_mapping with texts, the stored ids'
    task otherwise): the static weights of the query tokens move, no other; the run from stored ids (the
    query column without special tokens) trains the same weights as the collator that tokenizes."""
    make_tiny_splade(tmp_path / "m", bias=-0.2)
    rows = distinct_pairs(32)
    weights = {}
    for pretokenize in (True, False):
        out = tmp_path / f"run-{pretokenize}"
        cfg = config_from_dict(
            {
                "model": {
                    "kind": "sparse",
                    "name_or_path": str(tmp_path / "m" / "hf"),
                    "device": "cpu",
                    "architecture": "inference_free_splade",
                },
                "data": {"train": str(pairs_file(rows)), "pretokenize": pretokenize},
                "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 8},
                "train": {"output_dir": str(out), "max_steps": 2, "seed": 3},
                "optim": {"learning_rate": 1e-2, "weight_decay": 0.0},  # a weight no query has stays at 1
            }
        )
        plan, data = T.check_run_inputs(cfg)
        summary = T.run_training(cfg, plan, data)
        assert summary["tokenization"]["pretokenized"] is pretokenize
        weights[pretokenize] = SparseEncoder(str(out), device="cpu")
    static = {k: m[0].sub_modules["query"][0].weight.detach() for k, m in weights.items()}
    tokenizer = weights[True].tokenizer
    in_queries = {t for r in rows for t in tokenizer(r["anchor"], add_special_tokens=False)["input_ids"]}
    moved = set((static[True] != 1.0).nonzero().flatten().tolist())
    assert moved and moved <= in_queries  # only the query tokens' weights (they start at 1)
    torch.testing.assert_close(static[True], static[False], rtol=0, atol=1e-6)
    a, b = (dict(m.named_parameters()) for m in (weights[True], weights[False]))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
