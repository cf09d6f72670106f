"""Multi-process training on CPU (gloo, 2 ranks) with the tiny random model.

- Exactness: 2 ranks x 4 rows with gathered negatives give the same loss and, after one SGD step
  through the real trainer (DDP, sampler sharding, frozen unused pooler), the same weights on both
  ranks as 1 process x 8 rows. SGD, not AdamW: Adam's first step is about lr x sign(gradient) and
  would hide a wrong gradient scale.
- A global no-duplicates batch over one epoch of duplicate-heavy data, same step count on both ranks.
- ``cembed train --nproc-per-node 2`` end to end, and a failing rank stopping the job.

The 2-rank runs share one pair of spawned processes (module fixture) to keep the runtime down.
Measured differences are printed (``pytest -s``) and kept in ``MEASURED``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import COCO_PAIRS, REPO, end_gloo_rank, free_port, join_gloo_rank

WORLD = 2
ROWS = 8  # one global batch: 1 x 8 rows == 2 x 4 rows

# name -> (loss name, with a negatives column, symmetric)
CASES = {
    "cached_pairs": ("cached_mnrl", False, False),
    "cached_negatives": ("cached_mnrl", True, False),
    "plain_pairs": ("mnrl", False, False),
    "plain_negatives": ("mnrl", True, False),
    "cached_symmetric_negatives": ("cached_mnrl", True, True),
    "cached_lora": ("cached_mnrl", False, False, "lora"),  # model.lora: only the adapters train
}
MEASURED: dict[str, dict[str, float]] = {}


def _rows(negatives: bool) -> list[dict]:
    words = "man woman dog cat train table street car room plate food bus".split()
    rows = []
    for i in range(ROWS):
        row = {
            "anchor": f"a {words[i]} on the {words[-1 - i]}",
            "positive": f"the {words[i]} next to a {words[(i + 3) % 12]}",
        }
        if negatives:
            row["negative"] = f"two {words[(i + 5) % 12]} near the {words[(i + 7) % 12]}"
        rows.append(row)
    return rows


def _duplicate_heavy_rows(n: int = 96) -> list[dict]:
    # 12 distinct anchors, positives that repeat every 20 rows and sometimes equal an anchor text.
    return [
        {"anchor": f"topic {i % 12}", "positive": f"topic {12 + (i * 7) % 20}" if i % 3 else f"topic {(i + 5) % 12}"}
        for i in range(n)
    ]


def _case_config(tmp: Path, model_dir: Path, name: str, world: int) -> dict:
    loss, negatives, symmetric, *lora = CASES[name]
    data = tmp / f"{name}.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in _rows(negatives)))
    model = {"name_or_path": str(model_dir), "max_seq_length": 32, "device": "cpu"}
    if lora:
        model["lora"] = {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["query", "value"]}
    return {
        "model": model,
        "data": {
            "train": str(data),
            "columns": {"anchor": "anchor", "positive": "positive", "negatives": ["negative"] if negatives else []},
            "cache_dir": str(tmp / "cache"),
        },
        "batch": {"per_device_train_batch_size": ROWS // world, "mini_batch_size": 2},
        "optim": {
            "learning_rate": 0.5,
            "lr_scaling": "none",
            "warmup_ratio": 0.0,
            "weight_decay": 0.0,
            "lr_scheduler_type": "constant",
        },
        "loss": {"name": loss, "symmetric": symmetric, "scale": 20},
        "train": {"max_steps": 1, "logging_steps": 1, "output_dir": str(tmp / f"{name}-w{world}")},
    }


def _epoch_config(tmp: Path, model_dir: Path) -> dict:
    data = tmp / "dupes.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in _duplicate_heavy_rows()))
    return {
        "model": {"name_or_path": str(model_dir), "max_seq_length": 16, "device": "cpu"},
        "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
        "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-3, "warmup_ratio": 0.0},
        "train": {"num_train_epochs": 1, "logging_steps": 5, "output_dir": str(tmp / "epoch-run")},
    }


def _signal_at(step: int):
    """A trainer callback that sends this process SIGTERM when optimizer step ``step`` ends."""
    from transformers import TrainerCallback

    class SignalAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                os.kill(os.getpid(), signal.SIGTERM)

    return SignalAt()


def _install_recording(monkeypatch=None):
    """Train with plain SGD (see the module docstring), keep the trainer, and record the row
    indices each rank's data loader hands out, per epoch."""
    import accelerate.data_loader as adl

    from cembed.train.trainer import CembedTrainer

    record: dict = {"trainers": [], "batches": []}

    class SGDTrainer(CembedTrainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                params = [p for p in self.model.parameters() if p.requires_grad]
                self.optimizer = torch.optim.SGD(params, lr=self.args.learning_rate)
            return self.optimizer

        def train(self, *args, **kwargs):
            record["trainers"].append(self)
            if record.get("signal_at"):
                self.add_callback(_signal_at(record["signal_at"]))
            return super().train(*args, **kwargs)

    record["trainer_cls"] = SGDTrainer

    original_iter = adl.BatchSamplerShard.__iter__

    def recording_iter(self):
        epoch = []
        record["batches"].append(epoch)
        for batch in original_iter(self):
            epoch.append(list(batch))
            yield batch

    if monkeypatch is None:
        adl.BatchSamplerShard.__iter__ = recording_iter
    return record


def _run(cfg_dict: dict, base: Path, trainer_cls=None):

    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training

    cfg = config_from_dict(cfg_dict, base=base)
    plan, data = check_run_inputs(cfg)
    kwargs = {"trainer_cls": trainer_cls} if trainer_cls else {}
    return run_training(cfg, plan, data, **kwargs)


def _worker(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 600)
    tmp_path, model_path = Path(tmp), Path(model_dir)
    record = _install_recording()
    results = {}
    for name in CASES:
        summary = _run(_case_config(tmp_path, model_path, name, WORLD), tmp_path, record["trainer_cls"])
        trainer = record["trainers"][-1]
        torch.save(
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, tmp_path / f"{name}-rank{rank}.pt"
        )
        results[name] = {
            "loss": summary["first_loss"],
            "steps": summary["steps"],
            "distributed": summary["distributed"],
        }
    record["batches"].clear()
    summary = _run(_epoch_config(tmp_path, model_path), tmp_path, record["trainer_cls"])
    trained_epoch = [b for b in record["batches"] if b][-1]
    results["epoch"] = {
        "steps": summary["steps"],
        "batches": trained_epoch,
        "batches_per_epoch": summary["data"]["batches_per_epoch"],
    }

    # SIGTERM reaches rank 1 only, when step 2 ends: both ranks must stop after the same step.
    from cembed.errors import RunInterrupted

    record["signal_at"] = 2 if rank == 1 else None
    cfg = _epoch_config(tmp_path, model_path)
    cfg["train"].update(num_train_epochs=None, max_steps=6, output_dir=str(tmp_path / "interrupted"))
    try:
        summary = _run(cfg, tmp_path, record["trainer_cls"])
        results["interrupt"] = {"status": "completed", "steps": summary["steps"]}
    except RunInterrupted as stop:
        results["interrupt"] = {
            "status": "interrupted",
            "step": stop.step,
            "signum": stop.signum,
            "checkpoint": stop.checkpoint,
        }
    (tmp_path / f"results-rank{rank}.json").write_text(json.dumps(results))
    end_gloo_rank()


@pytest.fixture(scope="module")
def two_rank_results(tiny_model_dir, tmp_path_factory):
    """Run every 2-rank case once in one pair of spawned processes."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(str(tmp), str(tiny_model_dir), free_port()), nprocs=WORLD, join=True)
    results = [json.loads((tmp / f"results-rank{r}.json").read_text()) for r in range(WORLD)]
    return tmp, results


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_gathered_equal_one_process(name, two_rank_results, tiny_model_dir, monkeypatch):
    tmp, results = two_rank_results
    record = _install_recording(monkeypatch)
    ref = _run(_case_config(tmp, tiny_model_dir, name, 1), tmp, record["trainer_cls"])
    ref_weights = record["trainers"][-1].model.state_dict()
    from sentence_transformers import SentenceTransformer

    initial = SentenceTransformer(str(tiny_model_dir), device="cpu").state_dict()

    losses = [r[name]["loss"] for r in results]
    assert losses[0] == losses[1]  # the logged loss is the mean over ranks, the same on every rank
    d_loss = abs(losses[0] - ref["first_loss"])
    d_w = 0.0
    for rank in range(WORLD):
        weights = torch.load(tmp / f"{name}-rank{rank}.pt")
        assert weights.keys() == ref_weights.keys()
        d_w = max(d_w, max((weights[k] - ref_weights[k]).abs().max().item() for k in weights))
    # LoRA: the run's model is merged at the end (model.lora.merge), so its weights compare as any.
    moved = max((ref_weights[k] - initial[k]).abs().max().item() for k in initial)
    MEASURED[name] = {"loss_1proc": ref["first_loss"], "abs_loss_diff": d_loss, "max_abs_dW": d_w, "max_update": moved}
    print(f"\n{name}: loss {ref['first_loss']:.7f}  |dloss| {d_loss:.2e}  max|dW| {d_w:.2e}  (max update {moved:.2e})")
    assert d_loss <= 1e-6
    assert d_w <= 1e-6
    assert moved > 1e-3  # the step really changed the weights, so equal weights mean equal gradients
    assert all(r[name]["steps"] == 1 for r in results)
    if CASES[name][3:]:
        return  # no trainable pooler to freeze: only the adapters require gradients
    frozen = results[0][name]["distributed"]["frozen_unused_parameters"]
    assert frozen and all("pooler" in n for n in frozen)  # the BERT pooler is unused under mean pooling
    pooler = [k for k in ref_weights if "pooler" in k]
    assert pooler and all(torch.equal(torch.load(tmp / f"{name}-rank0.pt")[k], initial[k]) for k in pooler)


@pytest.mark.slow
def test_global_batches_have_no_duplicates_and_equal_steps(two_rank_results):
    tmp, results = two_rank_results
    rows = _duplicate_heavy_rows()
    per_rank = [r["epoch"]["batches"] for r in results]
    assert len(per_rank[0]) == len(per_rank[1]) == results[0]["epoch"]["steps"] == results[1]["epoch"]["steps"]
    assert results[0]["epoch"]["steps"] == results[0]["epoch"]["batches_per_epoch"] > 1
    for step, (b0, b1) in enumerate(zip(*per_rank)):
        assert len(b0) == len(b1) == 4
        per_row = [{rows[i]["anchor"], rows[i]["positive"]} for i in b0 + b1]
        seen: set[str] = set()
        for row_texts in per_row:
            assert not (row_texts & seen), f"step {step}: a text repeats in the global batch"
            seen |= row_texts


@pytest.mark.slow
def test_signal_on_one_rank_stops_all_ranks_at_the_same_step(two_rank_results):
    """The launcher may deliver SIGTERM to some ranks only (or at different times): the stop
    decision is shared, so both ranks save one checkpoint after the same step and report it."""
    tmp, results = two_rank_results
    stops = [r["interrupt"] for r in results]
    assert all(s["status"] == "interrupted" for s in stops), stops
    assert stops[0]["step"] == stops[1]["step"] == 3  # signalled as step 2 ended; seen at step 3's end
    assert stops[0]["signum"] == stops[1]["signum"] == signal.SIGTERM
    checkpoint = Path(stops[0]["checkpoint"])
    assert checkpoint.name == "checkpoint-3" and (checkpoint / "model.safetensors").exists()
    assert stops[1]["checkpoint"] == stops[0]["checkpoint"]


def test_sampler_shards_global_batches_through_accelerate(pairs_file):
    """In-process: accelerate's BatchSamplerShard gives rank r slice r of every global batch."""
    from accelerate.data_loader import BatchSamplerShard
    from datasets import Dataset

    from cembed.data.batching.full_table import NoDuplicatesSampler

    rows = _duplicate_heavy_rows(90)
    ds = Dataset.from_list(rows)
    for drop_last in (True, False):
        sampler = NoDuplicatesSampler(ds, batch_size=4, drop_last=drop_last, seed=3, world_size=2)
        shards = [
            list(BatchSamplerShard(sampler, num_processes=2, process_index=r, even_batches=False)) for r in range(2)
        ]
        globals_ = sampler.global_batches()
        assert len(shards[0]) == len(shards[1]) == len(globals_) == len(sampler) // 2
        for g, b0, b1 in zip(globals_, *shards):
            assert b0 + b1 == g and len(b0) == len(b1) == 4


@pytest.mark.slow
def test_cli_train_nproc_per_node_2_on_coco_slice(tiny_model_dir, write_config, tmp_path):
    out = tmp_path / "run"
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 32, "device": "cpu"},
            "data": {"train": str(COCO_PAIRS), "max_samples": 512, "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 32, "mini_batch_size": 16},
            "optim": {"learning_rate": 1e-3, "base_batch_size": 64, "warmup_ratio": 0.0},
            "train": {"num_train_epochs": 1, "logging_steps": 2, "output_dir": str(out)},
        }
    )
    r = subprocess.run(
        [sys.executable, "-m", "cembed", "train", str(cfg), "--nproc-per-node", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    summaries = list(out.rglob("run_summary.json"))
    models = list(out.rglob("model.safetensors"))
    assert len(summaries) == 1 and len(models) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["plan"]["world_size"] == 2 and summary["plan"]["samples_per_step"] == 64
    assert summary["distributed"]["backend"] == "gloo" and summary["distributed"]["gather_across_devices"]
    assert summary["steps"] == summary["data"]["batches_per_epoch"] > 0
    assert r.stdout.count("done:") == 1  # only rank 0 prints
    assert "froze 2 parameters" in r.stdout


@pytest.mark.slow
def test_cli_train_bad_cell_with_two_processes_exits_2_with_the_cells_message(tiny_model_dir, write_config, pairs_file):
    # Issue 24 item 3: the launcher loads no table; the workers' data check refuses the cell and
    # rank 0's one-line message comes back through the launcher, exit code 2 (a user mistake).
    from conftest import distinct_pairs

    rows = distinct_pairs(40)
    rows[5]["positive"] = "   "
    data = pairs_file(rows)
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 32, "device": "cpu"},
            "data": {"train": str(data)},
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
        }
    )
    r = subprocess.run(
        [sys.executable, "-m", "cembed", "train", str(cfg), "--nproc-per-node", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert "launching 2 process(es)" in out  # the launcher did not check the data
    assert (
        f"failed (exit code 2): {data}: line 6: column" in out
        and (
            "pairs.jsonl: line 6: column 'positive' (role positive) is empty or whitespace-only; fix the data or set "
            "data.drop_invalid_rows: true to skip such rows; the other processes were stopped"
        )
        in out
    ), out
    assert "Traceback" not in out


FAILING_WORKER = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("boom on rank 1")
dist.barrier()  # rank 0 would wait here forever if the launcher did not stop it
"""


@pytest.mark.slow
def test_failing_rank_stops_the_job(tmp_path):
    (tmp_path / "failing_worker.py").write_text(FAILING_WORKER)
    code = (
        "from cembed.distributed.launch import launch\nfrom cembed.errors import WorkerFailed\n"
        "try:\n    launch([], 2, module='failing_worker')\n"
        "except WorkerFailed as e:\n    print('FAILED', e.rank, e.exitcode, e.message)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert "FAILED 1 1" in r.stdout, r.stdout + r.stderr
    assert "boom on rank 1" in r.stdout + r.stderr


@pytest.mark.slow
def test_launcher_args_and_validate_show_world_size(write_config, pairs_file, tmp_path):
    from conftest import distinct_pairs

    from cembed.distributed.launch import launcher_args
    from cembed.errors import UserError

    assert launcher_args("cembed", ["train", "c.yaml"], 4, 2, 1, "node0:29400") == [
        "--nproc-per-node",
        "4",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        "node0:29400",
        "--module",
        "cembed",
        "train",
        "c.yaml",
    ]
    # restarts across nodes meet in torchrun's c10d rendezvous (its static one never re-formed the group)
    assert launcher_args("cembed", ["train"], 1, 2, 0, "node0:29400", max_restarts=2)[-5:] == [
        "--rdzv-backend",
        "c10d",
        "--module",
        "cembed",
        "train",
    ]
    assert "--rdzv-backend" not in launcher_args("cembed", ["train"], 2, max_restarts=2)  # one node: torchrun's own
    with pytest.raises(UserError, match="--rdzv-endpoint"):
        launcher_args("cembed", [], 2, nnodes=2)
    with pytest.raises(UserError, match="--node-rank"):
        launcher_args("cembed", [], 2, nnodes=2, node_rank=2, rdzv_endpoint="h:1")
    cfg = write_config(
        {
            "data": {"train": str(pairs_file(distinct_pairs(300)))},
            "batch": {"per_device_train_batch_size": 64},
            "optim": {"learning_rate": 2e-5, "base_batch_size": 32},
        }
    )
    from typer.testing import CliRunner

    from cembed.cli.app import app

    r = CliRunner().invoke(app, ["validate", str(cfg), "--nproc-per-node", "2"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "world size: 2" in out and "= 128 samples per optimizer step" in out
    assert "x sqrt(128/32)" in out and "gather_across_devices: true" in out


def test_unused_parameter_search_sees_every_column(tiny_model_dir):
    """W3: a module used only for one column (here: a document-side projection, as in Router or
    asymmetric models) must not be found unused, or DDP would freeze it while one process trains it."""
    from sentence_transformers import SentenceTransformer

    from cembed.distributed.ddp import unused_parameters

    base = SentenceTransformer(str(tiny_model_dir), device="cpu")

    class Asymmetric(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.doc_proj = base, torch.nn.Linear(32, 32)
            self.device = base.device

        def preprocess(self, texts, task=None):
            return {**base.preprocess(texts), "task": task}

        def forward(self, features):
            task = features.pop("task")
            emb = self.base(features)["sentence_embedding"]
            return {"sentence_embedding": self.doc_proj(emb) if task == "document" else emb}

    model = Asymmetric()
    rows = {"anchor": ["a man on a bus"], "positive": ["a man sitting on a bus"]}
    tasks = {"anchor": "query", "positive": "document"}
    assert {"doc_proj.weight", "doc_proj.bias"} <= set(unused_parameters(model, rows["anchor"]))  # anchors only
    unused = unused_parameters(model, rows, tasks)
    assert unused and not any(n.startswith("doc_proj") for n in unused)
    assert all("pooler" in n for n in unused)  # still finds what no column reaches


def test_reduce_over_ranks_without_a_group_is_the_value():
    """One process: max_over_ranks / agree_across_ranks (both reduce_over_ranks) return the value."""
    from cembed.distributed.collectives import agree_across_ranks, max_over_ranks, reduce_over_ranks

    assert reduce_over_ranks(7, "max") == reduce_over_ranks(7, "min") == 7
    assert max_over_ranks(3) == 3 and agree_across_ranks(5) == 5
    with pytest.raises(ValueError, match="op must be 'max' or 'min'"):
        reduce_over_ranks(1, "sum")
