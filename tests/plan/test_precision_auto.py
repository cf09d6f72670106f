"""``model.precision: auto`` (the default): fp32 on CPU, bf16 on a GPU with bf16, fp16 on one with
fp16 tensor cores only, fp32 on older ones; TF32 on for fp32 matmuls on compute capability 8.0+.
Resolved once in the plan, printed by ``validate`` and recorded in ``run_summary.json``. CUDA is
simulated by monkeypatching torch.cuda's capability queries."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import distinct_pairs
from typer.testing import CliRunner

import cembed.plan.resolve as P
from cembed.cli.app import app
from cembed.config.schema import CembedConfig, ModelConfig
from cembed.errors import UserError
from cembed.plan.precision import enable_tf32, resolve_precision

GPUS = {
    "NVIDIA H200": (9, 0),
    "NVIDIA A100-SXM4-80GB": (8, 0),
    "Tesla V100-SXM2-32GB": (7, 0),
    "Tesla T4": (7, 5),
    "Tesla P100-PCIE-16GB": (6, 0),
}


def fake_gpu(monkeypatch, name: str) -> None:
    """Make this process look as if it ran on ``name`` (its compute capability from GPUS)."""
    major, minor = GPUS[name]
    monkeypatch.setattr(P, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, minor))

    def bf16(including_emulation: bool = True) -> bool:
        return major >= 8 or including_emulation  # torch emulates bf16 on older GPUs

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16)


def cfg(**model) -> CembedConfig:
    return CembedConfig.model_validate({"data": {"train": "pairs.jsonl"}, "model": model})


def test_auto_is_the_default_and_resolves_to_fp32_on_cpu():
    assert ModelConfig().precision == "auto"
    plan = P.resolve_plan(cfg(device="cpu"))
    assert (plan.precision, plan.tf32, plan.precision_reason) == ("fp32", False, "fp32 (auto: CPU)")
    assert P.resolve_plan(cfg(device="cpu", precision="bf16")).precision == "bf16"  # explicit: kept
    with pytest.raises(UserError, match="fp16 needs a CUDA device"):
        P.resolve_plan(cfg(device="cpu", precision="fp16"))


@pytest.mark.parametrize(
    "gpu, precision, tf32",
    [
        ("NVIDIA H200", "bf16", True),
        ("NVIDIA A100-SXM4-80GB", "bf16", True),
        ("Tesla V100-SXM2-32GB", "fp16", False),  # bf16 only emulated: fp16 tensor cores instead
        ("Tesla T4", "fp16", False),
        ("Tesla P100-PCIE-16GB", "fp32", False),
    ],
)
def test_auto_on_cuda_follows_the_gpu(monkeypatch, gpu, precision, tf32):
    fake_gpu(monkeypatch, gpu)
    plan = P.resolve_plan(cfg())
    assert (plan.device, plan.precision, plan.tf32) == ("cuda", precision, tf32)
    assert plan.precision_reason.startswith(f"{precision} (auto: {gpu}, compute capability {GPUS[gpu][0]}.")
    assert ("TF32 on" in plan.precision_reason) is tf32


def test_explicit_precision_on_cuda(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200")
    plan = P.resolve_plan(cfg(precision="fp32"))  # fp32 asked: kept, with TF32 for its matmuls
    assert (plan.precision, plan.tf32) == ("fp32", True)
    assert (
        plan.precision_reason == "fp32 (model.precision; NVIDIA H200, compute capability 9.0, TF32 on for fp32 matmuls)"
    )
    fake_gpu(monkeypatch, "Tesla T4")
    assert P.resolve_plan(cfg(precision="fp16")).precision == "fp16"
    # bf16 that the GPU only emulates is refused, naming the GPU and the fix
    with pytest.raises(UserError, match=r"bf16 is not supported by this GPU \(Tesla T4, compute capability 7\.5.*fp16"):
        P.resolve_plan(cfg(precision="bf16"))


def test_probe_without_a_plan_resolves_auto_for_its_device():
    assert P.resolve_model(ModelConfig(device="cpu")).precision == "fp32"
    assert resolve_precision("auto", "cpu").precision == "fp32"
    with pytest.raises(UserError, match="fp16 needs a CUDA device"):
        P.resolve_model(ModelConfig(device="cpu", precision="fp16"))


def test_enable_tf32_leaves_every_backend_consistent():
    """After enable_tf32 both the legacy flags and the precision query read (a per-backend-only
    setting makes torch.get_float32_matmul_precision raise on torch 2.9+, which inductor calls)."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        enable_tf32()
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
    assert torch.backends.cuda.matmul.allow_tf32 is (before[0] != "highest")


def test_validate_prints_the_resolved_precision(monkeypatch, tiny_model_dir, write_config, pairs_file):
    base = {
        "model": {"name_or_path": str(tiny_model_dir)},
        "data": {"train": str(pairs_file(distinct_pairs(16))), "pretokenize": False},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
    }
    r = CliRunner().invoke(app, ["validate", str(write_config({**base, "model": {**base["model"], "device": "cpu"}}))])
    assert r.exit_code == 0, r.output
    assert "precision: fp32 (auto: CPU)" in r.output
    assert "trained in float32, saved as float32" in r.output  # weights line: no autocast under fp32
    fake_gpu(monkeypatch, "NVIDIA H200")
    r = CliRunner().invoke(app, ["validate", str(write_config(base))])
    assert r.exit_code == 0, r.output
    assert "precision: bf16 (auto: NVIDIA H200, compute capability 9.0 has bf16, TF32 on for fp32 matmuls)" in r.output
    assert "trained in float32 with bfloat16 autocast" in r.output


@pytest.mark.slow
def test_run_summary_records_the_precision_and_a_resume_compares_it_resolved(tiny_model_dir, tmp_path):
    """The summary records requested and resolved precision; a checkpoint of an explicit-fp32 run
    resumes under the default auto on CPU (both train in fp32), so the new default does not lock
    older runs out."""
    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(16)))

    def run(resume_from: str | None, **model):  # (resumed with --overwrite: the folder's checkpoint-2 is replaced)
        data = {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu", **model},
            "data": {"train": str(pairs), "pretokenize": False},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"max_steps": 2, "save_steps": 1, "output_dir": str(tmp_path / "out")},
        }
        config = config_from_dict(data, base=tmp_path)
        plan, prepared = check_run_inputs(config)
        run_training(config, plan, prepared, resume_from=resume_from, overwrite=resume_from is not None)
        return json.loads((tmp_path / "out" / "run_summary.json").read_text())

    first = run(None, precision="fp32")
    assert first["precision"] == {
        "requested": "fp32",
        "resolved": "fp32",
        "tf32": False,
        "reason": "fp32 (model.precision)",
    }
    resumed = run(str(tmp_path / "out" / "checkpoint-1"))  # precision: auto (the default)
    assert (
        resumed["status"] == "completed" and resumed["steps"] == 2 and resumed["resumed_from"].endswith("checkpoint-1")
    )
    assert resumed["resume_changes"] == []
    assert resumed["precision"] == {
        "requested": "auto",
        "resolved": "fp32",
        "tf32": False,
        "reason": "fp32 (auto: CPU)",
    }
    assert resumed["plan"]["precision"] == "fp32" and resumed["weights"]["autocast"] is None
