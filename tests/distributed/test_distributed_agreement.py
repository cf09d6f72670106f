"""Ranks that must decide together (CPU, gloo, 2 ranks, the tiny random model).

- ``batch.mini_batch_size: auto``: the probe runs inside the process group and every rank trains
  with the minimum of the ranks' answers (the probe's search is patched to answer 2 on rank 0 and 4
  on rank 1).
- Ranks whose mini-batch size differs (different configs) are refused before step 1 with one
  message on every rank, instead of pairing up mismatched collectives of the gathered loss.
- ``train.nonfinite_loss: skip`` with a NaN loss on rank 1 only: both ranks skip the same step (no
  update on either), nothing hangs, and their weights stay equal.
- Long single-rank work (C6): with ``distributed.timeout_minutes`` short (9 s, the group's collective
  timeout, passed to ``init_process_group``), rank 0's first pre-tokenization and its "before
  training" evaluation each take 14 s while rank 1 waits: no timeout, because rank 1 waits on the
  store, not in a collective. This case runs first, in its own process group (the later cases join
  a fresh one with the default timeout).

One pair of spawned processes runs all cases (module fixture); a rank that hangs is killed by its
timer, so a regression fails here within about two minutes instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import end_gloo_rank, free_port, join_gloo_rank

pytestmark = pytest.mark.slow  # 2 spawned gloo ranks (module fixture)

WORLD = 2
HANG_S = 120  # a rank still running after this is hung in a collective


def _config(tmp: Path, model_dir: Path, name: str, mini, **train) -> dict:
    data = tmp / "pairs.jsonl"
    if not data.exists():
        rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(32)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": {"name_or_path": str(model_dir), "max_seq_length": 16, "device": "cpu"},
        "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
        "batch": {"per_device_train_batch_size": 4, "mini_batch_size": mini},
        "optim": {"learning_rate": 1e-2, "warmup_ratio": 0.0, "lr_scheduler_type": "constant"},
        "train": {"max_steps": 1, "logging_steps": 1, "output_dir": str(tmp / name), **train},
    }


def _run(cfg_dict: dict, base: Path, trainer_cls=None) -> dict:

    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training

    cfg = config_from_dict(cfg_dict, base=base)
    plan, data = check_run_inputs(cfg)
    kwargs = {"trainer_cls": trainer_cls} if trainer_cls else {}
    return run_training(cfg, plan, data, **kwargs)


def _auto_case(rank: int, tmp: Path, model_dir: Path) -> dict:
    import torch.distributed as dist

    import cembed.probe.auto as probe
    from cembed.probe.search import ProbeResult, TrialRecord

    seen = {}
    real = probe.search_mini_batch

    def search(trial, capacity, *args, **kwargs):
        seen["group_initialized"] = dist.is_initialized()
        size = 2 if rank == 0 else 4
        trials = [TrialRecord(size, True, 1000 * (rank + 1), 1.0)]  # this rank's peak at its answer
        return ProbeResult(size, size, "patched", capacity, 0.1, int(0.9 * capacity), 4, trials)

    probe.search_mini_batch = search
    try:
        summary = _run(_config(tmp, model_dir, "auto", "auto"), tmp)
    finally:
        probe.search_mini_batch = real
    return {
        **seen,
        "mini_batch_size": summary["plan"]["mini_batch_size"],
        "probe_recommended": summary["mini_batch_probe"]["recommended"],
        "probe_ranks": summary["mini_batch_probe"]["ranks"],
        "steps": summary["steps"],
    }


SLOW_S = 14.0  # rank 0's single-rank work, longer than the group's collective timeout below
SHORT_TIMEOUT_MIN = 0.15  # 9 s


def _slow_rank0_case(rank: int, tmp: Path, model_dir: Path) -> dict:
    import time

    import torch.distributed as dist

    import cembed.data.tokens.tokenize as P
    from cembed.train.evaluation import TrainingEvaluation

    sts = tmp / "sts.tsv"
    sts.write_text("".join(f"a car on road {i}\ta vehicle on a street {i}\t{i % 5}\n" for i in range(8)))
    cfg = _config(tmp, model_dir, "slow", 2)
    cfg["data"]["cache_dir"] = str(tmp / "slow-cache")  # a first-time pre-tokenization
    cfg.update(distributed={"timeout_minutes": SHORT_TIMEOUT_MIN}, eval={"sts": str(sts)})
    timeouts, real_init, real_tok, real_eval = [], dist.init_process_group, P.pretokenize, TrainingEvaluation.evaluate

    def init(*args, **kwargs):
        timeouts.append(kwargs.get("timeout").total_seconds() if kwargs.get("timeout") else None)
        return real_init(*args, **kwargs)

    def tokenize(*args, **kwargs):
        result = real_tok(*args, **kwargs)
        if not result.from_cache:
            time.sleep(SLOW_S)
        return result

    def evaluate(self, model, label, *args, **kwargs):
        if label == "before training":
            time.sleep(SLOW_S)
        return real_eval(self, model, label, *args, **kwargs)

    dist.init_process_group, P.pretokenize, TrainingEvaluation.evaluate = init, tokenize, evaluate
    try:
        summary = _run(cfg, tmp)
    finally:
        dist.init_process_group, P.pretokenize, TrainingEvaluation.evaluate = real_init, real_tok, real_eval
    return {
        "timeouts": timeouts,
        "status": summary["status"],
        "steps": summary["steps"],
        "eval_before": bool(summary["eval"] and summary["eval"].get("before")),
        "throughput": summary["throughput"],
        "history": summary["throughput_per_interval"],
    }


def _disagree_case(rank: int, tmp: Path, model_dir: Path) -> dict:
    from cembed.errors import UserError

    try:
        summary = _run(_config(tmp, model_dir, "disagree", 2 if rank == 0 else 4), tmp)
    except UserError as err:
        return {"refused": str(err)}
    return {"refused": None, "steps": summary["steps"]}


def _nan_skip_case(rank: int, tmp: Path, model_dir: Path) -> dict:
    import cembed.train.recipe as T
    from cembed.train.trainer import CembedTrainer

    real = T.build_loss

    def build(*args, **kwargs):  # rank 1's loss is NaN at its second call (step 2)
        built = real(*args, **kwargs)
        forward, calls = built.module.forward, {"n": 0}

        def patched(features, labels):
            calls["n"] += 1
            value = forward(features, labels)
            return value * float("nan") if rank == 1 and calls["n"] == 2 else value

        built.module.forward = patched
        return built

    weights: dict[int, dict] = {}

    class Recording(CembedTrainer):
        def training_step(self, *args, **kwargs):
            weights[self.state.global_step] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            return super().training_step(*args, **kwargs)

    T.build_loss = build
    try:
        summary = _run(_config(tmp, model_dir, "nan", 2, max_steps=3, nonfinite_loss="skip"), tmp, Recording)
    finally:
        T.build_loss = real

    def moved(a: int, b: int) -> float:
        return max((weights[b][k] - weights[a][k]).abs().max().item() for k in weights[a])

    torch.save(weights[2], tmp / f"nan-after-step2-rank{rank}.pt")
    return {
        "status": summary["status"],
        "steps": summary["steps"],
        "skipped": summary["nonfinite_steps_skipped"],
        "moved_step1": moved(0, 1),
        "moved_step2": moved(1, 2),
    }


CASES = {"slow_rank0": _slow_rank0_case, "auto": _auto_case, "nan_skip": _nan_skip_case, "disagree": _disagree_case}


def _worker(rank: int, tmp: str, model_dir: str, port: int, port2: int) -> None:
    join_gloo_rank(rank, WORLD, port, HANG_S)
    tmp_path, results = Path(tmp), {}
    from cembed.distributed.group import leave_process_group

    for name, case in CASES.items():
        results[name] = case(rank, tmp_path, Path(model_dir))
        (tmp_path / f"results-rank{rank}.json").write_text(json.dumps(results))  # kept if a later case hangs
        if name == "slow_rank0":  # the later cases: a fresh group with the default timeout
            leave_process_group()
            os.environ["MASTER_PORT"] = str(port2)
    end_gloo_rank()


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    """Run every case once in one pair of spawned ranks; a rank that hung or died leaves its
    results up to the case before."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("agree")
    try:
        mp.spawn(_worker, args=(str(tmp), str(tiny_model_dir), free_port(), free_port()), nprocs=WORLD, join=True)
    except Exception as err:  # noqa: BLE001 - a hung (killed) or failed rank: the tests say which case
        print(f"ranks failed: {err}")
    out = []
    for r in range(WORLD):
        path = tmp / f"results-rank{r}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {})
    return tmp, out


def _case(results, name):
    tmp, per_rank = results
    assert all(name in r for r in per_rank), f"{name}: a rank hung or failed before finishing it"
    return tmp, [r[name] for r in per_rank]


def test_auto_probe_agrees_across_ranks(results):
    _, (r0, r1) = _case(results, "auto")
    assert r0["group_initialized"] and r1["group_initialized"]  # probed after the process group exists
    assert r0["mini_batch_size"] == r1["mini_batch_size"] == 2  # the minimum of 2 and 4
    assert r0["probe_recommended"] == r1["probe_recommended"] == 2
    for r in (r0, r1):  # each rank's own answer and peak, reported on every rank
        assert [(x["rank"], x["recommended"], x["peak_bytes"]) for x in r["probe_ranks"]] == [
            (0, 2, 1000),
            (1, 4, 2000),
        ]
    assert r0["steps"] == r1["steps"] == 1


def test_ranks_with_different_mini_batch_sizes_are_refused(results):
    _, (r0, r1) = _case(results, "disagree")
    for r in (r0, r1):
        assert r["refused"], r
        assert "mini_batch_size: rank 0 2, rank 1 4" in r["refused"]
    assert r0["refused"] == r1["refused"]


def test_skip_nonfinite_agrees_across_ranks(results):
    tmp, (r0, r1) = _case(results, "nan_skip")
    for r in (r0, r1):
        assert r["status"] == "completed" and r["steps"] == 3 and r["skipped"] == 1, r
        assert r["moved_step1"] > 0 and r["moved_step2"] == 0.0, r  # step 2 is a no-op on both ranks
    w0, w1 = (torch.load(tmp / f"nan-after-step2-rank{r}.pt") for r in range(WORLD))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_long_single_rank_work_waits_outside_collectives(results):
    _, (r0, r1) = _case(results, "slow_rank0")
    for r in (r0, r1):
        assert r["timeouts"] == [SHORT_TIMEOUT_MIN * 60], r  # distributed.timeout_minutes reached the group
        assert r["status"] == "completed" and r["steps"] == 1, r
    assert r0["eval_before"]  # rank 0 evaluated the base model while rank 1 waited on the store


def test_meter_reports_the_jobs_tokens_and_data_wait(results):
    """K3: tokens/s is summed over the ranks and data-wait averaged, the same on every rank, with
    each rank's own in the totals (not rank 0's alone under a global samples/s)."""
    _, (r0, r1) = _case(results, "slow_rank0")
    t = r0["throughput"]
    assert t == r1["throughput"] and r0["history"] == r1["history"]  # every rank reports the job's numbers
    assert t["ranks"] == 2 and len(t["per_rank"]) == 2 and all(x["tokens_per_s"] > 0 for x in t["per_rank"])
    assert t["tokens_per_s"] == pytest.approx(sum(x["tokens_per_s"] for x in t["per_rank"]), abs=0.2)
    assert t["tokens_per_s"] > max(x["tokens_per_s"] for x in t["per_rank"])
    assert t["data_wait"] == pytest.approx(sum(x["data_wait"] for x in t["per_rank"]) / 2, abs=1e-3)
