"""What cembed does around a multi-vector run (issue 40 item 4), part by part: the trainer built from the
kind's sentence-transformers classes, the meter's FLOPs with the token projection, ``estimate``'s MaxSim
FLOPs, cache and scoring-memory bound, the probe's worst case with the ragged cache per column, and
``validate``'s summary."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.loss import loss_config
from cembed.config.model import model_config
from cembed.losses.registry import build_loss
from cembed.model.kinds.lookup import kind_of, model_kind
from cembed.model.load import load_model
from cembed.train import estimate as est
from cembed.train.flops import build_flop_model, encoder_shape
from cembed.train.kinds import trainer_for_kind
from cembed.train.trainer import CembedTrainer


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    cfg = model_config(
        kind="multi_vector", name_or_path=str(tiny_model_dir), dim=16, query_length=12, document_length=24
    )
    return load_model(cfg, "cpu", seed=0)


def test_the_trainer_is_cembeds_with_the_kinds_classes(model):
    from sentence_transformers.multi_vector_encoder import (
        MultiVectorEncoder,
        MultiVectorEncoderDataCollator,
        MultiVectorEncoderTrainingArguments,
    )

    from cembed.data.tokens.collator import TextCollator

    assert trainer_for_kind(CembedTrainer, model_kind("dense")) is CembedTrainer  # dense: unchanged
    trainer = trainer_for_kind(CembedTrainer, kind_of(model))
    assert issubclass(trainer, CembedTrainer) and trainer.model_class is MultiVectorEncoder
    assert trainer.training_args_class is MultiVectorEncoderTrainingArguments
    collator = trainer.data_collator_class
    assert issubclass(collator, TextCollator) and issubclass(collator, MultiVectorEncoderDataCollator)
    assert collator._get_task_for_column(collator, "anchor", 0, {}) == "query"
    assert collator._get_task_for_column(collator, "negative_1", 2, {}) == "document"


def test_the_meter_counts_the_token_projection(model):
    n, layers, width = encoder_shape(model)
    flops = build_flop_model(model, cached=True, precision="fp32", device="cpu")
    assert flops.non_embedding_params == n + 32 * 16  # 2 x 32 x 16 FLOPs per token = 2 x (32 x 16)
    assert (flops.layers, flops.attention_width) == (layers, width)


QUERIES = ["a man on a bus", "two dogs", "the red car by the white one", "people"]
DOCUMENTS = ["a man is riding the bus", "dogs playing in the park", "a red car", "people at the street with a dog"]


def test_the_meter_counts_maxsim_scoring_as_estimate_does(model, monkeypatch):
    """One cached_maxsim training step through the meter: its FLOPs are the encoder's (4 passes over the
    real tokens, the projection in N) plus MaxSim's counted by hand, 4 passes (forward, the backward's
    recompute, its two products) x 2 D x every scored query token x every scored document token; and
    :func:`cembed.train.flops.scoring_flops`, which ``estimate`` calls, is the same count."""
    from types import SimpleNamespace

    import torch

    import cembed.train.meter as meter_module
    from cembed.train.meter import ThroughputMeter

    built = build_loss(model, loss_config(name="cached_maxsim"), 2)
    flops = build_flop_model(model, cached=True, precision="fp32", device="cpu")
    features = [model.preprocess(QUERIES, task="query"), model.preprocess(DOCUMENTS, task="document")]
    with torch.no_grad():  # the scored tokens (the scoring mask the model writes), by hand
        scored = [int(model(dict(f), task=t)["attention_mask"].sum()) for f, t in zip(features, ("query", "document"))]
    lengths = [n for f in features for n in f["attention_mask"].sum(dim=1).tolist()]
    now = [100.0]
    monkeypatch.setattr(meter_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    meter = ThroughputMeter(built.token_counts, flops)
    meter.start()
    built.module([dict(f) for f in features], None).backward()
    now[0] = 110.0
    stats = meter.snapshot(step=1)
    n, layers, width = flops.non_embedding_params, flops.layers, flops.attention_width
    encoder = 4 * (2 * n * sum(lengths) + 4 * layers * width * sum(x * x for x in lengths))
    maxsim = 4 * 2 * 16 * scored[0] * scored[1]
    assert stats["flops_per_s"] == pytest.approx((encoder + maxsim) / 10, rel=1e-9)
    assert maxsim > 1e-3 * encoder  # far above the tolerance: a meter without it fails
    from cembed.train.flops import scoring_flops

    assert scoring_flops(model, scored[0], scored[1]) == maxsim
    assert meter.totals()["flop_model"]["scoring_flops_per_pair"] == 4 * 2 * 16


def test_estimate_counts_maxsim_with_the_meters_formula(tiny_model_dir, write_config, pairs_file, tmp_path):
    """``cembed estimate``'s MaxSim FLOPs per step, by hand: 4 passes x 2 D x (8 queries x their mean
    tokens) x (8 documents x their mean tokens), the tokens as the model's own preprocess gives them."""
    from conftest import distinct_pairs

    rows = distinct_pairs(16)
    path = write_config(
        {
            "model": {"kind": "multi_vector", "name_or_path": str(tiny_model_dir), "device": "cpu", "dim": 16},
            "data": {"train": str(pairs_file(rows)), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        }
    )
    out = tmp_path / "estimate.json"
    r = CliRunner().invoke(app, ["estimate", str(path), "--gpu", "A100", "--mfu", "0.5", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    built = load_model(model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), dim=16), "cpu")
    mean = {
        column: float(built.preprocess([r[column] for r in rows], task=task)["attention_mask"].sum()) / len(rows)
        for column, task in (("anchor", "query"), ("positive", "document"))
    }
    by_hand = 4 * 2 * 16 * (8 * mean["anchor"]) * (8 * mean["positive"])
    assert report["scoring_flops_per_step"]["value"] == pytest.approx(by_hand, rel=1e-12)


def test_estimate_adds_maxsim_flops_to_the_step():
    stats = est.TokenStats(8, 30.0, 600.0, {}, 0.0, {"anchor": 10.0, "positive": 20.0})
    base = est.estimate_run(stats, 8, 4, 4, (100, 2, 32, 4), est.Rate(1e9, "x"), 1)
    scoring = 4 * 2 * 16 * (8 * 10) * (8 * 20)  # 4 passes x 2 dim x query tokens x document tokens
    run = est.estimate_run(stats, 8, 4, 4, (100, 2, 32, 4), est.Rate(1e9, "x"), 1, (scoring, "maxsim"))
    assert run["flops_per_step"]["value"] == base["flops_per_step"]["value"] + scoring
    assert run["scoring_flops_per_step"] == {"value": scoring, "unit": "FLOP", "source": "maxsim"}
    assert "scoring_flops_per_step" not in base
    assert kind_of_model_flops(16, 80, 160) == 2 * 16 * 80 * 160


def kind_of_model_flops(dim: int, q: float, d: float) -> float:
    class Fake:
        def get_embedding_dimension(self):
            return dim

    return model_kind("multi_vector").scoring_flops(Fake(), q, d)


def test_the_scoring_memory_bound_does_not_grow_with_the_batch():
    cfg = loss_config(name="cached_maxsim", score_query_tokens=64, score_document_tokens=256, score_document_rows=32)
    small, large = cfg.scoring_memory(12, 1024)[0], cfg.scoring_memory(12, 65536)[0]
    assert small == 4 * (3 * 64 * 256 + 5 * 64 * 32) + 32 * 1024
    assert large - small == 32 * (65536 - 1024)  # four numbers per query, nothing per (query, document)
    assert loss_config(name="cached_mnrl").scoring_memory(12, 1024) is None


def test_the_probe_caches_each_column_at_its_own_length(model):
    from cembed.probe.worst_case import cached_embeddings, full_length_features, worst_case_step

    features = full_length_features(model, 3, 8)
    assert [f["input_ids"].shape[1] for f in features] == [12, 24, 24]  # query_length, document_length
    loss = build_loss(model, loss_config(name="cached_maxsim"), 4).cached_module
    values, lengths, _ = next(loss.embed_minibatch_iter(features[1], False, False, ranges=[(0, 4)]))
    reps, counts = cached_embeddings((values, lengths), [4, 4], 3, loss.replicate_minibatch)
    assert [r.shape[0] for r in reps[0]] == [int(lengths.sum())] * 2 and counts[2][1].tolist() == lengths.tolist()
    case = worst_case_step(model, loss_config(name="cached_maxsim"), 3, 8, 4, "fp32", repeats=1)
    assert case.rows == 4 and case.tokens_per_row == 24 and case.samples_per_s > 0


def test_validate_states_the_kind_and_the_scoring_bound(tiny_model_dir, write_config, pairs_file, tmp_path):
    from conftest import distinct_pairs

    path = write_config(
        {
            "model": {"kind": "multi_vector", "name_or_path": str(tiny_model_dir), "device": "cpu", "dim": 16},
            "data": {"train": str(pairs_file(distinct_pairs(40)))},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "loss": {"score_query_tokens": 64, "score_document_tokens": 256, "score_document_rows": 32},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "   kind: multi_vector   pooling: none: one 16-dim vector per token, maxsim" in lines[0]
    bound = (4 * (3 * 64 * 256 + 5 * 64 * 32) + 32 * 8) / 2**20
    assert lines[1] == (
        "loss: cached_maxsim on anchor, positive; MaxSim in tiles of 64 query x 256 document tokens, 32 documents "
        f"at a time: scoring memory at most {bound:.1f} MiB, whatever the batch"
    )
    report = json.loads(CliRunner().invoke(app, ["validate", str(path), "--json"]).output)
    assert report["model"]["kind"] == "multi_vector" and report["loss"]["scoring_memory"]["bytes"] == int(bound * 2**20)


def test_the_before_after_table_shows_maxsim_metrics():
    from cembed.cli.display.run import eval_change_rows

    block = {
        "before": {"coco_maxsim_ndcg@10": 0.5, "coco_maxsim_recall@10": 0.7, "coco_maxsim_mrr@10": 0.4},
        "after": {"coco_maxsim_ndcg@10": 0.6, "coco_maxsim_recall@10": 0.75, "coco_maxsim_mrr@10": 0.5},
    }
    rows = eval_change_rows(block)
    assert [r[0] for r in rows] == ["coco_maxsim_ndcg@10", "coco_maxsim_recall@10"]
    assert rows[0][3] == pytest.approx(0.1) and rows[1][3] == pytest.approx(0.05)
