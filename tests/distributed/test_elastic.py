"""Runs that outlive their machines (issue 33): resume on another world size.

A run of ``batch.global_batch_size: 8`` trains the same on 2 gloo ranks x 4 rows as on 1 process x 8
rows (the cached loss gathers the candidates). Its checkpoint at step 3 (mid-epoch: 32 rows, 4 steps an
epoch, 6 steps with AdamW and a warmup + cosine schedule) resumes on the other world size: the
optimizer and scheduler state load as they are, the sampler's global batches (same seed) are re-sliced
for the new ranks and the batches already trained are skipped by the global step. Resumed 2 -> 1 and
1 -> 2, the final weights equal the uninterrupted 2-rank run's within 1e-5 and every later step logs
the same LR and loss. With dropout on, the same resume completes and its summary names the re-seeded
per-process RNG streams.

One pair of spawned processes runs every 2-rank part (module fixture); the 1-process runs run here.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from conftest import join_gloo_rank

pytestmark = pytest.mark.slow  # 2 spawned gloo ranks (module fixture)

WORLD = 2
ROWS = 32
STEPS = 6
OPTIM = {
    "learning_rate": 1e-2,
    "lr_scaling": "none",
    "warmup_ratio": 0.5,
    "weight_decay": 0.01,
    "lr_scheduler_type": "cosine",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp: Path, model_dir: Path, out: str, steps: int = STEPS, save_steps: int = 3) -> dict:
    """The same config on any world size that divides 8: ``batch.global_batch_size: 8`` from
    ``ROWS`` distinct pairs (4 global batches an epoch)."""
    data = tmp / "pairs.jsonl"
    if not data.exists():
        rows = [{"anchor": f"a query about topic {i}", "positive": f"the passage on topic {i}"} for i in range(ROWS)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": {"name_or_path": str(model_dir), "max_seq_length": 32, "device": "cpu"},
        "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
        "batch": {"global_batch_size": 8, "mini_batch_size": 2},
        "optim": OPTIM,
        "loss": {"name": "cached_mnrl", "scale": 20},
        "train": {"max_steps": steps, "save_steps": save_steps, "logging_steps": 1, "output_dir": str(tmp / out)},
    }


def _run(tmp: Path, model_dir: Path, out: str, resume_from: str | None = None, **kwargs) -> dict:
    """One run: its summary and the learning rate each step logged."""
    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training
    from cembed.train.trainer import CembedTrainer

    record: list = []

    class RecordingTrainer(CembedTrainer):
        def train(self, *args, **kw):
            record.append(self)
            return super().train(*args, **kw)

    cfg = config_from_dict(_config(tmp, model_dir, out, **kwargs), base=tmp)
    plan, data = check_run_inputs(cfg)
    summary = run_training(cfg, plan, data, resume_from=resume_from, trainer_cls=RecordingTrainer)
    history = record[-1].state.log_history
    return {
        "summary": summary,
        "lrs": [[h["step"], h["learning_rate"]] for h in history if "learning_rate" in h],
    }


def _worker(rank: int, tmp: str, model_dir: str, dropout_model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 600)
    from cembed.distributed.group import leave_process_group

    tmp_path = Path(tmp)
    results = {
        "two": _run(tmp_path, Path(model_dir), "two"),
        "one-to-two": _run(tmp_path, Path(model_dir), "one-to-two", str(tmp_path / "one" / "checkpoint-3")),
        "dropout-two": _run(tmp_path, Path(dropout_model_dir), "dropout-two", steps=2, save_steps=1),
    }
    if rank == 0:
        (tmp_path / "results.json").write_text(json.dumps(results, default=str))
    leave_process_group()


@pytest.fixture(scope="module")
def elastic_runs(tiny_model_dir, tiny_dropout_model_dir, tmp_path_factory):
    """Every run: 1 process straight (its checkpoint-3 resumes on 2 ranks), then on 2 spawned ranks the
    straight run, that resume and a dropout run; then here the 2 -> 1 resumes."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("elastic")
    runs = {"one": _run(tmp, tiny_model_dir, "one")}
    mp.spawn(_worker, args=(str(tmp), str(tiny_model_dir), str(tiny_dropout_model_dir), _free_port()), nprocs=WORLD)
    runs |= json.loads((tmp / "results.json").read_text())
    runs["two-to-one"] = _run(tmp, tiny_model_dir, "two-to-one", str(tmp / "two" / "checkpoint-3"))
    runs["dropout-two-to-one"] = _run(
        tmp,
        tiny_dropout_model_dir,
        "dropout-two-to-one",
        str(tmp / "dropout-two" / "checkpoint-1"),
        steps=2,
        save_steps=1,
    )
    return tmp, runs


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _max_dw(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.mark.parametrize("resumed", ["two-to-one", "one-to-two"])
def test_resume_on_another_world_size_equals_the_uninterrupted_run(elastic_runs, resumed, tiny_model_dir):
    tmp, runs = elastic_runs
    straight, run = runs["two"], runs[resumed]
    losses = dict(map(tuple, straight["summary"]["losses"]))
    assert sorted(losses) == list(range(1, STEPS + 1))
    # Each step trains another batch: a batch skipped wrongly on resume would move the loss by far more.
    assert min(abs(losses[s] - losses[t]) for s in losses for t in losses if s < t) > 1e-3
    resumed_losses = dict(map(tuple, run["summary"]["losses"]))
    assert sorted(resumed_losses) == [4, 5, 6]
    d_loss = max(abs(resumed_losses[s] - losses[s]) for s in resumed_losses)
    # The schedule really moves (warmup to step 3, then cosine) and the resumed steps log its rates.
    lrs = dict(map(tuple, straight["lrs"]))
    assert len(set(lrs.values())) == STEPS
    resumed_lrs = {s: v for s, v in map(tuple, run["lrs"]) if s > 3}  # (steps 1-3: the checkpoint's history)
    assert resumed_lrs == pytest.approx({s: lrs[s] for s in (4, 5, 6)}, abs=1e-12)
    d_w = _max_dw(tmp / "two", tmp / resumed)
    moved = _max_dw(tmp / "two", Path(tiny_model_dir))
    print(
        f"\n{resumed} resume vs uninterrupted 2 ranks: max|dW| {d_w:.2e} (max update {moved:.2e}), max|dloss| {d_loss:.2e}"
    )
    assert d_w <= 1e-5 and d_loss <= 1e-5 and moved > 1e-3
    summary = run["summary"]
    old, new = (2, 1) if resumed == "two-to-one" else (1, 2)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert f"world_size {old} -> {new}" in summary["resume_changes"]
    assert summary["plan"]["per_device_train_batch_size"] == 8 // new


def test_one_process_equals_two_ranks(elastic_runs):
    tmp, runs = elastic_runs
    assert _max_dw(tmp / "two", tmp / "one") <= 1e-5


def test_dropout_resume_on_another_world_size_names_the_reseeded_streams(elastic_runs):
    _, runs = elastic_runs
    summary = runs["dropout-two-to-one"]["summary"]
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["resume_changes"][-2:] == [
        "world_size 2 -> 1",
        "RNG streams (dropout) re-seeded per rank: the checkpoint holds 2 process(es)' RNG states, this run has 1",
    ]
