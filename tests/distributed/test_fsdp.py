"""``distributed.strategy: fsdp`` on CPU (gloo, 2 ranks) with the tiny random model, through the real
trainer (FSDP2 ``fully_shard`` via accelerate; cembed.distributed.fsdp hands accelerate the plugin it drops on CPU).

- The model really is sharded: every parameter a DTensor, each rank holding about half the elements.
- Exactness: 2 ranks x 4 rows, 2 SGD steps of the cached loss (2 mini-batches per rank, each
  backward reduce-scattering), give the same weights as 1 process x 8 rows (within 1e-6).
- Checkpoints are sharded (torch.distributed.checkpoint folders, one file per rank, no full
  ``model.safetensors``); the final folder is a full model that ``SentenceTransformer(path)`` loads.
- Resume: AdamW, a warmup + cosine-decay schedule and dropout on (4 steps of 2 ranks x 4 rows, 2 steps
  an epoch); resuming from checkpoint-1 (mid-epoch) gives the uninterrupted run's losses, learning
  rates and final weights, which holds only if the sharded optimizer state, the scheduler and each
  rank's RNG state are all restored (each one left out was shown to break it, see
  test_fsdp_resume_restores_optimizer_schedule_and_rng).
- bf16 with gradient checkpointing and LoRA trains under FSDP (FSDP's bf16 mixed-precision policy);
  the final folder has the adapters merged.

One pair of spawned processes runs every 2-rank case (module fixture).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import end_gloo_rank, free_port, join_gloo_rank

pytestmark = pytest.mark.slow  # 2 spawned gloo ranks (module fixture)

WORLD = 2
ROWS = 8
LORA = {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["query", "value"]}
# The resume runs: 16 rows (2 steps an epoch, so checkpoint-1 is mid-epoch), AdamW with warmup over
# steps 1-2 then cosine decay: learning rates 0, lr/2, lr, lr/2 at steps 1-4. After a resume from
# checkpoint-1, step 2 takes its rate from the restored optimizer's param groups, steps 3-4 from the
# scheduler (a fresh one would give lr/2, lr instead of lr, lr/2).
RESUME_ROWS = 16
RESUME_STEPS = 4
RESUME_OPTIM = {
    "learning_rate": 1e-2,
    "lr_scaling": "none",
    "warmup_ratio": 0.5,
    "weight_decay": 0.01,
    "lr_scheduler_type": "cosine",
}


def _config(
    tmp: Path, model_dir: Path, world: int, out: str, rows: int = ROWS, optim: dict | None = None, **model
) -> dict:
    """A run of ``ROWS // world`` rows per rank from a file of ``rows`` distinct pairs: 2 steps at a
    constant LR without weight decay (the exactness runs), or with ``optim`` those optimizer settings
    and RESUME_STEPS steps (the resume runs)."""
    data = tmp / f"pairs{rows}.jsonl"
    if not data.exists():
        words = "man woman dog cat train table street car room plate food bus".split()
        rows_ = [
            {"anchor": f"a {words[i % 12]} on the {words[-1 - i % 12]}", "positive": f"the {words[i % 12]} near a bus"}
            for i in range(rows)
        ]
        for i, row in enumerate(rows_[12:], 12):  # distinct texts past the 12 words
            row["anchor"] += f" {i}"
            row["positive"] += f" {i}"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return {
        "model": {"name_or_path": str(model_dir), "max_seq_length": 32, "device": "cpu", **model},
        "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
        "batch": {"per_device_train_batch_size": ROWS // world, "mini_batch_size": 2},
        "optim": optim
        or {
            "learning_rate": 0.5,
            "lr_scaling": "none",
            "warmup_ratio": 0.0,
            "weight_decay": 0.0,
            "lr_scheduler_type": "constant",
        },
        "loss": {"name": "cached_mnrl", "scale": 20},
        "distributed": {"strategy": "fsdp"},
        "train": {
            "max_steps": RESUME_STEPS if optim else 2,
            "save_steps": 1,
            "logging_steps": 1,
            "output_dir": str(tmp / out),
        },
    }


def _sgd_trainer(record: list):
    """Plain SGD (Adam's first step is lr x sign(gradient) and would hide a wrong gradient scale);
    keeps each trainer in ``record``."""
    from cembed.train.trainer import CembedTrainer

    class SGDTrainer(CembedTrainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                params = [p for p in self.model.parameters() if p.requires_grad]
                self.optimizer = torch.optim.SGD(params, lr=self.args.learning_rate)
            return self.optimizer

        def train(self, *args, **kwargs):
            record.append(self)
            return super().train(*args, **kwargs)

    return SGDTrainer


def _run(cfg_dict: dict, base: Path, trainer_cls, resume_from: str | None = None) -> dict:

    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training

    cfg = config_from_dict(cfg_dict, base=base)
    plan, data = check_run_inputs(cfg)
    return run_training(cfg, plan, data, resume_from=resume_from, trainer_cls=trainer_cls)


def _recording_trainer(record: list):
    """cembed's own trainer (its optimizer from the config: AdamW), kept in ``record``."""
    from cembed.train.trainer import CembedTrainer

    class RecordingTrainer(CembedTrainer):
        def train(self, *args, **kwargs):
            record.append(self)
            return super().train(*args, **kwargs)

    return RecordingTrainer


def _resume_run(tmp: Path, model_dir: Path, out: str, record: list, resume_from: str | None = None) -> dict:
    """One AdamW + schedule + dropout run (see RESUME_OPTIM): its logged losses and learning rates."""
    cfg = _config(tmp, model_dir, WORLD, out, rows=RESUME_ROWS, optim=RESUME_OPTIM)
    summary = _run(cfg, tmp, _recording_trainer(record), resume_from=resume_from)
    trainer = record[-1]
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    return {
        "losses": summary["losses"],
        "lrs": [[h["step"], h["learning_rate"]] for h in trainer.state.log_history if "learning_rate" in h],
        "optimizer": type(optimizer).__name__,
        "dropout": max(m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)),
    }


def _worker(rank: int, tmp: str, model_dir: str, dropout_model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 600)
    from torch.distributed.tensor import DTensor

    from cembed.distributed.fsdp import local_numel

    tmp_path, model_path = Path(tmp), Path(model_dir)
    record: list = []
    trainer_cls = _sgd_trainer(record)
    summary = _run(_config(tmp_path, model_path, WORLD, "fsdp"), tmp_path, trainer_cls)
    trainer = record[-1]
    local, total = local_numel(trainer.model)
    results = {
        "fsdp_enabled": trainer.is_fsdp_enabled,
        "all_dtensor": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "local_numel": local,
        "total_numel": total,
        "losses": summary["losses"],
    }
    dropout_path = Path(dropout_model_dir)
    results["straight"] = _resume_run(tmp_path, dropout_path, "straight", record)
    checkpoint = str(tmp_path / "straight" / "checkpoint-1")
    results["resumed"] = _resume_run(tmp_path, dropout_path, "resumed", record, resume_from=checkpoint)
    summary = _run(
        _config(tmp_path, model_path, WORLD, "bf16", precision="bf16", gradient_checkpointing=True, lora=LORA),
        tmp_path,
        trainer_cls,
    )
    trainer = record[-1]
    param = next(trainer.model.parameters())
    results["bf16"] = {
        "losses": summary["losses"],
        "param_dtype": str(trainer.accelerator.state.fsdp_plugin.mixed_precision_policy.param_dtype),
        "storage_dtype": str(param.dtype),
    }
    (tmp_path / f"results-rank{rank}.json").write_text(json.dumps(results))
    end_gloo_rank()


@pytest.fixture(scope="module")
def fsdp_results(tiny_model_dir, tiny_dropout_model_dir, tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("fsdp")
    args = (str(tmp), str(tiny_model_dir), str(tiny_dropout_model_dir), free_port())
    mp.spawn(_worker, args=args, nprocs=WORLD, join=True)
    return tmp, [json.loads((tmp / f"results-rank{r}.json").read_text()) for r in range(WORLD)]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_fsdp_shards_the_model_on_cpu(fsdp_results):
    _, results = fsdp_results
    assert all(r["fsdp_enabled"] and r["all_dtensor"] for r in results)
    total = results[0]["total_numel"]
    assert sum(r["local_numel"] for r in results) == total  # each element lives on exactly one rank
    assert all(abs(r["local_numel"] - total / WORLD) <= 0.01 * total for r in results)


def test_fsdp_two_ranks_equal_one_process(fsdp_results, tiny_model_dir):
    """2 ranks x 4 rows under FSDP == 1 process x 8 rows: loss of each step and the weights after
    2 SGD steps (the final folder holds the gathered model)."""
    tmp, results = fsdp_results
    record: list = []
    ref = _run(
        _config(tmp, tiny_model_dir, 1, "one-process") | {"distributed": {"strategy": "ddp"}}, tmp, _sgd_trainer(record)
    )
    fsdp, one = _weights(tmp / "fsdp"), _weights(tmp / "one-process")
    initial = _weights(Path(tiny_model_dir))
    assert fsdp.keys() == one.keys() == initial.keys()
    d_w = max((fsdp[k] - one[k]).abs().max().item() for k in one)
    moved = max((one[k] - initial[k]).abs().max().item() for k in one)
    d_loss = max(abs(a[1] - b[1]) for a, b in zip(results[0]["losses"], ref["losses"]))
    print(f"\nFSDP 2 ranks vs 1 process: max|dW| {d_w:.2e} (max update {moved:.2e}), max|dloss| {d_loss:.2e}")
    assert len(results[0]["losses"]) == len(ref["losses"]) == 2
    assert d_loss <= 1e-6 and d_w <= 1e-6
    assert moved > 1e-3  # the steps really changed the weights


def test_fsdp_checkpoints_are_sharded(fsdp_results):
    tmp, _ = fsdp_results
    for ckpt in (tmp / "fsdp" / "checkpoint-1", tmp / "straight" / "checkpoint-1"):  # SGD, AdamW
        names = {p.name for p in ckpt.iterdir()}
        assert "model.safetensors" not in names and "optimizer.pt" not in names
        for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch.distributed.checkpoint: one file per rank
            assert {p.name for p in (ckpt / folder).iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"} <= names


def test_fsdp_resume_restores_optimizer_schedule_and_rng(fsdp_results, tiny_dropout_model_dir):
    """Killed after step 1 (mid-epoch) and resumed == uninterrupted, with everything a resume must
    restore in play: AdamW's moments (a fresh AdamW's first step is lr x sign(g)), the warmup + cosine
    schedule (a fresh scheduler restarts the warmup) and dropout (each rank's RNG: other masks).
    Measured with one of them left out (in the test's trainer, on a scratch copy), max|dloss| over steps
    2-4 / max|dW|: optimizer state 0.23 / 3.4e-2, scheduler 0.11 / 1.2e-2, RNG 0.28 / 3.5e-2; all
    restored: 0 / 0."""
    tmp, results = fsdp_results
    lr = RESUME_OPTIM["learning_rate"]
    for r in results:
        straight, resumed = r["straight"], r["resumed"]
        assert straight["optimizer"] == "AdamW" and straight["dropout"] == 0.1  # not vacuous
        # The schedule really moves: warmup 0 -> lr/2 -> lr, then cosine decay to lr/2.
        assert [s for s, _ in straight["lrs"]] == [1, 2, 3, 4]
        assert [v for _, v in straight["lrs"]] == pytest.approx([0.0, lr / 2, lr, lr / 2], abs=1e-12)
        assert [s for s, _ in resumed["losses"]] == [1, 2, 3, 4]  # step 1: the checkpoint's history
        assert resumed["lrs"][-3:] == straight["lrs"][1:]
        d_loss = max(abs(a[1] - b[1]) for a, b in zip(straight["losses"], resumed["losses"]))
        assert d_loss <= 1e-6, (straight["losses"], resumed["losses"])
    straight_w, resumed_w = _weights(tmp / "straight"), _weights(tmp / "resumed")
    initial = _weights(Path(tiny_dropout_model_dir))
    d_w = max((straight_w[k] - resumed_w[k]).abs().max().item() for k in straight_w)
    moved = max((straight_w[k] - initial[k]).abs().max().item() for k in straight_w)
    print(f"\nFSDP resume vs uninterrupted (AdamW, cosine, dropout): max|dW| {d_w:.2e} (max update {moved:.2e})")
    assert d_w <= 1e-6 and moved > 1e-3
    state = json.loads((tmp / "resumed" / "run_summary.json").read_text())
    assert state["status"] == "completed" and state["steps"] == RESUME_STEPS


def test_fsdp_final_folder_is_a_full_loadable_model(fsdp_results, tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    tmp, _ = fsdp_results
    model = SentenceTransformer(str(tmp / "fsdp"), device="cpu")
    saved = _weights(tmp / "fsdp")
    loaded = model[0].auto_model.state_dict()
    assert loaded.keys() == saved.keys()
    for name, tensor in loaded.items():  # every weight full size, as gathered and saved
        assert torch.equal(tensor, saved[name]), name
    base = SentenceTransformer(str(tiny_model_dir), device="cpu")
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in base.state_dict().items()}
    assert model.encode(["a dog on the bus"]).shape == (1, 32)
    shutil.rmtree(tmp / "one-process", ignore_errors=True)


def test_fsdp_bf16_with_gradient_checkpointing_and_lora_trains(fsdp_results, tiny_model_dir):
    """bf16 + gradient checkpointing + LoRA under FSDP: trains, and the final folder holds the
    adapters merged into full weights (only the adapted query/value matrices changed)."""
    tmp, results = fsdp_results
    bf16 = results[0]["bf16"]
    assert bf16["param_dtype"] == "torch.bfloat16"  # FSDP computes in bf16 ...
    assert bf16["storage_dtype"] == "torch.float32"  # ... on fp32 sharded master weights
    fp32 = results[0]["losses"]
    assert len(bf16["losses"]) == 2 and abs(bf16["losses"][0][1] - fp32[0][1]) < 0.05  # step 1: the same model
    assert results[1]["bf16"]["losses"] == bf16["losses"]  # the logged loss is the same on both ranks
    merged, initial = _weights(tmp / "bf16"), _weights(Path(tiny_model_dir))
    assert merged.keys() == initial.keys() and not (tmp / "bf16" / "adapter_model.safetensors").exists()
    changed = {k for k in initial if not torch.equal(merged[k].float(), initial[k].float())}
    assert changed and all(".query.weight" in k or ".value.weight" in k for k in changed), changed


# The best-checkpoint run: SGD at LR 0.5 over 16 rows (2 ranks x 4 rows a step), evaluated on a small
# STS set after every step. Its Spearman rises to a peak at step 2 and falls after (measured in one
# process: 0.40, 0.74, 0.71, 0.68, 0.64), so the best checkpoint is not the last one.
BEST_STEPS = 5
STS_PAIRS = [
    ("a man on the street", "the man near a bus", 4.5),
    ("a dog on the plate", "the dog near a bus", 3.0),
    ("a cat in the room", "a car on the table", 1.0),
    ("the train near a bus", "a train on the street", 4.0),
    ("a woman at the table", "the food on a plate", 0.5),
    ("the bus on the street", "a bus near the car", 3.5),
    ("a plate of food", "the cat on the train", 0.2),
    ("a room with a table", "the table in a room", 4.8),
]


def _best_config(tmp: Path, model_dir: Path, out: str) -> dict:
    sts = tmp / "sts.tsv"
    sts.write_text("".join(f"{a}\t{b}\t{score}\n" for a, b, score in STS_PAIRS))
    cfg = _config(tmp, model_dir, WORLD, out, rows=16)
    cfg["train"]["max_steps"] = BEST_STEPS
    cfg["eval"] = {"sts": str(sts), "eval_steps": 1, "metric_for_best_model": "sts_spearman_cosine"}
    return cfg


def _best_worker(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 300)  # a hung collective ends the rank (exit 3): the test fails

    tmp_path = Path(tmp)
    record: list = []
    summary = _run(_best_config(tmp_path, Path(model_dir), "best"), tmp_path, _sgd_trainer(record))
    state = record[-1].state
    results = {"best_model_checkpoint": state.best_model_checkpoint, "eval": summary["eval"]}
    (tmp_path / f"best-rank{rank}.json").write_text(json.dumps(results))
    end_gloo_rank()


@pytest.fixture(scope="module")
def fsdp_best_run(tiny_model_dir, tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("fsdp_best")
    mp.spawn(_best_worker, args=(str(tmp), str(tiny_model_dir), free_port()), nprocs=WORLD, join=True)
    return tmp, [json.loads((tmp / f"best-rank{r}.json").read_text()) for r in range(WORLD)]


def test_fsdp_keeps_and_loads_the_best_checkpoint(fsdp_best_run):
    """FSDP with eval.metric_for_best_model, the best step not the last: every rank records the
    published checkpoint (not the staging folder it was written in), the best checkpoint survives
    rotation (save_total_limit 2: the best and the last), the run ends (no rank waits in a load the
    other skipped) and output_dir holds the best step's weights: scored afresh, equal to the best
    evaluation within 1e-6."""
    from sentence_transformers import SentenceTransformer

    from cembed.eval.evaluators import evaluate_sts
    from cembed.eval.sets import load_sts

    tmp, results = fsdp_best_run
    out = tmp / "best"
    ev = json.loads((out / "run_summary.json").read_text())["eval"]
    during = {e["step"]: e["metrics"]["sts_spearman_cosine"] for e in ev["during"]}
    assert sorted(during) == list(range(1, BEST_STEPS + 1))
    best_step = max(during, key=lambda s: (during[s], -s))
    assert best_step != BEST_STEPS and during[best_step] - during[BEST_STEPS] > 0.01, during  # not vacuous
    best_dir = str(out / f"checkpoint-{best_step}")
    assert [r["best_model_checkpoint"] for r in results] == [best_dir] * WORLD
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted(
        {f"checkpoint-{best_step}", f"checkpoint-{BEST_STEPS}"}
    )
    assert not (out / ".staging").exists()
    best = ev["best"]
    assert best["step"] == best_step and best["checkpoint"] == best_dir and best["loaded"] is True
    assert best["value"] == pytest.approx(during[best_step], abs=1e-12)
    final = SentenceTransformer(str(out), device="cpu")
    scored = evaluate_sts(final, load_sts(tmp / "sts.tsv", "sts"))["sts_spearman_cosine"]
    print(f"\nFSDP best checkpoint: eval {during}; best step {best_step}; output_dir scores {scored:.4f}")
    assert scored == pytest.approx(during[best_step], abs=1e-6)
    assert ev["after"]["sts_spearman_cosine"] == pytest.approx(during[best_step], abs=1e-6)
