"""cembed.plan.resolve: the plan's numbers for a few configs and world sizes (samples per step, the
effective LR by the sqrt rule ``lr = base_lr * sqrt(bs / base_bs)``, gather, warnings, workers)."""

from __future__ import annotations

import math

import pytest

from cembed.config.file import config_from_dict
from cembed.errors import UserError
from cembed.plan.resolve import AUTO_WORKERS_MIN_TEXTS, resolve_plan, resolve_workers, shm_warning

ACCUMULATION = (
    "batch.gradient_accumulation_steps=2: accumulation adds no in-batch negatives (each accumulated batch only "
    "sees its own); with loss cached_mnrl raise per_device_train_batch_size instead"
)


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _cfg(tmp_path, **sections):
    return config_from_dict({"data": {"train": "x.jsonl"}, "model": {"device": "cpu"}, **sections}, base=tmp_path)


def test_defaults_on_one_cpu_process(tmp_path):
    plan = resolve_plan(_cfg(tmp_path))
    assert (plan.device, plan.world_size, plan.per_device_train_batch_size) == ("cpu", 1, 64)
    assert (plan.gradient_accumulation_steps, plan.samples_per_step) == (1, 64)
    assert plan.learning_rate == pytest.approx(2e-5 * math.sqrt(2))  # 2e-5 x sqrt(64 / 32)
    assert plan.lr_derivation == "2.828e-05 = 2e-05 x sqrt(64/32) (lr_scaling: sqrt)"
    assert (plan.precision, plan.tf32, plan.gather_across_devices) == ("fp32", False, False)
    assert plan.warnings == ()
    assert (plan.mini_batch_size, plan.mini_batch_num_tokens, plan.save_dtype, plan.lora_merge) == (
        32,
        None,
        None,
        None,
    )
    # auto workers: 64 rows x 2 columns = 128 texts, below the threshold
    assert plan.dataloader_num_workers == 0
    assert plan.dataloader_workers == "auto: 0, batches of 128 texts (< 8192) are produced in the main process"
    assert plan.to_dict()["samples_per_step"] == 64


@pytest.mark.parametrize(
    "per_device, world, accumulation, base_bs, samples, lr",
    [
        (128, 4, 2, 32, 1024, 1e-4 * math.sqrt(32)),  # 128 x 4 x 2
        (512, 2, 1, 32, 1024, 1e-4 * math.sqrt(32)),  # the same global batch, another split
        (16, 1, 1, 64, 16, 1e-4 * 0.5),  # below the base batch: sqrt(16 / 64) = 1/2
        (32, 8, 1, 256, 256, 1e-4),  # at the base batch: unscaled
    ],
)
def test_samples_per_step_and_sqrt_lr(tmp_path, per_device, world, accumulation, base_bs, samples, lr):
    cfg = _cfg(
        tmp_path,
        batch={
            "per_device_train_batch_size": per_device,
            "mini_batch_size": 8,
            "gradient_accumulation_steps": accumulation,
        },
        optim={"learning_rate": 1e-4, "base_batch_size": base_bs},
    )
    plan = resolve_plan(cfg, world_size=world)
    assert (plan.world_size, plan.samples_per_step) == (world, samples)
    assert plan.learning_rate == pytest.approx(lr, rel=1e-12)
    assert plan.gather_across_devices is (world > 1)  # unset: gather with several processes
    assert (ACCUMULATION in plan.warnings) is (accumulation > 1)


def test_linear_and_none_rules(tmp_path):
    optim = {"learning_rate": 1e-5, "base_batch_size": 32, "lr_scaling": "linear"}
    plan = resolve_plan(_cfg(tmp_path, batch={"per_device_train_batch_size": 256}, optim=optim), world_size=2)
    assert plan.learning_rate == pytest.approx(1e-5 * 16)  # 512 / 32
    assert plan.lr_derivation == "1.600e-04 = 1e-05 x (512/32) (lr_scaling: linear)"
    plan = resolve_plan(_cfg(tmp_path, optim={**optim, "lr_scaling": "none"}), world_size=2)
    assert plan.learning_rate == 1e-5
    assert plan.lr_derivation == "1.000e-05 = learning_rate 1e-05 (lr_scaling: none)"


def test_world_size_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    plan = resolve_plan(_cfg(tmp_path))
    assert (plan.world_size, plan.samples_per_step, plan.gather_across_devices) == (3, 192, True)
    assert resolve_plan(_cfg(tmp_path), world_size=2).world_size == 2  # the argument wins
    with pytest.raises(UserError, match="world size -1"):
        resolve_plan(_cfg(tmp_path), world_size=-1)


def test_multi_process_warnings_and_other_fields(tmp_path):
    cfg = _cfg(
        tmp_path,
        model={"device": "cpu", "lora": {}, "save_dtype": "bf16"},
        batch={"per_device_train_batch_size": 128, "mini_batch_size": "auto", "drop_last": False},
        loss={"gather_across_devices": False},
    )
    plan = resolve_plan(cfg, world_size=4)
    assert plan.gather_across_devices is False
    assert plan.warnings == (
        "loss.gather_across_devices=false with 4 processes: each anchor only sees the 128 rows of its own rank as "
        "negatives, not the whole global batch",
        "batch.drop_last=false has no effect with 4 processes: every rank needs a full batch of the same size, so "
        "rows that cannot fill a whole global batch at the end of an epoch are left out",
    )
    assert (plan.mini_batch_size, plan.save_dtype, plan.lora_merge) == (None, "bfloat16", True)
    # one process: drop_last false is honoured, no warning
    assert resolve_plan(cfg, world_size=1).warnings == ()


def test_fp16_on_cpu_refused(tmp_path):
    with pytest.raises(UserError):
        resolve_plan(_cfg(tmp_path, model={"device": "cpu", "precision": "fp16"}))


def test_resolve_workers_auto(tmp_path):
    missing = str(tmp_path / "no-shm")  # unreadable mount: no shared-memory check
    rows = AUTO_WORKERS_MIN_TEXTS // 2  # x 2 columns: exactly the threshold
    assert resolve_workers("auto", rows - 1, 2, 128, cpus=16, path=missing)[0] == 0
    assert resolve_workers("auto", rows, 2, 128, cpus=16, path=missing) == (
        2,
        "auto: 2, batches of 8192 texts, 16 CPU cores per training process",
        None,
    )
    # 4 processes on 8 cores: 2 cores each, so one worker beside the training process
    assert resolve_workers("auto", rows, 2, 128, processes_per_node=4, cpus=8, path=missing)[:2] == (
        1,
        "auto: 1, batches of 8192 texts, 2 CPU cores per training process",
    )
    assert resolve_workers("auto", rows, 2, 128, processes_per_node=8, cpus=8, path=missing) == (
        0,
        "auto: 0, 1 CPU core per training process leaves none for workers",
        None,
    )
    # a number is kept as given
    assert resolve_workers(3, 10, 2, 128, path=missing) == (3, "3 (train.dataloader_num_workers)", None)


def test_shared_memory_too_small(tmp_path):
    rows = 10**8  # 1e8 rows x 2 columns x 512 tokens x 24 bytes x 2 workers x 2 batches: ~10^7 GiB
    assert shm_warning(rows, 2, None, 0, str(tmp_path)) is None  # no workers: nothing through shared memory
    warning = shm_warning(rows, 2, None, 2, str(tmp_path))
    assert warning.startswith(
        "train.dataloader_num_workers=2: a batch of 100000000 rows x 2 columns x 512 tokens is up to 2343750 MiB, "
        "and 2 workers x 2 batches in flight need up to 9375000 MiB of shared memory"
    )
    workers, how, warn = resolve_workers("auto", rows, 2, None, cpus=16, path=str(tmp_path))
    assert (workers, how) == (0, "auto: 0, shared memory too small for workers")
    assert "need 9375000 MiB of shared memory" in warn
    assert shm_warning(10, 2, 128, 2, str(tmp_path)) is None  # a small batch fits
