#!/usr/bin/env python
"""The GPU check's stages (issue 14), each run in its own process by the orchestrator
(``scripts/gpu_check/__main__.py``): ``python scripts/gpu_check/stages.py --stage NAME --run-dir DIR``
reads ``DIR/context.json`` and writes ``DIR/NAME/result.json`` (``status`` pass/fail/skipped and the
stage's numbers).

The only module of the check that imports cembed (and torch, datasets, sentence-transformers), always
inside the stage functions; the orchestrator, ``bundle.py`` and ``sampler.py`` use the standard library
only (tests/scripts/test_gpu_check.py asserts it), since the GPU image lacks pydantic and datasets until the
bundle is installed. The stages import cembed by full module path from the interpreter's path: the
bundle's site folder, else this checkout (the orchestrator sets ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CUDA_ONLY = ("sticky", "fp16_skip", "gather")


def coco_rows(ctx: dict, n: int) -> dict[str, list[str]]:
    """``n`` (anchor, positive) rows of real COCO caption pairs, repeated when the file has fewer."""
    path = ctx.get("coco")
    if path is None:
        for candidate in (
            REPO.parent / "shared" / "data" / "coco_captions" / "caption_pairs_val2017.jsonl.gz",
            Path(__import__("cembed.samples").samples.__file__).parent / "coco_captions" / "train_pairs.jsonl.gz",
        ):
            if candidate.is_file():
                path = candidate
                break
    rows = {"anchor": [], "positive": []}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rows["anchor"].append(r["anchor"])
            rows["positive"].append(r["positive"])
    k = len(rows["anchor"])
    return {c: [v[i % k] for i in range(n)] for c, v in rows.items()}


def _features(batch: dict) -> list[dict]:
    out: dict[str, dict] = {}
    for key, value in batch.items():
        role, _, name = key.partition("_")
        out.setdefault(role, {})[name] = value
    return list(out.values())


def _to(features, device):
    return [{k: v.to(device) if hasattr(v, "to") else v for k, v in f.items()} for f in features]


def _autocast_forward(model, dtype):
    """Run ``model.forward`` under autocast with fp32 outputs, as accelerate wraps it in training."""
    import torch

    forward = model.forward

    def wrapped(*a, **k):
        with torch.autocast(model.device.type, dtype=dtype):
            out = forward(*a, **k)
        return {key: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for key, v in out.items()}

    model.forward = wrapped
    return lambda: setattr(model, "forward", forward)


def _grads(model):
    """Every parameter's gradient, flattened into one fp64 vector (the comparisons below sum over
    tens of millions of elements: fp32 sums drift by ~1e-3, and a cosine came out as 1.0022)."""
    import torch

    return torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


def cosine(a, b) -> float:
    """Cosine similarity of two flat tensors, accumulated in fp64 (fp32 over ~2e7 elements gives
    values above 1)."""
    a, b = a.double(), b.double()
    return float(a.dot(b) / (a.norm() * b.norm()).clamp_min(1e-300))


def rel_l2(a, b) -> float:
    """``|a - b| / |b|`` for two flat tensors, in fp64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# What the image is expected to provide (reported, never installed nor checked against pins).
IMAGE_PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "pyarrow",
    "numpy",
    "pandas",
    "tokenizers",
    "huggingface-hub",
    "safetensors",
    "xxhash",
    "typer",
    "rich",
    "pyyaml",
    "packaging",
)
IMPORTS = ("torch", "transformers", "pyarrow", "pydantic", "datasets", "sentence_transformers", "cembed.cli.app")


def _unmet(dist: str) -> list[str]:
    """``dist``'s requirements (no extras) that the environment does not meet, one line each."""
    from importlib import metadata

    from packaging.requirements import Requirement

    unmet = []
    for spec in metadata.requires(dist) or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{dist} needs {req}: not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{dist} needs {req}: {have} installed")
    return unmet


def stage_install(ctx: dict, work: Path) -> dict:
    """What the stages will run with, reported: every bundled and image package's version and where
    it comes from (``bundle``: the site folder the orchestrator installed the bundle's wheels into;
    else ``environment``), and the pins of the packages the bundle brings (cembed's own included)
    that the environment does not meet. Unmet pins are reported, never fatal (the image's own
    packages' pins are not checked at all): the stage fails only when one of ``IMPORTS`` fails."""
    import importlib
    from importlib import metadata

    from bundle import BUNDLE_PACKAGES

    site = str(Path(ctx["run_dir"]) / "site") if ctx.get("bundle_wheels_installed") else None
    names = [n.replace("_", "-") for n in BUNDLE_PACKAGES]
    versions, origin = {}, {}
    for dist in dict.fromkeys(names + list(IMAGE_PACKAGES)):
        try:
            found = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
            continue
        versions[dist] = found.version
        where = str(Path(str(found.locate_file(""))).resolve())
        origin[dist] = "bundle" if site and where.startswith(str(Path(site).resolve())) else "environment"
    brought = [d for d in names if origin.get(d) == "bundle"] if site else names
    unmet = [line for dist in brought if versions.get(dist) for line in _unmet(dist)]
    failed = {}
    for module in IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - reported, the stage fails
            failed[module] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    import cembed

    return {
        "status": "fail" if failed else "pass",
        "installed_from_bundle": bool(site),
        "versions": versions,
        "origin": origin,
        "unmet": unmet,
        "import_failed": failed,
        "cembed": cembed.__file__,
    }


def stage_env(ctx: dict, work: Path) -> dict:
    import torch

    from cembed.plan.precision import resolve_precision

    if not torch.cuda.is_available():
        if ctx["device"] != "cuda":
            return {"status": "pass", "device": "cpu", "torch": torch.__version__, "cpus": os.cpu_count()}
        return {"status": "fail", "error": "no CUDA device visible"}
    props = torch.cuda.get_device_properties(0)
    smi = shutil.which("nvidia-smi")
    driver = (
        subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
        if smi
        else None
    )
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None
    resolved = resolve_precision("auto", "cuda")
    return {
        "status": "pass",
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver,
        "dev_shm_gib": round(shm / 2**30, 1) if shm else None,
        "cpus": os.cpu_count(),
        "precision_auto": resolved._asdict(),
    }


def stage_correctness(ctx: dict, work: Path) -> dict:
    """(a) On 64 COCO pairs at 64 tokens (with ``--quick``: 16 pairs at 32 tokens), mini-batches of a quarter of them: fp32 cached == fp32 plain (TF32 off); bf16 cached
    (model forward under autocast, TF32 on) vs fp32 plain; dropout replay (RandContext) bit-exact,
    with a negative control that differs."""
    import torch
    from sentence_transformers.base.losses.gradcache import RandContext
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from cembed.config.loss import loss_config
    from cembed.config.schema import ModelConfig
    from cembed.losses.registry import build_loss
    from cembed.model.load import load_model
    from cembed.plan.precision import enable_tf32

    dev = ctx["device"]
    n, seq = (min(16, ctx["batch"]), min(32, ctx["seq"])) if ctx.get("quick") else (64, 64)
    model = load_model(ModelConfig(name_or_path=ctx["model"], max_seq_length=seq, device=dev), dev)
    rows = coco_rows(ctx, n)
    collate = SentenceTransformerDataCollator(preprocess_fn=model.preprocess)
    feats = _to(
        _features(collate([{"anchor": a, "positive": p} for a, p in zip(rows["anchor"], rows["positive"])])), dev
    )

    def run(loss):
        model.zero_grad(set_to_none=True)
        value = loss(feats, None)
        value.backward()
        return float(value.detach()), _grads(model)

    model.eval()  # dropout off: every path sees the same function
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    plain_loss, plain_grad = run(MultipleNegativesRankingLoss(model))
    cached = build_loss(model, loss_config(), max(1, n // 4)).module
    fp32_loss, fp32_grad = run(cached)
    enable_tf32()
    restore = _autocast_forward(model, torch.bfloat16)
    bf16_loss, bf16_grad = run(cached)
    restore()

    checks = {
        "fp32_cached_vs_plain": {
            "loss_rel": abs(fp32_loss - plain_loss) / abs(plain_loss),
            "grad_rel_l2": rel_l2(fp32_grad, plain_grad),
        },
        "bf16_cached_vs_fp32_plain": {
            "loss": [bf16_loss, plain_loss],
            "loss_rel": abs(bf16_loss - plain_loss) / abs(plain_loss),
            "grad_rel_l2": rel_l2(bf16_grad, plain_grad),
            "grad_cosine": cosine(bf16_grad, plain_grad),
            "grad_elements": bf16_grad.numel(),
        },
    }
    model.train()  # dropout 0.1 on: the replayed forward must see the first forward's masks
    replay = {}
    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        restore = _autocast_forward(model, dtype) if dtype else (lambda: None)
        f = {k: v[: max(1, n // 4)] if hasattr(v, "to") else v for k, v in feats[1].items()}
        ctx_rng = RandContext(*f.values())
        with torch.no_grad():
            first = model(f)["sentence_embedding"]
        with ctx_rng:
            replayed = model(f)["sentence_embedding"]
        control = model(f)["sentence_embedding"]  # fresh dropout masks
        restore()
        replay[label] = {
            "replay_max_abs_diff": float((first - replayed.detach()).abs().max()),
            "control_max_abs_diff": float((first - control.detach()).abs().max()),
        }
    checks["dropout_replay"] = replay
    ok = (
        checks["fp32_cached_vs_plain"]["loss_rel"] <= 1e-5
        and checks["fp32_cached_vs_plain"]["grad_rel_l2"] <= 1e-4
        and checks["bf16_cached_vs_fp32_plain"]["loss_rel"] <= 2e-2
        and checks["bf16_cached_vs_fp32_plain"]["grad_cosine"] >= 0.99
        and all(r["replay_max_abs_diff"] == 0.0 and r["control_max_abs_diff"] > 0 for r in replay.values())
    )
    return {"status": "pass" if ok else "fail", "rows": n, "seq": seq, "checks": checks}


def stage_sticky(ctx: dict, work: Path) -> dict:
    import torch

    from cembed.probe.trials import CudaTrial, TrialSpec, cuda_healthy

    trial = CudaTrial(TrialSpec(model={}, loss={}, n_columns=2, batch_size=8, device="cuda"))
    x = torch.zeros(4, device="cuda")
    error = None
    try:
        x[torch.tensor([10], device="cuda")] = 1.0  # a device-side assert: sticky
        torch.cuda.synchronize()
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    try:
        torch.cuda.empty_cache()
        raised = False
    except Exception:
        raised = True
    healthy = cuda_healthy()
    trial.poisoned = not healthy
    trial.close()  # must not raise
    return {
        "status": "pass" if error and not healthy else "fail",
        "error": error,
        "empty_cache_raised": raised,
        "cuda_healthy": healthy,
    }


def run_display():
    """What ``cembed train`` prints for a run (probe, header, components), without the progress bar."""
    from cembed.cli.common import make_console
    from cembed.cli.display.run import RichRunDisplay

    return RichRunDisplay(make_console(), progress=False)


def stage_fp16_skip(ctx: dict, work: Path) -> dict:
    from conftest import make_tiny_model

    import cembed.train.recipe as T
    from cembed.config.file import config_from_dict

    model = make_tiny_model(work / "tiny")
    rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(64)]
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    real, calls = T.build_loss, {"n": 0}

    def build(*a, **k):
        built = real(*a, **k)
        fwd = built.module.forward

        def patched(f, labels):
            calls["n"] += 1
            v = fwd(f, labels)
            return v * float("nan") if calls["n"] == 2 else v

        built.module.forward = patched
        return built

    T.build_loss = build
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(model), "device": "cuda", "precision": "fp16"},
            "data": {"train": str(work / "pairs.jsonl"), "pretokenize": False},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"max_steps": 4, "logging_steps": 1, "output_dir": str(work / "out"), "nonfinite_loss": "skip"},
        },
        base=work,
    )
    plan, data = T.check_run_inputs(cfg)
    s = T.run_training(cfg, plan, data, run_display())
    ok = s["status"] == "completed" and s["steps"] == 4 and s["nonfinite_steps_skipped"] == 1
    return {"status": "pass" if ok else "fail", "steps": s["steps"], "skipped": s["nonfinite_steps_skipped"]}


def stage_gather(ctx: dict, work: Path) -> dict:
    from conftest import make_tiny_model

    from cembed.config.loss import loss_config
    from cembed.config.schema import ModelConfig
    from cembed.probe.trials import CudaTrial, TrialSpec

    m = make_tiny_model(work / "tiny")
    mc = ModelConfig(name_or_path=str(m), max_seq_length=32, device="cuda", precision="bf16").model_dump()
    peaks = {}
    for w in (1, 8):
        spec = TrialSpec(
            model=mc,
            loss=loss_config().model_dump(),
            n_columns=3,
            batch_size=4096,
            device="cuda",
            world_size=w,
            precision="bf16",
        )
        t = CudaTrial(spec)
        peaks[w] = t(1024).peak_bytes
        t.close()
    ok = peaks[8] > peaks[1] + 2**30  # ~6 fp32 chunk matrices of 1024 x 98304 more
    return {"status": "pass" if ok else "fail", "peak_gib": {w: round(b / 2**30, 3) for w, b in peaks.items()}}


def stage_probe(ctx: dict, work: Path) -> dict:
    from cembed.config.loss import loss_config
    from cembed.config.schema import ModelConfig
    from cembed.probe.auto import run_probe

    dev = ctx["device"]
    mc = ModelConfig(name_or_path=ctx["model"], max_seq_length=ctx["seq"], device=dev)
    started = time.perf_counter()
    result = run_probe(mc, loss_config(), ctx["batch"], 2, dev, max_memory=None if dev == "cuda" else 4 * 2**30)
    d = result.to_dict()
    d["seconds"] = round(time.perf_counter() - started, 1)
    (work / "probe.json").write_text(json.dumps(d, indent=1))
    return {"status": "pass" if result.recommended >= 1 else "fail", "probe": d}


def _mini_batch(ctx: dict) -> int:
    """The probe stage's recommendation (same run), else 2048 (at most the batch); with ``--quick``
    at most a quarter of the batch, so the small CPU run still caches over several mini-batches."""
    probe = Path(ctx["run_dir"]) / "probe" / "probe.json"
    mini = json.loads(probe.read_text())["recommended"] if probe.is_file() else min(2048, ctx["batch"])
    return min(mini, max(1, ctx["batch"] // 4)) if ctx.get("quick") else mini


def _coco_run_config(ctx: dict, work: Path, train: str, mini: int, steps: int):
    """The training config of (c) and of the estimate stage: the check's model, sizes and device,
    ``train`` as the data, no-duplicates off (repeated COCO pairs), no warmup, a log line per step."""
    from cembed.config.file import config_from_dict

    return config_from_dict(
        {
            "model": {"name_or_path": ctx["model"], "max_seq_length": ctx["seq"], "device": ctx["device"]},
            "data": {"train": train, "cache_dir": ctx["cache_dir"]},
            "batch": {"per_device_train_batch_size": ctx["batch"], "mini_batch_size": mini},
            "sampler": {"no_duplicates": False},
            "optim": {"warmup_ratio": 0.0},
            "train": {"max_steps": steps, "logging_steps": 1, "output_dir": str(work / "out")},
        },
        base=work,
    )


def stage_train(ctx: dict, work: Path) -> dict:
    """(c) ``run_training`` at batch 65536 on COCO pairs (repeated to fill the steps; the
    no-duplicates sampler is off since 50k pairs cannot fill a duplicate-free batch of 65536)."""
    from datasets import Dataset

    from cembed.data.rows import TrainingData
    from cembed.plan.resolve import resolve_plan
    from cembed.train.recipe import run_training

    b, steps = ctx["batch"], ctx["steps"]
    mini = _mini_batch(ctx)
    rows = coco_rows(ctx, b * steps)
    data = TrainingData(Dataset.from_dict(rows), source="coco", rows_read=b * steps, roles={c: c for c in rows})
    cfg = _coco_run_config(ctx, work, "coco.jsonl", mini, steps)
    plan = resolve_plan(cfg)
    summary = run_training(cfg, plan, data, run_display())
    saved = json.loads((work / "out" / "run_summary.json").read_text())
    history = saved.get("throughput_per_interval") or []
    steady = history[1:] or history  # the first step includes warm-up (allocator, kernels)

    def mean(key):
        vals = [h[key] for h in steady if isinstance(h.get(key), (int, float))]
        return round(statistics.fmean(vals), 4) if vals else None

    extra = sorted({k for h in history for k in h if any(t in k.lower() for t in ("mfu", "flop"))})
    out = {
        "mini_batch_size": mini,
        "precision": saved.get("precision") or saved.get("plan", {}).get("precision"),
        "steps": summary["steps"],
        "wall_time_s": summary["wall_time_s"],
        "samples_per_s": summary["samples_per_s"],
        "tokens_per_s_after_step1": mean("tokens_per_s"),
        "data_wait_after_step1": mean("data_wait"),
        "padded_share": mean("padded_share"),
        **{f"{k}_after_step1": mean(k) for k in extra},
        "totals": saved.get("throughput"),
        "per_interval": history,
        "loss": [summary["first_loss"], summary["last_loss"]],
    }
    ok = summary["status"] == "completed" and summary["steps"] == steps
    return {"status": "pass" if ok else "fail", "throughput": out}


CALIBRATION_BAR = 0.15  # issue 26: --calibrate predicts the real run's wall time within 15 %


def stage_estimate(ctx: dict, work: Path) -> dict:
    """Issue 26 item 2 on this device: ``cembed estimate --calibrate 2`` (a few real steps through
    the training path, the measured FLOP/s) predicts the wall time of the same config's training run
    (twice the check's steps, COCO pairs written as a file, no-duplicates off as in (c)); the stage
    passes when the prediction is within 15 % of the run's ``wall_time_s``. With ``--quick`` the
    steps are too short to time (a few hundred ms on a shared CPU): the error is reported, not judged;
    ``scripts/bench_estimate.py`` is the CPU check."""
    from cembed.cli.commands.estimate import build_estimate
    from cembed.train.recipe import check_run_inputs, run_training

    b, steps = ctx["batch"], 2 * ctx["steps"]
    rows = coco_rows(ctx, b * steps)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in zip(*rows.values())))
    cfg = _coco_run_config(ctx, work, str(data), _mini_batch(ctx), steps)
    report = build_estimate(cfg, None, None, None, 2)
    plan, prepared = check_run_inputs(cfg)
    summary = run_training(cfg, plan, prepared, run_display())
    predicted, measured = report["run_seconds"]["value"], summary["wall_time_s"]
    error = predicted / measured - 1 if measured else None
    judged = not ctx.get("quick")
    ok = summary["status"] == "completed" and error is not None and (not judged or abs(error) <= CALIBRATION_BAR)
    return {
        "status": "pass" if ok else "fail",
        "estimate": {
            "steps": steps,
            "predicted_s": round(predicted, 2),
            "measured_s": round(measured, 2),
            "error": round(error, 3) if error is not None else None,
            "bar": CALIBRATION_BAR if judged else "reported only (--quick)",
            "rate": report["rate"]["flops_per_s_per_device"],
        },
    }


class EncoderCalls:
    """Records what the encoder (the transformers model inside the first module) ran on, forward by
    forward: packed rows (per-row ``position_ids`` with a block-diagonal 4-D mask, as cembed packs, or
    no mask, as sentence-transformers' flash-attention unpadding flattens) or padded rows (a 2-D
    mask). Read off the encoder's own inputs, so it reports the path taken, not the one configured.
    The encoder's ``forward`` is wrapped on the instance (sentence-transformers calls
    ``model.forward`` directly, so forward hooks never fire)."""

    def __init__(self, model):
        self.encoder = model[0].auto_model
        self.calls = self.packed = self.real_tokens = self.slots = 0

    def _seen(self, args, kwargs):
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        self.calls += 1
        if positions is not None and (mask is None or mask.ndim == 4):
            self.packed += 1
        elif mask is not None and mask.ndim == 2:
            self.real_tokens += int(mask.sum())
            self.slots += int(mask.numel())

    def __enter__(self):
        self.calls = self.packed = self.real_tokens = self.slots = 0
        forward = self.encoder.forward

        def observed(*args, **kwargs):
            self._seen(args, kwargs)
            return forward(*args, **kwargs)

        self.encoder.forward = observed
        return self

    def __exit__(self, *exc):
        del self.encoder.forward  # back to the class's forward

    def summary(self) -> dict:
        """``{"encoder_calls", "packed_calls", "ran": "packed"|"padded"|"mixed"|"none"}`` and, when
        some calls were padded, the padded share of their token slots."""
        if not self.calls:
            ran = "none"
        else:
            ran = "packed" if self.packed == self.calls else "padded" if self.packed == 0 else "mixed"
        out = {"encoder_calls": self.calls, "packed_calls": self.packed, "ran": ran}
        if self.slots:
            out["padded_share"] = round(1 - self.real_tokens / self.slots, 4)
        return out


def _time_sides(model, sides: dict, rounds: int, sync, paths: dict) -> tuple[dict, dict]:
    """Run each side's loss forward + backward ``rounds`` times, alternating (the first round is a
    warm-up); record in ``paths[side]`` what its encoder ran (:class:`EncoderCalls`).

    Returns:
        ``(median step seconds, last loss)`` per side.
    """
    times, losses = {k: [] for k in sides}, {}
    for r in range(rounds):
        for label, (loss, feats) in sides.items():
            model.zero_grad(set_to_none=True)
            sync()
            with EncoderCalls(model) as calls:
                t0 = time.perf_counter()
                value = loss(feats, None)
                value.backward()
                sync()
                elapsed = time.perf_counter() - t0
            if r > 0:
                times[label].append(elapsed)
            losses[label] = float(value.detach())
            paths[label].update(calls.summary())
    return {k: statistics.median(v) for k, v in times.items()}, losses


def stage_stock(ctx: dict, work: Path) -> dict:
    """(d) One batch of ``batch`` COCO rows through stock sentence-transformers (its tokenizing
    collator, ``CachedMultipleNegativesRankingLoss``) and through cembed (pre-tokenized ids, the
    padding collator, the length-sorted cached loss), same model, precision and mini-batch size;
    1 warm-up and 2 timed steps each (1 with ``--quick``; forward + backward, synchronized). Both losses are built on
    the plain fp32 model before the forward is wrapped in autocast, as training builds its loss
    before accelerate wraps the forward (cembed's packing check run under bf16 autocast would fail
    its fp32 tolerance and fall back to padding). ``paths`` records, per side, the attention path
    it was configured for and the one its encoder's forwards actually took (:class:`EncoderCalls`)."""
    import torch
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from cembed.config.loss import loss_config
    from cembed.config.schema import ModelConfig
    from cembed.data.tokens.collator import collator_for
    from cembed.data.tokens.tokenize import pretokenize
    from cembed.losses.registry import build_loss
    from cembed.model.load import load_model
    from cembed.plan.precision import autocast_dtype, enable_tf32, resolve_precision

    b, mini, dev = ctx["batch"], _mini_batch(ctx), ctx["device"]
    model = load_model(ModelConfig(name_or_path=ctx["model"], max_seq_length=ctx["seq"], device=dev), dev)
    model.eval()  # dropout off: both paths compute the same loss
    precision = resolve_precision(ctx.get("precision", "auto"), dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    first = model[0]
    built = build_loss(model, loss_config(), mini)  # on the fp32 forward, before autocast (see above)
    stock_loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini)
    paths = {
        "stock": {
            "configured": "flattened rows, no padding (flash-attention varlen)"
            if getattr(first, "can_flatten_inputs", False)
            else "padded mini-batches",
            "attn_implementation": getattr(first.auto_model.config, "_attn_implementation", None),
            "unpad_inputs": getattr(first, "unpad_inputs", None),
        },
        "cembed": {"configured": built.unpadding.description, "enabled": built.unpadding.enabled},
    }
    if precision.tf32:
        enable_tf32()
    dtype = autocast_dtype(precision.precision)
    if dtype is not None:
        _autocast_forward(model, dtype)
    rows = coco_rows(ctx, b)
    records = [{"anchor": a, "positive": p} for a, p in zip(rows["anchor"], rows["positive"])]
    t0 = time.perf_counter()
    stock_feats = _to(_features(SentenceTransformerDataCollator(preprocess_fn=model.preprocess)(records)), dev)
    stock_collate = time.perf_counter() - t0
    ds = pretokenize(
        Dataset.from_dict(rows), ["anchor", "positive"], model.tokenizer, model.max_seq_length, ctx["cache_dir"]
    ).dataset
    t0 = time.perf_counter()
    ours_feats = _to(_features(collator_for(model, ["anchor", "positive"])(ds.select(range(b)).to_list())), dev)
    ours_collate = time.perf_counter() - t0
    sides = {"stock": (stock_loss, stock_feats), "cembed": (built.module, ours_feats)}
    step, losses = _time_sides(model, sides, 2 if ctx.get("quick") else 3, sync, paths)
    real = sum(int(f["attention_mask"].sum()) for f in ours_feats)
    comparison = {
        "batch": b,
        "mini_batch_size": mini,
        "precision": precision.precision,
        "stock_step_s": round(step["stock"], 3),
        "cembed_step_s": round(step["cembed"], 3),
        "speedup": round(step["stock"] / step["cembed"], 3),
        "stock_collate_s": round(stock_collate, 3),
        "cembed_collate_s": round(ours_collate, 3),
        "cembed_tokens_per_s_step_only": round(real / step["cembed"], 1),
        "stock_padded_share": round(1 - real / sum(f["attention_mask"].numel() for f in stock_feats), 4),
        "loss": losses,
        "loss_rel": abs(losses["stock"] - losses["cembed"]) / abs(losses["stock"]),
    }
    # each side ran the path it was configured for, and cembed packs this model (full attention, sdpa)
    expected = {
        "stock": "packed" if getattr(first, "can_flatten_inputs", False) else "padded",
        "cembed": "packed" if built.unpadding.enabled else "padded",
    }
    for k in paths:
        paths[k]["as_configured"] = paths[k]["ran"] == expected[k]
    ok = comparison["loss_rel"] <= 2e-2 and all(p["as_configured"] for p in paths.values()) and built.unpadding.enabled
    return {"status": "pass" if ok else "fail", "comparison": comparison, "paths": paths}


# --- late interaction: the cached MaxSim loss, tiled vs fused kernel vs stock (issue 40) -------------

MAXSIM_SIZES = {
    # loss level: COCO rows, mini-batch, tokens per text, the token dimension; op level: queries x documents
    # of random unit token vectors (lengths up to q_len / d_len), scored by InfoNCE alone
    "full": {"rows": 512, "mini": 64, "seq": 64, "dim": 128, "op_rows": 4096, "q_len": 32, "d_len": 128},
    "quick": {"rows": 8, "mini": 4, "seq": 32, "dim": 32, "op_rows": 32, "q_len": 8, "d_len": 24},
}


def _timed(fn, sync, rounds: int) -> tuple[float, object]:
    """The median seconds of ``rounds`` calls of ``fn`` after one warm-up, and its last result."""
    out, times = fn(), []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _peak_bytes(fn, dev: str):
    """``(result, peak CUDA bytes allocated above what was allocated before)`` of ``fn()``; None on CPU."""
    import torch

    if dev != "cuda":
        return fn(), None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def maxsim_op_level(size: dict, dev: str, kernel, rounds: int) -> dict:
    """InfoNCE over MaxSim alone (no encoder) on random unit token vectors, per dtype (fp32, bf16): the
    tiled path's and (with ``kernel``) the fused kernel's step (forward + backward) seconds and peak
    memory, and the kernel's agreement with the tiled path on the whole batch."""
    import torch
    import torch.nn.functional as F

    from cembed.model.maxsim import RaggedTokens, maxsim_infonce
    from cembed.model.maxsim_kernel import check_agreement

    g = torch.Generator().manual_seed(0)
    n = size["op_rows"]
    q_lengths = torch.randint(1, size["q_len"] + 1, (n,), generator=g).tolist()
    d_lengths = torch.randint(1, size["d_len"] + 1, (n,), generator=g).tolist()
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    labels = torch.arange(n, device=dev)
    out = {"queries": n, "documents": n, "query_tokens": sum(q_lengths), "document_tokens": sum(d_lengths)}
    for dtype in (torch.float32, torch.bfloat16):
        q = F.normalize(torch.randn(sum(q_lengths), size["dim"], generator=g), dim=-1).to(dev, dtype)
        d = F.normalize(torch.randn(sum(d_lengths), size["dim"], generator=g), dim=-1).to(dev, dtype)
        queries, documents = RaggedTokens.from_lengths(q, q_lengths), RaggedTokens.from_lengths(d, d_lengths)

        def step(k, queries=queries, documents=documents):
            qv, dv = queries.values.detach().requires_grad_(), documents.values.detach().requires_grad_()
            loss = maxsim_infonce(
                RaggedTokens(qv, queries.offsets), RaggedTokens(dv, documents.offsets), labels, kernel=k
            )
            loss.backward()
            return float(loss)

        row = {}
        for label, k in (("tiled", None), ("fused", kernel)):
            if label == "fused" and kernel is None:
                continue
            seconds, _ = _timed(lambda k=k: step(k), sync, rounds)
            _, peak = _peak_bytes(lambda k=k: step(k), dev)
            row[label] = {"step_s": round(seconds, 4), "peak_bytes": peak}
        if kernel is not None:
            agreement = check_agreement(kernel, queries, documents, labels, check_queries=n, check_documents=n)
            row["agreement"] = {"ok": agreement.ok, "loss_rel": agreement.loss_rel, "grad_rel": agreement.gradient_rel}
            row["speedup"] = round(row["tiled"]["step_s"] / row["fused"]["step_s"], 3)
        out[str(dtype).replace("torch.", "")] = row
    return out


def stage_maxsim(ctx: dict, work: Path) -> dict:
    """Issue 40: the cached MaxSim loss of a multi-vector model (all-MiniLM-L6-v2 turned into a ColBERT model,
    a ``dim``-dimensional projection) on the device, on one batch of COCO pairs, fp32, dropout off, TF32 off:
    stock sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss``, cembed's ``cached_maxsim``
    on the tiled path (``loss.score_kernel: tiled``) and with ``auto`` (the fused kernel of
    late-interaction-kernels where it imports on CUDA and agrees on the first batch): each side's loss and
    parameter gradients against stock's, step seconds, the path ``auto`` chose and its note; then MaxSim alone
    on random token vectors (:func:`maxsim_op_level`). Passes when the tiled path equals stock (loss 1e-5,
    gradient 1e-4 relative L2), and, where the kernel is found, when ``auto`` chose it and it is within its
    tolerance of stock (loss 1e-3, gradient 2e-2); fails where the package is installed but its kernel
    cannot be found on CUDA."""
    from importlib import metadata

    import torch
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    from cembed.config.loss import loss_config
    from cembed.config.model import model_config
    from cembed.losses.registry import build_loss
    from cembed.model.load import load_model
    from cembed.model.maxsim_kernel import GRADIENT_TOLERANCE, LOSS_TOLERANCE, PACKAGE, find_fused_maxsim

    size = MAXSIM_SIZES["quick" if ctx.get("quick") else "full"]
    dev, rounds = ctx["device"], 1 if ctx.get("quick") else 3
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 equivalence (the kernel computes in half anyway)
    torch.backends.cudnn.allow_tf32 = False
    cfg = model_config(kind="multi_vector", name_or_path=ctx["model"], dim=size["dim"], max_seq_length=size["seq"])
    model = load_model(cfg, dev, seed=0).eval()
    rows = coco_rows(ctx, size["rows"])
    feats = [
        _to([model.preprocess(rows["anchor"], task="query")], dev)[0],
        _to([model.preprocess(rows["positive"], task="document")], dev)[0],
    ]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    kernel, why = find_fused_maxsim(dev)
    try:
        installed = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        installed = None

    def run(loss):
        model.zero_grad(set_to_none=True)
        value = loss([dict(f) for f in feats], None)
        value.backward()
        return value.detach().double(), _grads(model)

    sides = {"stock": CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=size["mini"])}
    built = {}
    for setting in ("tiled", "auto"):
        built[setting] = build_loss(model, loss_config(name="cached_maxsim", score_kernel=setting), size["mini"])
        sides[setting] = built[setting].module
    results = {}
    for label, loss in sides.items():
        seconds, (value, grad) = _timed(lambda loss=loss: run(loss), sync, rounds)
        results[label] = {"step_s": round(seconds, 4), "loss": float(value), "grad": grad}
    stock = results.pop("stock")
    comparison = {"stock": {"step_s": stock["step_s"], "loss": stock["loss"]}}
    for label, r in results.items():
        comparison[label] = {
            "step_s": r["step_s"],
            "loss": r["loss"],
            "loss_rel": abs(r["loss"] - stock["loss"]) / abs(stock["loss"]),
            "grad_rel_l2": rel_l2(r.pop("grad"), stock["grad"]),
        }
    scoring = built["auto"].cached_module.scoring
    comparison["auto"] |= {"path": scoring.path, "note": scoring.note}
    kernel_found = {"found": kernel is not None, "installed": installed, "why_not": why or None}
    op_level = maxsim_op_level(size, dev, kernel, rounds)
    tiled, auto = comparison["tiled"], comparison["auto"]
    ok = tiled["loss_rel"] <= 1e-5 and tiled["grad_rel_l2"] <= 1e-4
    if kernel is not None:
        ok = ok and scoring.kernel is not None and auto["loss_rel"] <= LOSS_TOLERANCE
        ok = ok and auto["grad_rel_l2"] <= GRADIENT_TOLERANCE
    elif dev == "cuda" and installed:
        ok = False  # installed, but its kernel cannot be used here: say so by failing
    return {"status": "pass" if ok else "fail", "kernel": kernel_found, "loss": comparison, "op_level": op_level}


# --- attention implementations: packed vs each row alone, packed vs padded (issue 34) ---------------

# label -> (attn_implementation, the flex kernel compiled): transformers compiles flex_attention's
# kernel itself (torch.compile, on its first call); "not compiled" runs torch's unfused reference.
ATTENTION_VARIANTS = {
    "sdpa": ("sdpa", None),
    "eager": ("eager", None),
    "flash_attention_2": ("flash_attention_2", None),
    "flash_attention_3": ("flash_attention_3", None),
    "flex_attention (kernel not compiled)": ("flex_attention", False),
    "flex_attention (kernel compiled)": ("flex_attention", True),  # last: its compile may take minutes
}
FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
# Sizes: rows of the skewed set per column, mini-batch, max_seq_length, rounds (the first a warm-up),
# and the stage's own soft limit (s): a variant other than sdpa that would start after it is recorded
# as not run (--quick: sdpa, the variant judged, and what fits in a few seconds more).
ATTENTION_SIZES = {
    "full": {"rows": 2048, "mini": 256, "seq": 256, "rounds": 3, "soft_s": 100.0},
    "quick": {"rows": 16, "mini": 4, "seq": 32, "rounds": 2, "soft_s": 6.0},
}
TOY_DECODER = {"hidden": 32, "layers": 1, "heads": 4, "kv_heads": 2, "intermediate": 64}


def _bench_throughput():
    """scripts/bench_throughput.py (its skewed set and its decoder), imported from this checkout."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import bench_throughput

    return bench_throughput


def attention_variant_obstacle(label: str, device: str, quick: bool) -> str | None:
    """Why the variant ``label`` is not run here (None: it is): flash attention without its package
    or a GPU; flex attention on a CPU with ``--quick`` (inductor's CPU compiles take minutes and
    fail for some shapes, tests/model/test_packed_models.py; torch 2.13 has no flex backward on CPU)."""
    import importlib.util

    impl, compiled = ATTENTION_VARIANTS[label]
    if impl in FLASH_MODULES:
        if device != "cuda":
            return "CUDA only"
        if importlib.util.find_spec(FLASH_MODULES[impl]) is None:
            return f"{FLASH_MODULES[impl]} is not importable"
    if impl == "flex_attention" and device != "cuda" and quick:
        # measured: the not-compiled kernel's mask compile took 51 s, then its backward raised
        return "not with --quick on CPU: its compiles take minutes, and flex attention has no CPU backward"
    return None


class _FlexKernel:
    """Within the block, transformers' flex attention runs torch's ``flex_attention`` as is (not
    compiled) when ``compiled`` is False; True or None changes nothing."""

    def __init__(self, compiled: bool | None):
        self.compiled = compiled

    def __enter__(self):
        if self.compiled is False:
            from torch.nn.attention.flex_attention import flex_attention
            from transformers.integrations import flex_attention as integration

            self.integration, self.saved = integration, integration.compile_friendly_flex_attention
            integration.compile_friendly_flex_attention = lambda q, k, v, training=False, **kw: flex_attention(
                q, k, v, **kw
            )
        return self

    def __exit__(self, *exc):
        if self.compiled is False:
            self.integration.compile_friendly_flex_attention = self.saved


def packed_vs_alone(model, unpadding, texts: list[str]) -> float:
    """The largest relative L2 difference between a row's sentence embedding packed (about a third
    of ``texts`` per pack) and the row embedded alone; fp32, TF32 off, no autograd."""
    import torch

    from cembed.model.packing import plan_packing
    from cembed.model.unpad import packed_encoder

    device = next(model.parameters()).device
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    features = {k: v.to(device) if hasattr(v, "to") else v for k, v in model.preprocess(texts).items()}
    lengths = features["attention_mask"].sum(1).tolist()
    with torch.no_grad():
        alone = torch.cat(
            [
                model({k: v[i : i + 1, :n] if torch.is_tensor(v) else v for k, v in features.items()})[
                    "sentence_embedding"
                ]
                for i, n in enumerate(lengths)
            ]
        )
        plan = plan_packing(lengths, 0.0, device, capacity=max(max(lengths), sum(lengths) // 3))
        with packed_encoder(model, plan, unpadding):
            packed = model(dict(features))["sentence_embedding"]
    return float(((packed - alone).norm(dim=1) / alone.norm(dim=1).clamp_min(1e-12)).max())


def attention_case(load, label: str, rows: dict, size: dict, ctx: dict, out: dict) -> None:
    """One model under one attention variant, into ``out`` as it goes (a failure keeps what came
    before it): cembed's packing decision (its description), the packed-vs-alone difference when it
    packs, and the cached loss's step (forward + backward, the stage's precision) padded and packed on
    the same rows, with what each side's encoder ran."""
    import torch
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

    from cembed.losses.mnrl import LengthSortedCachedMNRL
    from cembed.model.unpad import resolve_unpad
    from cembed.plan.precision import autocast_dtype, enable_tf32, resolve_precision

    impl, compiled = ATTENTION_VARIANTS[label]
    dev = ctx["device"]
    with _FlexKernel(compiled):
        model = load(impl)
        model.eval()  # dropout off (flex attention refuses it): both sides compute the same loss
        unpadding = resolve_unpad(model, "auto")
        out.update({"attn_implementation": impl, "packing": unpadding.description, "packs": unpadding.enabled})
        texts = rows["positive"][:8] + rows["anchor"][:6]
        if unpadding.enabled:
            out["packed_vs_alone_max_rel"] = packed_vs_alone(model, unpadding, texts)
        sides = {"padded": LengthSortedCachedMNRL(model, mini_batch_size=size["mini"], unpad=False)}
        if unpadding.enabled:  # built on the fp32 forward, before autocast (see stage_stock)
            sides["packed"] = LengthSortedCachedMNRL(model, mini_batch_size=size["mini"], unpad=True)
        precision = resolve_precision(ctx.get("precision", "auto"), dev)
        if precision.tf32:
            enable_tf32()
        dtype = autocast_dtype(precision.precision)
        if dtype is not None:
            _autocast_forward(model, dtype)
        records = [{"anchor": a, "positive": p} for a, p in zip(rows["anchor"], rows["positive"])]
        feats = _to(_features(SentenceTransformerDataCollator(preprocess_fn=model.preprocess)(records)), dev)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        paths = {k: {} for k in sides}
        step, losses = _time_sides(model, {k: (loss, feats) for k, loss in sides.items()}, size["rounds"], sync, paths)
    out.update({f"{k}_step_s": round(v, 4) for k, v in step.items()})
    out["ran"] = {k: p["ran"] for k, p in paths.items()}
    out["precision"] = precision.precision
    if "packed" in step:
        out["packed_speedup"] = round(step["padded"] / step["packed"], 3)
        out["loss_rel"] = abs(losses["packed"] - losses["padded"]) / abs(losses["padded"])


def fastest(cases: dict) -> dict | None:
    """The quickest step among one model's ``cases`` (variant -> result): its variant, path and seconds."""
    timed = [
        (case[f"{side}_step_s"], label, side)
        for label, case in cases.items()
        for side in ("padded", "packed")
        if f"{side}_step_s" in case
    ]
    if not timed:
        return None
    seconds, label, side = min(timed)
    return {"variant": label, "path": side, "step_s": seconds}


def _sdpa_ok(case: dict | None) -> bool:
    # cembed packs under sdpa, the packed rows equal the rows alone, and the loss agrees (the stage's
    # precision: bf16 autocast on a GPU, 2e-2 as in stage_stock), each side running its path
    return bool(
        case
        and case.get("packs")
        and case.get("packed_vs_alone_max_rel", 1.0) <= 1e-4
        and case.get("loss_rel", 1.0) <= 2e-2
        and case.get("ran") == {"padded": "padded", "packed": "packed"}
    )


def attention_models(ctx: dict, work: Path, seq: int) -> dict:
    """``name -> load(attn_implementation)`` for the check's model (all-MiniLM-L6-v2) and the small
    Qwen2 decoder of scripts/bench_throughput.py (a toy one with ``--quick``), both as cembed loads
    them for training; the decoder's checkpoint is written once under ``work``."""
    from cembed.config.schema import ModelConfig
    from cembed.model.load import load_model, resolve_model_path

    bench = _bench_throughput()
    dev = ctx["device"]
    folder = work / "decoder"
    if not folder.exists():
        size = TOY_DECODER if ctx.get("quick") else bench.DECODER_SIZE
        bench.decoder_checkpoint(folder, resolve_model_path(ctx["model"]), **size)

    def minilm(impl):
        cfg = ModelConfig(
            name_or_path=ctx["model"], max_seq_length=seq, device=dev, model_kwargs={"attn_implementation": impl}
        )
        return load_model(cfg, dev)

    def decoder(impl):
        cfg = ModelConfig(
            name_or_path=str(folder),
            pooling="lasttoken",
            max_seq_length=seq,
            device=dev,
            model_kwargs={"attn_implementation": impl},
            tokenizer_kwargs=bench.DECODER_TOKENIZER,  # MiniLM's WordPiece, as the bench loads it
        )
        return load_model(cfg, dev)

    return {"all-MiniLM-L6-v2": minilm, "qwen2 decoder": decoder}


def stage_attention(ctx: dict, work: Path) -> dict:
    """Issue 34: for each attention variant available here (``ATTENTION_VARIANTS``: sdpa, eager,
    flash attention 2/3 when importable on a GPU, flex attention with its kernel compiled and not),
    the check's model and the bench's small Qwen2 decoder: whether cembed packs, each packed row vs
    the row embedded alone (max relative difference, fp32), and the cached loss's step padded vs
    packed on the seeded skewed-length set (``ATTENTION_SIZES``), with the fastest variant and path
    per model. A variant that fails is recorded with its error; the stage passes when sdpa packs both
    models correctly. The result is rewritten after each case, so a timeout keeps the cases done."""
    size = ATTENTION_SIZES["quick" if ctx.get("quick") else "full"]
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = _bench_throughput().skewed_pairs(size["rows"], seed=1)
    models = attention_models(ctx, work, size["seq"])
    results: dict = {name: {} for name in models}
    report = {"sizes": size, "variants": results}
    for label in ATTENTION_VARIANTS:
        obstacle = attention_variant_obstacle(label, ctx["device"], bool(ctx.get("quick")))
        for name, load in models.items():
            # sdpa, the variant judged, always runs; the others while the soft limit allows
            if obstacle is None and label != "sdpa" and time.perf_counter() - started > size["soft_s"]:
                obstacle = f"not run: the stage's {size['soft_s']:.0f} s were spent"
            if obstacle is not None:
                results[name][label] = {"not_run": obstacle}
                continue
            results[name][label] = case = {}
            try:
                attention_case(load, label, rows, size, ctx, case)
            except Exception as err:  # noqa: BLE001 - a variant that fails is recorded, not fatal
                case["error"] = f"{type(err).__name__}: {str(err).strip()[:300]}"
            report["fastest"] = {n: fastest(cases) for n, cases in results.items()}
            (work / "result.json").write_text(json.dumps({"status": "fail", **report}, indent=1, default=str))
    ok = all(_sdpa_ok(cases.get("sdpa")) for cases in results.values())
    return {"status": "pass" if ok else "fail", **report, "seconds_in_stage": round(time.perf_counter() - started, 1)}


def run_one_stage(name: str, run_dir: Path) -> int:
    """Run ``stage_<name>`` on ``run_dir/context.json`` (a CUDA-only stage is skipped on another
    device) and write its result to ``run_dir/<name>/result.json``; returns 0. Raises KeyError for an
    unknown stage, and whatever the stage raises (the orchestrator reports it as ``error``)."""
    ctx = {**json.loads((run_dir / "context.json").read_text()), "run_dir": str(run_dir)}
    work = run_dir / name
    if ctx["device"] != "cuda" and name in CUDA_ONLY:
        result = {"status": "skipped", "reason": f"CUDA only; --device {ctx['device']}"}
    else:
        result = globals()[f"stage_{name}"](ctx, work)
    (work / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    """Run one stage (``--stage NAME --run-dir DIR``, as the orchestrator calls it); 0 once its
    ``result.json`` is written (a failing check is ``status: fail`` there, a crash a non-zero exit)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", required=True, help="the stage to run (scripts/gpu_check/__main__.py's STAGES)")
    p.add_argument("--run-dir", required=True, help="the run folder holding context.json")
    args = p.parse_args(argv)
    return run_one_stage(args.stage, Path(args.run_dir))


if __name__ == "__main__":
    sys.exit(main())
