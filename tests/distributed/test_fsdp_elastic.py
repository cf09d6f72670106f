"""FSDP runs that outlive their machines (issue 33): an FSDP checkpoint resumed on another world size.

cembed shards only with more than one process, so the world sizes are 2 and 3 gloo ranks, with
``batch.global_batch_size: 6`` (2 x 3 rows, 3 x 2 rows; the cached loss gathers the candidates, so
both train the same global batches). Under FSDP the model and the AdamW state are saved by
torch.distributed.checkpoint (``pytorch_model_fsdp_0/``, ``optimizer_0/``: one file per rank) and
read back resharded for the new ranks. A straight 2-rank run (4 steps, warmup + cosine) is resumed
from its checkpoint-1 on 3 ranks; that 3-rank run's checkpoint-2 (3 files) is resumed on 2 ranks.
Both end with the straight run's weights within 1e-5 and log its LR and loss at every resumed step.

A resume across the layouts is refused before training, in one line: a sharded checkpoint on 1
process (cembed shards only with more than one) and a 1-process (full) checkpoint on 2 FSDP ranks.

Three spawned groups (2, 3, 2 ranks) and a 1-process run in one module fixture.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from conftest import join_gloo_rank

pytestmark = pytest.mark.slow  # spawned gloo ranks (module fixture)

ROWS = 24  # 4 global batches of 6: the resumes land mid-epoch
STEPS = 4
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


def _config(tmp: Path, model_dir: Path, out: str) -> dict:
    data = tmp / "pairs.jsonl"
    if not data.exists():
        rows = [{"anchor": f"a query about topic {i}", "positive": f"the passage on topic {i}"} for i in range(ROWS)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": {"name_or_path": str(model_dir), "max_seq_length": 32, "device": "cpu"},
        "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
        "batch": {"global_batch_size": 6, "mini_batch_size": 2},
        "optim": OPTIM,
        "loss": {"name": "cached_mnrl", "scale": 20},
        "distributed": {"strategy": "fsdp"},
        "train": {"max_steps": STEPS, "save_steps": 1, "logging_steps": 1, "output_dir": str(tmp / out)},
    }


def _run(tmp: Path, model_dir: Path, out: str, resume_from: str | None = None) -> dict:
    """One run: its summary, the LR each step logged and whether it really trained sharded."""
    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training
    from cembed.train.trainer import CembedTrainer

    record: list = []

    class RecordingTrainer(CembedTrainer):
        def train(self, *args, **kw):
            record.append(self)
            return super().train(*args, **kw)

    cfg = config_from_dict(_config(tmp, model_dir, out), base=tmp)
    plan, data = check_run_inputs(cfg)
    summary = run_training(cfg, plan, data, resume_from=resume_from, trainer_cls=RecordingTrainer)
    trainer = record[-1]
    return {
        "summary": summary,
        "lrs": [[h["step"], h["learning_rate"]] for h in trainer.state.log_history if "learning_rate" in h],
        "fsdp": bool(trainer.is_fsdp_enabled),
    }


def _outcome(tmp: Path, model_dir: Path, out: str, resume_from: str | None) -> dict:
    """:func:`_run`, or the error that ended it (a refused resume ends on every rank before training)."""
    try:
        return _run(tmp, model_dir, out, resume_from)
    except Exception as err:  # noqa: BLE001 (the test names the expected error)
        return {"error": f"{type(err).__name__}: {err}"}


def _worker(rank: int, world: int, tmp: str, model_dir: str, port: int, runs: list) -> None:
    join_gloo_rank(rank, world, port, 600)
    from cembed.distributed.group import leave_process_group

    tmp_path = Path(tmp)
    results = {out: _outcome(tmp_path, Path(model_dir), out, str(tmp_path / src) if src else None) for out, src in runs}
    if rank == 0:
        (tmp_path / f"results-{world}.json").write_text(json.dumps(results, default=str))
    leave_process_group()


def _spawn(tmp: Path, model_dir: Path, world: int, runs: list) -> dict:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, str(tmp), str(model_dir), _free_port(), runs), nprocs=world)
    return json.loads((tmp / f"results-{world}.json").read_text())


@pytest.fixture(scope="module")
def fsdp_elastic_runs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_elastic")
    runs = _spawn(tmp, tiny_model_dir, 2, [("two", None)])
    runs["one"] = _run(tmp, tiny_model_dir, "one")  # 1 process: cembed does not shard, a full checkpoint
    runs |= _spawn(tmp, tiny_model_dir, 3, [("two-to-three", "two/checkpoint-1")])
    runs |= _spawn(
        tmp, tiny_model_dir, 2, [("three-to-two", "two-to-three/checkpoint-2"), ("one-to-two", "one/checkpoint-1")]
    )
    return tmp, runs


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _max_dw(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.mark.parametrize(
    ("resumed", "checkpoint", "old", "new"),
    [("two-to-three", "two/checkpoint-1", 2, 3), ("three-to-two", "two-to-three/checkpoint-2", 3, 2)],
)
def test_fsdp_resume_on_another_world_size_equals_the_uninterrupted_run(
    fsdp_elastic_runs, tiny_model_dir, resumed, checkpoint, old, new
):
    tmp, runs = fsdp_elastic_runs
    straight, run = runs["two"], runs[resumed]
    assert straight["fsdp"] and run["fsdp"]  # both really sharded
    # The checkpoint is a torch.distributed.checkpoint folder of the old world size: one file per rank.
    files = {p.name for p in (tmp / checkpoint / "pytorch_model_fsdp_0").iterdir()}
    assert files == {".metadata"} | {f"__{r}_0.distcp" for r in range(old)}
    assert not (tmp / checkpoint / "model.safetensors").exists()
    losses = dict(map(tuple, straight["summary"]["losses"]))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert min(abs(losses[s] - losses[t]) for s in losses for t in losses if s < t) > 1e-3  # each step its batch
    first = int(checkpoint.rsplit("-", 1)[1]) + 1
    resumed_losses = dict(map(tuple, run["summary"]["losses"]))
    assert sorted(resumed_losses) == list(range(first, STEPS + 1))
    d_loss = max(abs(resumed_losses[s] - losses[s]) for s in resumed_losses)
    lrs = dict(map(tuple, straight["lrs"]))
    lr = OPTIM["learning_rate"]  # warmup over steps 1-2, then cosine decay: a fresh schedule would differ
    assert [lrs[s] for s in sorted(lrs)] == pytest.approx([0.0, lr / 2, lr, lr / 2], abs=1e-12)
    resumed_lrs = {s: v for s, v in map(tuple, run["lrs"]) if s >= first}
    assert resumed_lrs == pytest.approx({s: lrs[s] for s in range(first, STEPS + 1)}, abs=1e-12)
    d_w = _max_dw(tmp / "two", tmp / resumed)
    moved = _max_dw(tmp / "two", Path(tiny_model_dir))
    print(
        f"\nFSDP {resumed} resume vs uninterrupted: max|dW| {d_w:.2e} (max update {moved:.2e}), max|dloss| {d_loss:.2e}"
    )
    assert d_w <= 1e-5 and d_loss <= 1e-5 and moved > 1e-3
    summary = run["summary"]
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert f"world_size {old} -> {new}" in summary["resume_changes"]
    assert summary["plan"]["per_device_train_batch_size"] == 6 // new


def test_fsdp_checkpoint_on_one_process_is_refused_naming_the_fix(fsdp_elastic_runs, tiny_model_dir):
    """cembed shards only with more than one process: a sharded checkpoint cannot load into the
    unsharded model of a 1-process resume (before: the run failed at step 0 with transformers'
    "Unrecognized model in .../checkpoint-1"). Refused before training, in one line with the fix."""
    from cembed.errors import UserError

    tmp, _ = fsdp_elastic_runs
    checkpoint = tmp / "two" / "checkpoint-1"
    with pytest.raises(UserError) as err:
        _run(tmp, tiny_model_dir, "two-to-one", str(checkpoint))
    assert str(err.value) == (
        f"cannot resume {checkpoint} on 1 process (cembed shards only with more than one): it holds FSDP shards "
        "(torch.distributed.checkpoint); resume it with distributed.strategy: fsdp on 2 or more processes (any count "
        "that divides the global batch)"
    )
    assert not (tmp / "two-to-one" / "checkpoint-2").exists()  # nothing trained


def test_full_checkpoint_under_fsdp_is_refused_naming_the_fix(fsdp_elastic_runs):
    """A 1-process run's checkpoint (full model.safetensors and optimizer.pt) resumed on 2 FSDP ranks:
    FSDP's loader reads only torch.distributed.checkpoint folders. Refused on every rank, in one line."""
    tmp, runs = fsdp_elastic_runs
    checkpoint = tmp / "one" / "checkpoint-1"
    assert (checkpoint / "model.safetensors").is_file() and not (checkpoint / "pytorch_model_fsdp_0").exists()
    assert runs["one-to-two"] == {
        "error": f"UserError: cannot resume {checkpoint} with FSDP: it holds a full model and optimizer (a run on 1 "
        "process or with distributed.strategy: ddp), which FSDP's sharded loader cannot read; resume it as it was "
        "run (1 process, or distributed.strategy=ddp)"
    }
