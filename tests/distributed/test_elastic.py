"""Runs that outlive their machines (issue 33): resume on another world size.

A run of ``batch.global_batch_size: 8`` trains the same on 2 gloo ranks x 4 rows as on 1 process x 8
rows (the cached loss gathers the candidates). Its checkpoint at step 3 (mid-epoch: 32 rows, 4 steps an
epoch, 6 steps with AdamW and a warmup + cosine schedule) resumes on the other world size: the
optimizer and scheduler state load as they are, the sampler's global batches (same seed) are re-sliced
for the new ranks and the batches already trained are skipped by the global step. Resumed 2 -> 1 and
1 -> 2, the final weights equal the uninterrupted 2-rank run's within 1e-5 and every later step logs
the same LR and loss; each summary names the re-seeded per-process RNG streams.

FSDP (``distributed.strategy: fsdp``, ``batch.global_batch_size: 6``): a straight 2-rank run (4 steps,
warmup + cosine) resumes from its checkpoint-1 on 3 ranks and on 1 process (cembed shards only with
more than one: the shards load into the full model); that 3-rank run's checkpoint-2 (3 shard files)
resumes on 2 ranks; a 1-process run's checkpoint-1 (full model and optimizer) resumes sharded on 2
ranks, and that run's checkpoint-2 back on 1 process. All equal the straight run (weights within 1e-5, the same LR and loss at every resumed step).

With dropout, a 2-rank run's checkpoint-3 resumes on 1 process: it completes, names the re-seeded
streams, and its final loss stays within the spread of two seeds' 2-rank runs.

Three spawned groups (2, 3, 2 ranks) run every multi-rank part (module fixture); the 1-process runs run here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import end_gloo_rank, free_port, join_gloo_rank

pytestmark = pytest.mark.slow  # 2 spawned gloo ranks (module fixture)

ROWS = 32
STEPS = 6
# The FSDP runs: cembed shards only with more than one process, so 2 <-> 3 ranks, 3 or 2 rows each;
# 4 steps (warmup to step 2, then cosine), a checkpoint every step.
FSDP = {"rows": 24, "batch": 6, "steps": 4}
SEED_B = 7  # the dropout runs' second seed (the first: train.seed's default, 42)
OPTIM = {
    "learning_rate": 1e-2,
    "lr_scaling": "none",
    "warmup_ratio": 0.5,
    "weight_decay": 0.01,
    "lr_scheduler_type": "cosine",
}


def _config(tmp: Path, model_dir: Path, out: str, fsdp: bool = False, seed: int = 42) -> dict:
    """The same config on any world size that divides its global batch: ``batch.global_batch_size: 8``
    from ``ROWS`` distinct pairs (4 global batches an epoch); ``fsdp``: the FSDP runs' (see FSDP)."""
    rows, batch, steps, save_steps = (FSDP["rows"], FSDP["batch"], FSDP["steps"], 1) if fsdp else (ROWS, 8, STEPS, 3)
    data = tmp / f"pairs{rows}.jsonl"
    if not data.exists():
        pairs = [{"anchor": f"a query about topic {i}", "positive": f"the passage on topic {i}"} for i in range(rows)]
        data.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return {
        "model": {"name_or_path": str(model_dir), "max_seq_length": 32, "device": "cpu"},
        "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
        "batch": {"global_batch_size": batch, "mini_batch_size": 2},
        "optim": OPTIM,
        "loss": {"name": "cached_mnrl", "scale": 20},
        "distributed": {"strategy": "fsdp" if fsdp else "ddp"},
        "train": {
            "max_steps": steps,
            "save_steps": save_steps,
            "logging_steps": 1,
            "output_dir": str(tmp / out),
            "seed": seed,
        },
    }


def _run(
    tmp: Path,
    model_dir: Path,
    out: str,
    resume_from: str | None = None,
    fsdp: bool = False,
    seed: int = 42,
) -> dict:
    """One run: its summary, the learning rate each step logged and whether it trained sharded."""
    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training
    from cembed.train.trainer import CembedTrainer

    record: list = []

    class RecordingTrainer(CembedTrainer):
        def train(self, *args, **kw):
            record.append(self)
            return super().train(*args, **kw)

    cfg = config_from_dict(_config(tmp, model_dir, out, fsdp, seed), base=tmp)
    plan, data = check_run_inputs(cfg)
    summary = run_training(cfg, plan, data, resume_from=resume_from, trainer_cls=RecordingTrainer)
    history = record[-1].state.log_history
    return {
        "summary": summary,
        "lrs": [[h["step"], h["learning_rate"]] for h in history if "learning_rate" in h],
        "fsdp": bool(record[-1].is_fsdp_enabled),
    }


def _worker(rank: int, world: int, tmp: str, models: dict, port: int, jobs: list, name: str) -> None:
    """Run ``jobs`` (see :func:`_spawn`) as process ``rank``; rank 0 writes their results to ``name``."""
    join_gloo_rank(rank, world, port, 600)

    tmp_path = Path(tmp)
    results = {
        out: _run(tmp_path, Path(models[model][0]), out, str(tmp_path / src) if src else None, fsdp, models[model][1])
        for out, src, fsdp, model in jobs
    }
    if rank == 0:
        (tmp_path / name).write_text(json.dumps(results, default=str))
    end_gloo_rank()


def _spawn(tmp: Path, models: dict, world: int, jobs: list) -> dict:
    """Run ``jobs`` (``(out, checkpoint to resume or None, fsdp, key in models)``) on ``world``
    spawned gloo ranks; ``models`` maps a key to ``(model folder, train.seed)``."""
    import torch.multiprocessing as mp

    name = f"results-{world}-{jobs[0][0]}.json"
    models = {k: (str(path), seed) for k, (path, seed) in models.items()}
    mp.spawn(_worker, args=(world, str(tmp), models, free_port(), jobs, name), nprocs=world)
    return json.loads((tmp / name).read_text())


@pytest.fixture(scope="module")
def elastic_runs(tiny_model_dir, tiny_dropout_model_dir, tmp_path_factory):
    """Every run: 1 process straight (DDP and FSDP config, whose checkpoints resume on 2 ranks); on 2
    spawned ranks the straight runs (DDP, FSDP, dropout with two seeds) and those resumes; on 3 ranks
    the FSDP 2 -> 3 resume, whose checkpoint-2 resumes on 2 ranks; then here the 2 -> 1 resumes (DDP,
    FSDP, dropout)."""
    tmp = tmp_path_factory.mktemp("elastic")
    models = {"plain": (tiny_model_dir, 42), "dropout": (tiny_dropout_model_dir, 42)}
    models["dropout-seed-b"] = (tiny_dropout_model_dir, SEED_B)
    runs = {"one": _run(tmp, tiny_model_dir, "one"), "fsdp-one": _run(tmp, tiny_model_dir, "fsdp-one", fsdp=True)}
    two = [("two", None, False, "plain"), ("one-to-two", "one/checkpoint-3", False, "plain")]
    two += [("fsdp-two", None, True, "plain"), ("fsdp-one-to-two", "fsdp-one/checkpoint-1", True, "plain")]
    two += [("dropout-two", None, False, "dropout"), ("dropout-two-seed-b", None, False, "dropout-seed-b")]
    runs |= _spawn(tmp, models, 2, two)
    runs |= _spawn(tmp, models, 3, [("fsdp-two-to-three", "fsdp-two/checkpoint-1", True, "plain")])
    runs |= _spawn(tmp, models, 2, [("fsdp-three-to-two", "fsdp-two-to-three/checkpoint-2", True, "plain")])
    runs["two-to-one"] = _run(tmp, tiny_model_dir, "two-to-one", str(tmp / "two" / "checkpoint-3"))
    runs["fsdp-two-to-one"] = _run(tmp, tiny_model_dir, "fsdp-two-to-one", str(tmp / "fsdp-two/checkpoint-1"), True)
    back = str(tmp / "fsdp-one-to-two/checkpoint-2")  # 1 -> 2 -> 1: a sharded checkpoint of a 1-process run
    runs["fsdp-one-to-two-to-one"] = _run(tmp, tiny_model_dir, "fsdp-one-to-two-to-one", back, True)
    resumed = str(tmp / "dropout-two/checkpoint-3")
    runs["dropout-two-to-one"] = _run(tmp, tiny_dropout_model_dir, "dropout-two-to-one", resumed)
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
    # steps 1-3 from the checkpoint's history (the run before the resume), 4-6 trained after it
    assert sorted(resumed_losses) == list(range(1, STEPS + 1))
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


@pytest.mark.parametrize(("resumed", "old", "new"), [("two-to-one", 2, 1), ("one-to-two", 1, 2)])
def test_resume_on_another_world_size_names_the_reseeded_streams(elastic_runs, resumed, old, new):
    """The checkpoint holds no RNG state for the new ranks: the resume says their streams (dropout
    masks) are re-seeded. (The re-seeding runs with or without dropout; the runs above have none, so
    that their weights compare with the uninterrupted run's.)"""
    _, runs = elastic_runs
    summary = runs[resumed]["summary"]
    assert summary["resume_changes"][-2:] == [
        f"world_size {old} -> {new}",
        f"RNG streams (dropout) re-seeded per rank: the checkpoint holds {old} process(es)' RNG states, this run has {new}",
    ]


@pytest.mark.parametrize(
    ("resumed", "checkpoint", "old", "new"),
    [
        ("fsdp-two-to-three", "fsdp-two/checkpoint-1", 2, 3),
        ("fsdp-three-to-two", "fsdp-two-to-three/checkpoint-2", 3, 2),
        ("fsdp-two-to-one", "fsdp-two/checkpoint-1", 2, 1),
        ("fsdp-one-to-two", "fsdp-one/checkpoint-1", 1, 2),
        ("fsdp-one-to-two-to-one", "fsdp-one-to-two/checkpoint-2", 2, 1),
    ],
)
def test_fsdp_resume_on_another_world_size_equals_the_uninterrupted_run(
    elastic_runs, tiny_model_dir, resumed, checkpoint, old, new
):
    """An FSDP checkpoint (model and AdamW state as torch.distributed.checkpoint folders, one file per
    rank) loads resharded on another number of ranks, and into the unsharded model of one process
    (cembed shards only with more than one); a 1-process checkpoint (full model.safetensors and
    optimizer.pt) loads sharded on 2 ranks. The resumed steps log the uninterrupted run's LR and
    loss, and it ends with its weights. (Before: 2 -> 1 and 1 -> 2 were refused, neither loader read
    the other layout.)"""
    tmp, runs = elastic_runs
    straight, run = runs["fsdp-two"], runs[resumed]
    assert straight["fsdp"] and run["fsdp"] == (new > 1)  # sharded exactly where there are several ranks
    if old > 1:
        files = {p.name for p in (tmp / checkpoint / "pytorch_model_fsdp_0").iterdir()}
        assert files == {".metadata"} | {f"__{r}_0.distcp" for r in range(old)}
    assert (tmp / checkpoint / "model.safetensors").exists() == (old == 1)
    steps = FSDP["steps"]
    losses = dict(map(tuple, straight["summary"]["losses"]))
    assert sorted(losses) == list(range(1, steps + 1))
    assert min(abs(losses[s] - losses[t]) for s in losses for t in losses if s < t) > 1e-3  # each step its batch
    first = int(checkpoint.rsplit("-", 1)[1]) + 1
    resumed_losses = dict(map(tuple, run["summary"]["losses"]))
    assert sorted(resumed_losses) == list(range(1, steps + 1))  # the steps before `first`: the checkpoint's
    d_loss = max(abs(resumed_losses[s] - losses[s]) for s in resumed_losses)
    lrs = dict(map(tuple, straight["lrs"]))
    lr = OPTIM["learning_rate"]  # warmup over steps 1-2, then cosine decay: a fresh schedule would differ
    assert [lrs[s] for s in sorted(lrs)] == pytest.approx([0.0, lr / 2, lr, lr / 2], abs=1e-12)
    resumed_lrs = {s: v for s, v in map(tuple, run["lrs"]) if s >= first}
    assert resumed_lrs == pytest.approx({s: lrs[s] for s in range(first, steps + 1)}, abs=1e-12)
    d_w = _max_dw(tmp / "fsdp-two", tmp / resumed)
    moved = _max_dw(tmp / "fsdp-two", Path(tiny_model_dir))
    print(f"\n{resumed} resume vs uninterrupted: max|dW| {d_w:.2e} (max update {moved:.2e}), max|dloss| {d_loss:.2e}")
    assert d_w <= 1e-5 and d_loss <= 1e-5 and moved > 1e-3
    summary = run["summary"]
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert f"world_size {old} -> {new}" in summary["resume_changes"]
    assert summary["plan"]["per_device_train_batch_size"] == FSDP["batch"] // new


def test_fsdp_config_on_one_process_equals_two_sharded_ranks(elastic_runs):
    tmp, runs = elastic_runs
    assert not runs["fsdp-one"]["fsdp"]
    assert _max_dw(tmp / "fsdp-two", tmp / "fsdp-one") <= 1e-5


def test_dropout_resume_on_another_world_size_stays_within_the_seed_spread(elastic_runs):
    """With dropout (p 0.1) a 2-rank run's checkpoint-3 resumes on 1 process: it completes, says its
    RNG streams (dropout masks) are re-seeded, and its final loss differs from the uninterrupted run's
    (same seed, so the same batches) by no more than the final losses of two seeds' uninterrupted runs.

    The bound is loose: the other seed also draws other batches, so the spread holds the batches'
    difference besides the masks'. It says the resumed run ends where a run of this config may end;
    the exact checks (weights, optimizer, schedule, batches) are the runs without dropout above."""
    _, runs = elastic_runs
    summary = runs["dropout-two-to-one"]["summary"]
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["resume_changes"][-1] == (
        "RNG streams (dropout) re-seeded per rank: the checkpoint holds 2 process(es)' RNG states, this run has 1"
    )
    losses = {name: dict(map(tuple, runs[name]["summary"]["losses"])) for name in runs if name.startswith("dropout")}
    straight, resumed = losses["dropout-two"], losses["dropout-two-to-one"]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert all(resumed[s] == straight[s] for s in (1, 2, 3))  # the checkpoint's history, as the 2-rank run logged it
    # The masks really are re-seeded: from the checkpoint's weights, on the same batch, step 4's loss
    # differs (without dropout the two agree within 1e-5, test_resume_on_another_world_size_...).
    assert abs(resumed[4] - straight[4]) > 1e-4
    spread = abs(straight[STEPS] - losses["dropout-two-seed-b"][STEPS])
    d_loss = abs(resumed[STEPS] - straight[STEPS])
    print(f"\ndropout 2 -> 1 resume: final loss off by {d_loss:.2e}, two seeds' spread {spread:.2e}; losses {losses}")
    assert d_loss <= max(spread, 1e-3)
