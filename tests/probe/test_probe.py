"""probe-minibatch: the search against fake devices, CPU budget mode on a tiny model, `auto` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import REPO, distinct_pairs
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import load_config, set_yaml_value
from cembed.config.loss import loss_config
from cembed.config.schema import ModelConfig
from cembed.data.truncation import truncation_report
from cembed.errors import UserError
from cembed.files import parse_bytes
from cembed.probe.search import search_mini_batch
from cembed.probe.trials import SubprocessTrial, TrialOutcome, TrialSpec

FITS_UP_TO = 37
PER_ROW = 900  # fake bytes per row: 37 x 900 = 33300 = 0.9 x 37000, so with margin 10% exactly 37 fits
CAPACITY = 37000


def fake_device(fits_up_to: int = FITS_UP_TO, per_row: int = PER_ROW, throughput=lambda s: 10.0 * s, error=None):
    """A trial whose peak is per_row x size; with ``error`` it raises that instead of going over."""
    tried = []

    def trial(size: int) -> TrialOutcome:
        tried.append(size)
        if error is not None and size > fits_up_to:
            raise error
        return TrialOutcome(peak_bytes=per_row * size, samples_per_s=throughput(size))

    return trial, tried


@pytest.mark.parametrize("cap", [64, 1024, 65536])
def test_search_exact_answer_only_tested_sizes_few_trials(cap):
    trial, tried = fake_device()
    r = search_mini_batch(trial, CAPACITY, margin=0.10, cap=cap, knee_fraction=None)
    assert r.recommended == r.max_fit == FITS_UP_TO
    assert [t.size for t in r.trials] == tried  # every record is a size that was actually run
    assert r.recommended in tried and FITS_UP_TO + 1 in tried  # the answer and the first failure above it
    assert all(t.fits == (t.size <= FITS_UP_TO) for t in r.trials)
    assert len(tried) <= 2 * math.log2(cap)
    assert len(set(tried)) == len(tried)
    # without headroom, 41 x 900 = 36900 <= 37000 fits
    trial, _ = fake_device()
    assert search_mini_batch(trial, CAPACITY, margin=0.0, cap=cap, knee_fraction=None).recommended == 41


def test_search_every_threshold_and_cap():
    for cap in (1, 5, 96, 256):
        for threshold in range(1, cap + 2):
            trial, tried = fake_device(throughput=lambda s: None)
            r = search_mini_batch(trial, threshold * PER_ROW, margin=0.0, cap=cap)
            assert r.recommended == min(threshold, cap), (cap, threshold)
            assert r.recommended in tried and len(tried) <= max(2, 2 * math.log2(max(cap, 2)))
    trial, _ = fake_device()
    with pytest.raises(UserError, match=r"batch\.mini_batch_size: not even 1 row fits"):
        search_mini_batch(trial, PER_ROW - 1, margin=0.0, cap=64)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: invalid configuration argument"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
)
def test_cuda_style_errors_count_as_does_not_fit(error):
    # The fake never exceeds memory: its only failure is the error it raises above 37.
    trial, tried = fake_device(per_row=1, error=error)
    r = search_mini_batch(trial, CAPACITY, margin=0.10, cap=1024, knee_fraction=None)
    assert r.recommended == FITS_UP_TO
    failed = [t for t in r.trials if not t.fits]
    assert failed and all(t.size > FITS_UP_TO and type(error).__name__ in t.error for t in failed)


def test_other_errors_are_bugs_not_failures():
    trial, _ = fake_device(error=ValueError("shape mismatch"))
    with pytest.raises(ValueError, match="shape mismatch"):
        search_mini_batch(trial, CAPACITY, cap=1024)


def test_throughput_plateau_recommends_the_knee():
    # samples/s grows until 20 rows, then stays flat: tried sizes 8, 16, 32, 64, 48, 40, 36, 38, 37.
    trial, tried = fake_device(throughput=lambda s: 100.0 * min(s, 20))
    r = search_mini_batch(trial, CAPACITY, margin=0.10, cap=1024)
    assert r.max_fit == 37
    assert r.recommended == 32  # smallest tried size with >= 95% of the best (2000 samples/s)
    assert r.recommended in tried and "knee" in r.reason
    # a curve still rising steeply at the edge keeps the largest size (36 reaches only (36/37)^2 = 94.7%)
    trial, _ = fake_device(throughput=lambda s: 1.0 * s * s)
    assert search_mini_batch(trial, CAPACITY, margin=0.10, cap=1024).recommended == 37


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 1024**3
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_bytes("2GB") == 2 * 10**9
    with pytest.raises(UserError, match="--max-memory: cannot read '8 lots'"):
        parse_bytes("8 lots")


@pytest.mark.slow
def test_cpu_budget_mode_tiny_model(tiny_model_dir):
    spec = TrialSpec(
        model=ModelConfig(name_or_path=str(tiny_model_dir), max_seq_length=128, device="cpu").model_dump(),
        loss=loss_config().model_dump(),
        n_columns=2,
        batch_size=256,
        device="cpu",
    )
    trial = SubprocessTrial(spec)
    small, large = trial(64), trial(128)
    assert small.error is None and large.error is None
    assert large.peak_bytes > small.peak_bytes + 20 * 1024**2, (small, large)  # activations really measured
    budget = (small.peak_bytes + large.peak_bytes) // 2
    trial.kill_above = budget
    r = search_mini_batch(trial, budget, margin=0.0, cap=256, start=32, knee_fraction=None)
    assert 64 <= r.max_fit < 128
    by_size = {t.size: t for t in r.trials}
    assert by_size[r.max_fit].peak_bytes <= budget and by_size[r.recommended].peak_bytes <= budget
    next_tried = min(s for s in by_size if s > r.max_fit)
    assert next_tried == r.max_fit + 1
    assert by_size[next_tried].peak_bytes > budget and not by_size[next_tried].fits


@pytest.mark.slow
def test_mini_batch_size_auto_trains_end_to_end_on_cpu(tiny_model_dir, write_config, pairs_file, tmp_path):
    out = tmp_path / "run"
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 32, "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(96)))},
            "batch": {"per_device_train_batch_size": 32, "mini_batch_size": "auto"},
            "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(out)},
        }
    )
    assert load_config(cfg).batch.mini_batch_size == "auto"
    r = subprocess.run(
        [sys.executable, "-m", "cembed", "train", str(cfg), "--max-memory", "8GiB"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "run_summary.json").read_text())
    probe = summary["mini_batch_probe"]
    rec = probe["recommended"]
    # doubles up to the batch size (all fit in 8 GiB), then the token budget rec x 32 tokens is run
    assert [(t["size"], t["num_tokens"]) for t in probe["trials"]] == [
        (8, None),
        (16, None),
        (32, None),
        (rec, rec * 32),
    ]
    assert all(t["fits"] and t["peak_bytes"] < 0.9 * 8 * 1024**3 for t in probe["trials"])
    assert probe["max_fit"] == 32 and probe["capacity_bytes"] == 8 * 1024**3 and probe["device"] == "cpu"
    assert probe["recommended_num_tokens"] == rec * 32 and probe["max_fit_num_tokens"] == 32 * 32
    assert summary["config"]["batch"]["mini_batch_size"] == rec
    assert summary["config"]["batch"]["mini_batch_num_tokens"] == summary["plan"]["mini_batch_num_tokens"] == rec * 32
    override = f"batch.mini_batch_size={rec} batch.mini_batch_num_tokens={rec * 32}"
    assert rec in (8, 16, 32) and probe["override"] == override
    assert f"override: {override}" in r.stdout
    assert summary["steps"] == 2


def test_write_keeps_comments_and_adds_missing_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "data:\n  train: x.jsonl\nbatch:\n  per_device_train_batch_size: 64  # negatives\n  mini_batch_size: auto   # probe\n"
    )
    set_yaml_value(p, ("batch", "mini_batch_size"), 48)
    assert (
        p.read_text()
        == "data:\n  train: x.jsonl\nbatch:\n  per_device_train_batch_size: 64  # negatives\n  mini_batch_size: 48   # probe\n"
    )
    p.write_text("data:\n  train: x.jsonl\nbatch:\n    per_device_train_batch_size: 64\n")
    set_yaml_value(p, ("batch", "mini_batch_size"), 12)
    assert (
        p.read_text()
        == "data:\n  train: x.jsonl\nbatch:\n    mini_batch_size: 12\n    per_device_train_batch_size: 64\n"
    )
    p.write_text("data:\n  train: x.jsonl")
    set_yaml_value(p, ("batch", "mini_batch_size"), 7)
    assert p.read_text() == "data:\n  train: x.jsonl\nbatch:\n  mini_batch_size: 7\n"


def test_probe_cli_user_errors():
    r = CliRunner().invoke(app, ["probe-minibatch", "--model", "x", "--write"])
    assert r.exit_code == 2 and "--write: needs a config file" in r.output
    r = CliRunner().invoke(app, ["probe-minibatch", "--model", "x", "--precision", "fp8"])
    assert r.exit_code == 2 and "'--precision'" in r.output and "'bf16'" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["probe-minibatch", "--model", "x", "--max-memory", "lots"])
    assert r.exit_code == 2 and "--max-memory: cannot read 'lots'" in r.output


def test_truncation_report_counts_rows_over_max_seq_length(tiny_model_dir):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer

    tok = SentenceTransformer(str(tiny_model_dir), device="cpu").tokenizer
    # "the" is one token; with [CLS] and [SEP] a row of n words is n + 2 tokens
    ds = Dataset.from_dict({"anchor": ["the " * 6, "the " * 8, "the " * 9], "positive": ["the"] * 3})
    report = truncation_report(ds, tok, 10, {"anchor": "question", "positive": "answer"})
    assert [(c.column, c.source, c.rows, c.truncated, c.max_tokens) for c in report] == [
        ("anchor", "question", 3, 1, 11),
        ("positive", "answer", 3, 0, 3),
    ]
    assert report[0].fraction == pytest.approx(1 / 3)


def test_probe_asks_the_loss_whether_it_caches():
    from cembed.plan.resolve import Plan
    from cembed.probe.auto import resolve_auto, run_probe

    model_cfg = ModelConfig(name_or_path="x", device="cpu")
    with pytest.raises(UserError, match=r"loss\.name: probe-minibatch measures the cached loss; with 'mnrl' mini_"):
        run_probe(model_cfg, loss_config(name="mnrl"), 8)
    plan = Plan("cpu", 1, 8, 1, 8, 1e-5, "", "fp32")
    resolved, probe = resolve_auto(plan, model_cfg, loss_config(name="mnrl"), 2)
    assert probe is None and resolved.mini_batch_size == 8
    assert resolved.warnings[-1] == "batch.mini_batch_size: auto has no effect with loss mnrl"


def test_cuda_trial_falls_back_after_sticky_error(monkeypatch):
    """C5, simulated on CPU: a sticky CUDA error (illegal address) makes every later CUDA call raise,
    cleanup included. The trial checks the device's health before any cleanup, so the fallback to
    child processes on the same GPU (cuda:<index>, not GPU 0) is set up, the error still counts as
    "does not fit", and close() does not raise. (It used to call empty_cache() first: the cleanup's
    error replaced the CUDA one, no fallback was set up and close() raised.)"""
    import torch

    import cembed.probe.trials as pt

    poisoned = {"on": False}

    def cuda_call(*args, **kwargs):  # every CUDA call after the error raises it again
        if poisoned["on"]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (in cleanup)")

    def failing_step(*args, **kwargs):
        poisoned["on"] = True
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class FakeModel:
        def zero_grad(self, set_to_none=True):  # only drops references: no CUDA call
            pass

    children = []

    class FakeSubprocessTrial:
        def __init__(self, spec, **kwargs):
            self.spec = spec

        def __call__(self, size):
            children.append((self.spec.device, size))
            return pt.TrialOutcome(peak_bytes=size, samples_per_s=1.0)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "empty_cache", cuda_call)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", cuda_call)
    monkeypatch.setattr(pt, "cuda_healthy", lambda: not poisoned["on"])
    monkeypatch.setattr(pt, "_load", lambda spec: FakeModel())
    monkeypatch.setattr(pt, "_cuda_other_bytes", lambda: 0)
    monkeypatch.setattr(pt, "worst_case_step", failing_step)
    monkeypatch.setattr(pt, "SubprocessTrial", FakeSubprocessTrial)
    spec = pt.TrialSpec(model={}, loss={}, n_columns=2, batch_size=64, device="cuda")
    trial = pt.CudaTrial(spec)
    with pytest.raises(RuntimeError, match="illegal memory access") as err:
        trial(16)
    assert "cleanup" not in str(err.value) and pt.is_device_failure(err.value)  # counts as "does not fit"
    assert trial.poisoned and trial.fallback is not None
    assert trial(8).peak_bytes == 8 and children == [("cuda:1", 8)]
    trial.close()  # must not raise


def test_probe_counts_gathered_loss_stage(tiny_model_dir, monkeypatch):
    """C2/W2: a trial's loss stage is training's: fp32 scores outside autocast, over the world
    size's gathered candidates (anchor x W x batch x (1 + hard negatives)), simulated without a
    collective, with the length-sorted copies and restored-order leaves; resolve_auto gives the
    trial the plan's world size (when it gathers) and the config's columns."""
    import cembed.losses.registry as losses
    import cembed.probe.auto as probe
    from cembed.model.load import load_model
    from cembed.probe.trials import worst_case_step

    model = load_model(ModelConfig(name_or_path=str(tiny_model_dir), max_seq_length=16, device="cpu"), "cpu")
    seen, real_build = [], losses.build_loss

    def build(*args, **kwargs):
        built = real_build(*args, **kwargs)
        module, sim = built.module, built.module.loss.similarity_fct

        def recording(a, b):
            leaves = any(inv is not None for inv in module._inverse)
            seen.append((tuple(a.shape), tuple(b.shape), b.dtype, torch.is_autocast_enabled("cpu"), leaves))
            return sim(a, b)

        module.loss.similarity_fct = recording
        return built

    monkeypatch.setattr(losses, "build_loss", build)
    ran = worst_case_step(model, loss_config(), 3, 8, 4, "bf16", repeats=1, world_size=4)
    assert ran.samples_per_s > 0 and ran.rows == 4 and ran.tokens_per_row == 16
    assert seen, "the loss stage never scored"
    for a, b, dtype, autocast, leaves in seen:
        assert a == (4, 32) and b == (8 * 4 * 2, 32), (a, b)  # mini x (batch x W x (positive + 1 negative))
        assert dtype == torch.float32 and not autocast and leaves

    specs = []

    class Recorded:
        def __init__(self, spec, kill_above_bytes=None):
            specs.append(spec)

        def __call__(self, size, num_tokens=None):
            return TrialOutcome(peak_bytes=size, samples_per_s=float(size))

    monkeypatch.setattr(probe, "SubprocessTrial", Recorded)
    from cembed.plan.resolve import Plan

    plan = Plan("cpu", 8, 16, 1, 128, 1e-5, "", "fp32", gather_across_devices=True)
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), max_seq_length=16, device="cpu")
    plan2, result = probe.resolve_auto(plan, cfg, loss_config(), 3, "1GiB", sort_by_length=False)
    assert specs[0].world_size == 8 and specs[0].n_columns == 3 and specs[0].sort_by_length is False
    assert result.world_size == 8 and result.ranks[0]["recommended"] == result.recommended
    assert result.ranks[0]["peak_bytes"] == result.recommended  # this rank's peak at its answer
    assert plan2.mini_batch_probe["ranks"] == result.ranks
