"""Field cases for training a dense folder saved with a dot similarity (a90532d), ``batch.pad_to_multiple_of``
without pretokenizing (b09c35f) and the sweep record of a hub id (211e818), each built from a public bug report
about the same feature in the field's tools and compared with a reference computed without cembed (the
trainer's own log, the model's tokenizer by hand, the hub cache's own layout)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import distinct_pairs, make_tiny_model, write_toy_beir
from typer.testing import CliRunner

import cembed.train.recipe as T
import cembed.train.sweep as S
from cembed.cli.app import app
from cembed.config.file import config_from_dict, load_config
from cembed.train.trainer import CembedTrainer


def _pairs(tmp, n=16):
    path = tmp / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(n)))
    return path


def _beir(root):
    docs = {f"d{i}": f"document {i} about {t}" for i, t in enumerate(["cats", "dogs", "cars", "boats"])}
    return write_toy_beir(root, docs, {"q1": "cats"}, {"q1": {"d0"}})


class LogsKept(CembedTrainer):
    """Keeps the trainer's own log history (the reference for the logged metric names)."""

    history: list[dict] = []

    def log(self, logs, *args, **kwargs):
        type(self).history.append(dict(logs))
        return super().log(logs, *args, **kwargs)


@pytest.mark.slow
def test_a_dot_folder_trained_with_eval_names_its_metrics_cosine(tiny_model_dir, tmp_path):
    """huggingface/sentence-transformers#2441 / #2490 (the similarity a model is scored by should follow what it
    was trained with): a folder saved as ``dot``, trained with a retrieval eval set. Training scores by the
    cosine it trains, so ``eval.metric_for_best_model`` is ``<set>_cosine_ndcg@10`` (the dot name is refused
    with that hint); the reference is the trainer's own log, which must carry ``eval_<set>_cosine_ndcg@10``."""
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(str(tiny_model_dir), device="cpu", similarity_fn_name="dot").save(str(tmp_path / "dot"))
    beir = _beir(tmp_path / "toy")

    def cfg(metric):
        return {
            "model": {"name_or_path": str(tmp_path / "dot"), "device": "cpu"},
            "data": {"train": str(_pairs(tmp_path)), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "save_steps": 1},
            "eval": {"retrieval": [str(beir)], "eval_steps": 1, "metric_for_best_model": metric},
        }

    config = tmp_path / "dot.json"
    config.write_text(json.dumps(cfg("toy-test_dot_ndcg@10")))
    r = CliRunner().invoke(app, ["validate", str(config)])
    assert r.exit_code != 0 and "did you mean 'toy-test_cosine_ndcg@10'?" in r.output, r.output
    run_cfg = config_from_dict(cfg("toy-test_cosine_ndcg@10"))
    plan, data = T.check_run_inputs(run_cfg)
    LogsKept.history = []
    T.run_training(run_cfg, plan, data, trainer_cls=LogsKept)
    logged = {k for logs in LogsKept.history for k in logs}
    assert "eval_toy-test_cosine_ndcg@10" in logged, sorted(logged)
    assert not any("_dot_" in k for k in logged)


class WidthsSeen(CembedTrainer):
    """Records each training batch's (anchor width, longest anchor row) as the loss receives it."""

    seen: list[tuple[int, int]] = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            mask = inputs["anchor_attention_mask"]
            type(self).seen.append((mask.shape[1], int(mask.sum(1).max())))
        return super().compute_loss(model, inputs, *args, **kwargs)


@pytest.mark.slow
def test_pad_to_multiple_of_holds_for_a_streamed_source_without_pretokenize(tiny_model_dir, tmp_path):
    """huggingface/transformers#12999 (a collator given ``pad_to_multiple_of`` that never passed it on, so
    batches kept their longest-row width): a streamed source with ``data.pretokenize: false`` is padded by
    cembed's collator, so ``validate`` accepts the multiple (it refuses it for an in-memory source) and every
    batch is as wide as the longest row rounded up to 8. The reference: the model's tokenizer by hand."""
    from sentence_transformers import SentenceTransformer

    rows = [{"anchor": "word " * (3 + i % 7) + str(i), "positive": f"positive text {i}"} for i in range(32)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {"train": {"path": str(data), "streaming": {}}, "pretokenize": False, "cache_dir": str(tmp_path / "c")},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4, "pad_to_multiple_of": 8},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 3, "seed": 1},
    }
    config = tmp_path / "c.json"
    config.write_text(json.dumps(raw))
    r = CliRunner().invoke(app, ["validate", str(config)])
    assert r.exit_code == 0, r.output
    in_memory = {**raw, "data": {**raw["data"], "train": str(data)}}
    config.write_text(json.dumps(in_memory))
    r = CliRunner().invoke(app, ["validate", str(config)])
    assert r.exit_code != 0 and "batch.pad_to_multiple_of: 8 has no effect" in r.output, r.output

    cfg = config_from_dict(raw)
    plan, loaded = T.check_run_inputs(cfg)
    WidthsSeen.seen = []
    T.run_training(cfg, plan, loaded, trainer_cls=WidthsSeen)
    assert len(WidthsSeen.seen) == 3
    tokenizer = SentenceTransformer(str(tiny_model_dir), device="cpu").tokenizer
    lengths = {len(ids) for ids in tokenizer([r["anchor"] for r in rows])["input_ids"]}
    for width, longest in WidthsSeen.seen:
        assert longest in lengths  # a real row's length, computed by hand
        assert width == min(math.ceil(longest / 8) * 8, 64), WidthsSeen.seen  # 64: the tiny model's max_seq_length


def test_a_hub_id_at_a_commit_revision_is_recorded_by_that_snapshot(tmp_path, monkeypatch):
    """huggingface/huggingface_hub#4604 / marin-community/marin#8159 (a revision given as a full commit hash
    is a pinned snapshot; a branch is whatever ``refs/<branch>`` names): ``model.revision: <commit>`` is
    recorded by ``snapshots/<commit>`` even when ``refs/main`` names another, and a tag by the snapshot its
    ref names. The reference: huggingface_hub's own offline lookup, ``try_to_load_from_cache``."""
    import huggingface_hub.constants as hub_constants
    from huggingface_hub import try_to_load_from_cache

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    a, b = "a" * 40, "b" * 40
    for commit, seed in ((a, 0), (b, 1)):
        make_tiny_model(repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(a)
    (repo / "refs" / "v1").write_text(b)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for revision, commit in ((b, b), ("v1", b), (None, a)):
        (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(8)))
        model = {"name_or_path": "org/tiny", "device": "cpu", **({"revision": revision} if revision else {})}
        config = tmp_path / "c.json"
        config.write_text(
            json.dumps({"model": model, "data": {"train": str(tmp_path / "pairs.jsonl")}, "train": {"max_steps": 1}})
        )
        record = S.files_record(load_config(config))
        reference = try_to_load_from_cache("org/tiny", "st/modules.json", cache_dir=cache, revision=revision)
        assert record["model.name_or_path (files)"]["source"] == str(repo / "snapshots" / commit), revision
        assert str(reference).startswith(record["model.name_or_path (files)"]["source"] + "/"), revision
