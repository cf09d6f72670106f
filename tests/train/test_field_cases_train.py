"""Field cases (issue 39 item 10) for what ``validate`` promises of ``train`` and for ``cembed sweep``,
each built from a public bug report about the same feature in the field's tools and compared with a
reference computed without cembed (sentence-transformers' own loss constructor, a by-hand mean of the
recorded step losses, a fresh sweep). docs/development.md lists the round."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import distinct_pairs, make_static_model, make_tiny_model
from typer.testing import CliRunner

import cembed.train.sweep as S
from cembed.cli.app import app
from cembed.config.file import load_config
from cembed.errors import UserError


def _config(tmp, model, **sections):
    data = tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(16)))
    cfg = {
        "model": {"name_or_path": str(model), "device": "cpu"},
        "data": {"train": str(data)},
        "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
        "train": {"output_dir": str(tmp / "run"), "max_steps": 1, "seed": 42, **sections.pop("train", {})},
        **sections,
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _guide_refusal(guide) -> str:
    return (
        f"error: loss.guide: {str(guide)!r} is a StaticEmbedding model: a guide must be a transformer model with a "
        "transformers tokenizer (sentence-transformers' GIST loss compares its vocabulary with the trained "
        "model's and re-tokenizes the texts for it); use a transformer model as loss.guide"
    )


def test_a_guide_without_a_transformers_tokenizer_is_refused_by_validate(tmp_path, tiny_model_dir):
    """sentence-transformers#3219 and #3993 (GIST losses crash on a guide whose tokenizer is not the
    kind they compare): a StaticEmbedding guide loads, so ``validate`` said OK, and ``train`` then
    failed at step 0 (exit 3) in sentence-transformers' constructor. The reference: that constructor,
    called by hand on the same two models, refuses the pair; ``validate`` refuses it in one line."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss

    guide = make_static_model(tmp_path / "static")
    with pytest.raises(ValueError, match="must use a PreTrainedTokenizer from transformers"):
        CachedGISTEmbedLoss(SentenceTransformer(str(tiny_model_dir)), SentenceTransformer(str(guide)))
    path = _config(tmp_path, tiny_model_dir, loss={"name": "cached_gist", "guide": str(guide)})
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 2 and r.output.strip() == _guide_refusal(guide), r.output


def test_loading_a_static_guide_is_refused_with_the_same_words(tmp_path):
    """Where the loss is built (cembed.losses.gist, after pre-flight): the same line, not the library's
    ValueError at the first step."""
    from cembed.model.load import load_guide_model

    guide = make_static_model(tmp_path / "static")
    with pytest.raises(UserError) as err:
        load_guide_model(str(guide), "cpu")
    assert f"error: {err.value}" == _guide_refusal(guide)


@pytest.mark.slow
def test_train_refuses_the_static_guide_with_validates_line(tmp_path, tiny_model_dir):
    guide = make_static_model(tmp_path / "static")
    path = _config(tmp_path, tiny_model_dir, loss={"name": "cached_gist", "guide": str(guide)})
    r = CliRunner().invoke(app, ["train", str(path)])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == _guide_refusal(guide), r.output


# --- the sweep's record: the model it trains, by content ---------------------------------------------


def _fake_runs(monkeypatch):
    """Each trial's training replaced by a summary whose metric is its LR; returns the LRs trained."""
    calls = []

    def fake_run(cfg, plan, data, *args, **kwargs):
        calls.append(plan.learning_rate)
        return {
            "step_losses": [[1, 0.5]],
            "eval": {"before": None, "after": {"sts_spearman_cosine": plan.learning_rate}},
        }

    monkeypatch.setattr(S, "run_training", fake_run)
    return calls


def _sweep_config(tmp, model):
    (tmp / "sts.tsv").write_text("".join(f"a car on road {i}\ta vehicle on a street {i}\t{i % 5}\n" for i in range(8)))
    return _config(tmp, model, eval={"sts": str(tmp / "sts.tsv")}, optim={"learning_rate": 1e-3})


def test_a_model_folder_retrained_in_place_is_another_sweep(tmp_path, monkeypatch):
    """sentence-transformers#3338 (mining's embedding cache keyed by the model's name, so two
    fine-tunes of one base shared entries) and optuna#3255 (a resumed study reusing what it should
    not): a sweep over ``runs/base``, then ``runs/base`` trained again in place (same path, other
    weights), read every trial of the old weights back and reported them. The reference: the weights
    differ (compared by hand); the rerun is refused naming the model, and trains afresh with --overwrite."""
    from safetensors.torch import load_file

    model = make_tiny_model(tmp_path / "base", seed=0)
    config, out = _sweep_config(tmp_path, model), tmp_path / "s"
    calls = _fake_runs(monkeypatch)
    S.run_sweep(config, [1.0], steps=1, out=out)
    assert S.run_sweep(config, [1.0], steps=1, out=out).ran == [] and len(calls) == 1  # unchanged: read back
    old = load_file(str(model / "model.safetensors"))
    make_tiny_model(tmp_path / "base", seed=1)  # the folder retrained in place
    new = load_file(str(model / "model.safetensors"))
    assert any(not old[k].equal(new[k]) for k in old)  # other weights, same path
    with pytest.raises(UserError) as err:
        S.run_sweep(config, [1.0], steps=1, out=out)
    message = str(err.value)
    assert message.startswith(f"sweep: {out / 'study.db'} was run on another model: model.name_or_path ({model}) held ")
    assert message.endswith(
        "now (retrained in place?): its trials trained the old weights; use a new --out or --overwrite to move the "
        "old study aside"
    ), message
    assert len(calls) == 1
    assert S.run_sweep(config, [1.0], steps=1, out=out, overwrite=True).ran == [1.0] and len(calls) == 2


def test_a_hub_id_is_recorded_by_its_cached_snapshot(tmp_path, monkeypatch):
    """The same report for a hub id: recorded by its name only, a newer snapshot fetched into the cache
    since (``refs/main`` moved: what loading it offline now reads) read the old trials back. The reference:
    the hub cache's own layout (``models--org--name/refs/main`` names ``snapshots/<commit>``). The sweep
    is refused naming both snapshot folders; a cache without the model records it by name (no entry)."""
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for commit, seed in (("a" * 40, 0), ("b" * 40, 1)):
        make_tiny_model(repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    config, out = _sweep_config(tmp_path, "org/tiny"), tmp_path / "s"
    record = S.files_record(load_config(config))
    assert record["model.name_or_path (files)"]["source"] == str(repo / "snapshots" / ("a" * 40))
    calls = _fake_runs(monkeypatch)
    S.run_sweep(config, [1.0], steps=1, out=out)
    assert S.run_sweep(config, [1.0], steps=1, out=out).ran == [] and len(calls) == 1  # unchanged: read back
    (repo / "refs" / "main").write_text("b" * 40)  # a newer snapshot fetched since
    with pytest.raises(UserError) as err:
        S.run_sweep(config, [1.0], steps=1, out=out)
    assert f"model.name_or_path was read from {repo / 'snapshots' / ('a' * 40)} and is read from " in str(err.value)
    assert str(err.value).endswith(
        f"{repo / 'snapshots' / ('b' * 40)} now (another snapshot?): its trials trained the old weights; use a new "
        "--out or --overwrite to move the old study aside"
    ), str(err.value)
    assert len(calls) == 1
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    assert S.files_record(load_config(config)) == {}  # not cached: by name only


# --- the step line's labelled interval mean against the trainer's own log --------------------------


@pytest.mark.slow
def test_the_logged_means_are_the_trainers_own_with_a_tail_and_accumulation(tmp_path, tiny_model_dir):
    """huggingface/transformers#15047 ("very different loss reported during training vs. at the end")
    with #15096's "various logging_steps values", and Lightning-AI#15831 (the bar's loss differs from
    the logged one, unlabelled): 7 steps logged every 3 (step 7 is a tail no line covers), 2
    accumulated micro-batches per step. The reference: transformers' own ``log_history`` in the
    checkpoint's trainer_state.json. Each train.log line is its entry at that step, labelled with the
    steps it averages; the done line's "first and last logged means" are its first and last entries."""
    import re

    config = _config(
        tmp_path,
        tiny_model_dir,
        batch={"per_device_train_batch_size": 4, "mini_batch_size": 2, "gradient_accumulation_steps": 2},
        optim={"learning_rate": 1e-3, "base_batch_size": 8},
        train={"max_steps": 7, "logging_steps": 3, "save_steps": 7},
    )
    r = CliRunner().invoke(app, ["train", str(config)], terminal_width=200)
    assert r.exit_code == 0, r.output
    state = json.loads((tmp_path / "run" / "checkpoint-7" / "trainer_state.json").read_text())
    library = {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}
    assert sorted(library) == [1, 3, 6]  # the trainer logs no line for the tail step 7
    lines = [line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if "  loss " in line]
    logged = {
        int(m[1]): (float(m[2]), m[3]) for m in (re.search(r"step (\d+)/7  loss (\S+)(.*?)  lr", x) for x in lines)
    }
    assert sorted(logged) == [1, 3, 6]
    labels = {1: "", 3: " (mean of steps 2-3)", 6: " (mean of steps 4-6)"}
    for step, (loss, label) in logged.items():
        assert abs(loss - library[step]) < 1e-4 and label == labels[step], (step, loss, label, library)
    done = re.search(r"loss (\S+) -> (\S+) \(first and last logged means\)", r.output)
    assert done and (float(done[1]), float(done[2])) == (round(library[1], 4), round(library[6], 4)), r.output
