"""Training from a stream (issue 24 item 4): ``data.train.streaming`` trains on the windowed
no-duplicate batches (:mod:`cembed.data.batching.windowed`). Several ranks train their slices of the
same global batches: tests/distributed/test_global_numbers.py (issue 38 item 6)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from conftest import KILL_AT_STEP_3, REPO

import cembed.train.recipe as T
from cembed.config.file import config_from_dict
from cembed.data.batching.windowed import windowed_batches
from cembed.data.identity import hash_token_ids
from cembed.train.trainer import CembedTrainer

# 72 pairs; every 6th anchor repeats an earlier one and every 9th positive too, so the window rule
# defers (and with W = 0 drops) rows.
ROWS = [
    {
        "anchor": f"a dog {i % 6 if i % 6 == 0 else i} in the park",
        "positive": f"a puppy {i % 9 if i % 9 == 0 else i} on grass",
    }
    for i in range(72)
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(model_dir, tmp_path, out, data_file, streaming=None, max_steps=5, **extra):
    train = {"path": str(data_file)}
    if streaming is not None:
        train["streaming"] = streaming
    cfg = {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {"train": train, "cache_dir": str(tmp_path / "cache")},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
        "train": {"max_steps": max_steps, "logging_steps": 1, "output_dir": str(out), "seed": 3},
    }
    for key, value in extra.items():
        section, field = key.split("__")
        cfg.setdefault(section, {})[field] = value
    return cfg


class BatchesSeen(CembedTrainer):
    """Records each training batch's anchor token ids (padding stripped), in order."""

    seen: list[list[tuple[int, ...]]] = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            ids, mask = inputs["anchor_input_ids"], inputs["anchor_attention_mask"]
            type(self).seen.append([tuple(i[m.bool()].tolist()) for i, m in zip(ids, mask)])
        return super().compute_loss(model, inputs, *args, **kwargs)


def _expected_batches(model_dir, rows, batch_size, window):
    """The windowed batches of ``rows`` in file order, computed here: each batch's anchor ids."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    ids = {
        c: model.tokenizer([r[c] for r in rows], truncation=True, max_length=model.max_seq_length)["input_ids"]
        for c in ("anchor", "positive")
    }
    hashes = np.stack([hash_token_ids(pa.array(ids[c], type=pa.list_(pa.int32()))) for c in ids], axis=1)
    payloads = [tuple(a) for a in ids["anchor"]]
    return list(windowed_batches([(hashes, payloads)], batch_size, window, drop_last=True))


def _window_counts(model_dir, rows, batch_size, window):
    """The window rule's counts after reading ``rows`` (one chunk, not finished), as a dict."""
    from dataclasses import asdict

    from sentence_transformers import SentenceTransformer

    from cembed.data.batching.windowed import WindowedBatcher

    model = SentenceTransformer(str(model_dir), device="cpu")
    ids = [model.tokenizer([r[c] for r in rows], truncation=True)["input_ids"] for c in ("anchor", "positive")]
    hashes = np.stack([hash_token_ids(pa.array(i, type=pa.list_(pa.int32()))) for i in ids], axis=1)
    batcher = WindowedBatcher(batch_size, window)
    batcher.push(hashes)
    return asdict(batcher.counts)


@pytest.mark.slow
def test_stream_trains_the_windowed_batches_pass_after_pass(tiny_model_dir, tmp_path):
    """12 steps of batch 8 over a 72-row stream with duplicate texts (W = 2): the loss sees exactly
    the windowed batches of the file, in order (8 per pass), then the next pass's from the start;
    run_summary.json records the stream's counts of the pass being read."""
    data_file = _write(tmp_path / "pairs.jsonl", ROWS)
    cfg = config_from_dict(_cfg(tiny_model_dir, tmp_path, tmp_path / "out", data_file, {"window_batches": 2}, 12))
    plan, data = T.check_run_inputs(cfg)
    BatchesSeen.seen = []
    summary = T.run_training(cfg, plan, data, trainer_cls=BatchesSeen)
    expected = _expected_batches(tiny_model_dir, ROWS, 8, 2)
    assert len(expected) == 8  # 64 rows placed, 1 dropped, 7 left at the end of a pass
    assert BatchesSeen.seen == expected + expected[:4]
    assert [s for s, _ in summary["step_losses"]] == list(range(1, 13))
    assert summary["data"]["rows_trained"] is None and summary["data"]["batches_per_epoch"] is None
    # A stream's unplaced rows are its dropped ones, in stream.counts: not a 0 that reads as "none".
    assert summary["data"]["rows_unplaced_first_epoch"] is None
    (entry,) = summary["data"]["sources"]
    stream = entry["stream"]
    assert (stream["window_batches"], stream["pass"], stream["rank"], stream["world_size"]) == (2, 1, 0, 1)
    assert stream["counts"] == _window_counts(tiny_model_dir, ROWS, 8, 2)  # the second pass, read so far
    (first,) = stream["earlier_passes"]  # the first pass, read to its end
    assert (first["rows_read"], first["batches"], first["placed"], first["dropped"]) == (72, 8, 64, 1)
    assert first["left_at_end"] == 7 and first["buffered"] == 0
    assert stream["counts"]["dropped"] == 1 and stream["counts"]["deferred"] == 12
    assert entry["rows_checked"] == 72 and entry["rows"] is None


@pytest.mark.slow
def test_stream_in_the_samplers_order_trains_as_the_full_table(tiny_model_dir, tmp_path):
    """The rows written in the full-table sampler's epoch-0 permutation (seed 3) and streamed with
    a window past the stream's batches: the same batches, so the same step losses, as the
    full-table run on the file in its own order."""
    table = _write(tmp_path / "table.jsonl", ROWS)
    order = np.random.default_rng(3).permutation(len(ROWS))  # NoDuplicatesSampler, epoch 0, seed 3
    stream = _write(tmp_path / "stream.jsonl", [ROWS[i] for i in order])
    runs = {}
    for name, path, streaming in (("table", table, None), ("stream", stream, {"window_batches": 100})):
        cfg = config_from_dict(_cfg(tiny_model_dir, tmp_path, tmp_path / name, path, streaming, max_steps=7))
        plan, data = T.check_run_inputs(cfg)
        BatchesSeen.seen = []
        summary = T.run_training(cfg, plan, data, trainer_cls=BatchesSeen)
        runs[name] = (BatchesSeen.seen, summary["step_losses"])
    assert runs["stream"][0] == runs["table"][0]  # batch for batch, row for row
    table_losses, stream_losses = runs["table"][1], runs["stream"][1]
    assert [s for s, _ in stream_losses] == list(range(1, 8))
    assert [v for _, v in stream_losses] == pytest.approx([v for _, v in table_losses], abs=1e-6)


def _refusal(tiny_model_dir, tmp_path, change):
    data_file = _write(tmp_path / "pairs.jsonl", ROWS)
    cfg = _cfg(tiny_model_dir, tmp_path, tmp_path / "out", data_file, {"window_batches": 2})
    change(cfg)
    return cfg


def _two_sources(cfg):
    cfg["data"]["train"] = {"a": dict(cfg["data"]["train"]), "b": {"path": cfg["data"]["train"]["path"]}}


REFUSALS = {
    "no max_steps": (
        lambda c: c["train"].update(max_steps=None, num_train_epochs=1),
        "data.train.streaming: a stream has no length; set train.max_steps",
    ),
    "several sources": (_two_sources, "data.train.a.streaming: a streaming source must be the only training source"),
    "prompts": (lambda c: c["data"].update(prompts={"anchor": "query: "}), "data.prompts.anchor: a streaming source"),
    "workers": (
        lambda c: c["train"].update(dataloader_num_workers=2),
        "train.dataloader_num_workers: 2: a stream is read by one data-loader process",
    ),
    "drop invalid": (lambda c: c["data"].update(drop_invalid_rows=True), "data.drop_invalid_rows: a streaming"),
    "no_duplicates false": (lambda c: c.update(sampler={"no_duplicates": False}), "sampler.no_duplicates: false"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_a_stream_cannot_do_is_refused_naming_the_field(tiny_model_dir, tmp_path, write_config, case):
    change, message = REFUSALS[case]
    path = write_config(_refusal(tiny_model_dir, tmp_path, change))
    r = subprocess.run(
        [sys.executable, "-m", "cembed", "validate", str(path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


KILL_AT_STEP_10 = KILL_AT_STEP_3.replace("global_step == 3", "global_step == 10")


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_a_stream_killed_in_its_second_pass_and_resumed_equals_uninterrupted(
    tiny_dropout_model_dir, tmp_path, write_config
):
    """SIGTERM at step 10 (the second pass of a shuffled 8-batch stream), then --resume: the resumed
    run skips the 10 batches trained, into the second pass, and steps 11-14 have the uninterrupted
    run's losses; the final weights agree."""
    data_file = _write(tmp_path / "pairs.jsonl", ROWS)
    streaming = {"window_batches": 2, "shuffle_buffer": 1000}
    env_run = dict(cwd=REPO, capture_output=True, text=True, timeout=600)
    paths = {
        name: write_config(
            _cfg(tiny_dropout_model_dir, tmp_path, tmp_path / name, data_file, streaming, 14), name=f"{name}.yaml"
        )
        for name in ("straight", "killed")
    }
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(paths["straight"])], **env_run)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", KILL_AT_STEP_10, str(paths["killed"])], **env_run)
    assert r.returncode == 143, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(paths["killed"]), "--resume"], **env_run)
    assert r.returncode == 0, r.stderr
    straight = json.loads((tmp_path / "straight" / "run_summary.json").read_text())
    resumed = json.loads((tmp_path / "killed" / "run_summary.json").read_text())
    assert resumed["resumed_from"].endswith("checkpoint-10")
    assert resumed["data"]["sources"][0]["stream"]["pass"] == straight["data"]["sources"][0]["stream"]["pass"] == 1
    losses, after = dict(map(tuple, straight["step_losses"])), dict(map(tuple, resumed["step_losses"]))
    assert sorted(after) == list(range(1, 15))  # 1..10 from checkpoint-10, 11..14 trained after the resume
    for step in after:
        assert after[step] == pytest.approx(losses[step], abs=1e-6), step
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "killed")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.slow
def test_every_pass_reshuffles_the_stream(tiny_model_dir, tmp_path):
    """With a shuffle buffer and data.max_samples, pass 0 trains the windowed batches of the
    stream's first 64 rows shuffled with seed 3, pass 1 those of the next shuffle (seed 3 + 1):
    the trainer's set_epoch reaches the stream."""
    from sentence_transformers import SentenceTransformer

    from cembed.config.sources import FileSource
    from cembed.data.batching.stream import StreamingSource

    data_file = _write(tmp_path / "pairs.jsonl", ROWS)
    streaming = {"window_batches": 1, "shuffle_buffer": 1000}
    raw = _cfg(tiny_model_dir, tmp_path, tmp_path / "out", data_file, streaming, 10)
    raw["data"]["max_samples"] = 64
    cfg = config_from_dict(raw)
    plan, data = T.check_run_inputs(cfg)
    BatchesSeen.seen = []
    T.run_training(cfg, plan, data, trainer_cls=BatchesSeen)
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    source = StreamingSource(
        FileSource(path=str(data_file)), ["anchor", "positive"], model.tokenizer, model.max_seq_length, 8, 1,
        shuffle_buffer=1000, seed=3, max_rows=64,
    )  # fmt: skip
    passes = []
    for epoch in (0, 1):
        source.set_epoch(epoch)
        passes.append([[tuple(r["anchor_input_ids"]) for r in batch] for batch in source])
    assert passes[0] != passes[1] and sum(map(len, passes[0])) <= 64
    assert BatchesSeen.seen == (passes[0] + passes[1])[:10]


def test_a_stream_without_one_full_batch_is_refused(tiny_model_dir, tmp_path):
    """72 rows, batches of 128 (drop_last): no batch, so no step; the message names the stream."""
    raw = _cfg(tiny_model_dir, tmp_path, tmp_path / "out", _write(tmp_path / "p.jsonl", ROWS), {}, 3)
    raw["batch"] = {"per_device_train_batch_size": 128, "mini_batch_size": 4}
    cfg = config_from_dict(raw)
    plan, data = T.check_run_inputs(cfg)
    with pytest.raises(T.UserError, match=r"^data.train.streaming: the stream gave no batch of 128 rows"):
        T.run_training(cfg, plan, data)
