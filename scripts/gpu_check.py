#!/usr/bin/env python
"""One-call GPU verification of cembed (issue 14), run by ``scripts/gpu_check.sh``.

Runs each stage in its own process with a timeout, under one overall deadline (default 470 s,
so the whole check fits 8 minutes on one H200), and prints one JSON object: a pass/fail status per
stage and, under ``summary``:

  (a) ``correctness``: fp32 cached == fp32 plain (TF32 off), bf16 cached vs fp32 plain loss and
      gradient on a small batch, and dropout replay exact on the GPU (with a negative control);
  (b) ``probe``: ``probe-minibatch`` for all-MiniLM-L6-v2 at 256 tokens, batch 65536;
  (c) ``train``: tokens/s, MFU/FLOP/s (whatever the meter records), data-wait and padded share over a
      few steps at batch 65536 on the COCO pairs (read from the run's ``run_summary.json``);
  (d) ``stock``: stock sentence-transformers' step (tokenizing collator, its cached loss) and cembed's
      on the same 65536 rows, timed alike, and their ratio;
  (e) ``gpu_util``: GPU utilisation sampled (nvidia-ml-py, else nvidia-smi) during (c) and (d).

Also issue 13's CUDA-only checks (a sticky CUDA error, fp16 + nonfinite_loss: skip under the real
GradScaler, the probe's gathered loss stage). Every run writes under a fresh folder
(``--out``, default ``/tmp/cembed-gpu-check/run-<time>-<pid>``), so a second run never trips on the
first one's outputs; the tokenization cache beside it is keyed by content and shared.

``--bundle DIR`` (made by ``scripts/gpu_bundle.sh``) installs the bundle's wheels with no package
index (``pip install --no-index --no-deps --target``), checks cembed's requirements are met, and
uses the bundle's fp16 all-MiniLM-L6-v2 and COCO pairs. ``--dry-run`` prints the plan (stages,
commands, timeouts) and checks the bundle's contents against its manifest, without CUDA or torch.

The orchestrator uses the standard library only; the stages import cembed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE_LIMIT = 60 * 2**20
# What the bundle must hold beyond the GPU image (torch 2.11, transformers 5.17, sentence-transformers
# 6.0.1, no pydantic or datasets): see scripts/gpu_bundle.sh.
BUNDLE_PACKAGES = (
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_inspection",
    "typing_extensions",
    "datasets",
    "dill",
    "multiprocess",
    "fsspec",
    "sentence_transformers",
    "cembed",
)
MODEL_FILES = ("modules.json", "config.json", "model.safetensors", "tokenizer.json")

# name, timeout (s), what it checks
STAGES = (
    ("install", 90, "install the bundle's wheels with no index, check cembed's requirements, versions"),
    ("env", 60, "CUDA device, driver, torch/cembed versions, /dev/shm, precision auto resolution"),
    ("correctness", 150, "(a) fp32 cached == plain, bf16 cached vs fp32 plain, dropout replay exact"),
    ("sticky", 60, "issue 13 C5: a sticky CUDA error; cembed's health check and trial close"),
    ("fp16_skip", 120, "issue 13 C3: fp16 + nonfinite_loss: skip with the real GradScaler"),
    ("gather", 120, "issue 13 C2: the probe's loss stage over 8 ranks' gathered candidates"),
    ("probe", 180, "(b) probe-minibatch, all-MiniLM-L6-v2, 256 tokens, batch 65536"),
    ("train", 240, "(c) cembed train at batch 65536 on COCO pairs: tokens/s, MFU, data-wait, padding"),
    ("stock", 180, "(d) stock sentence-transformers step vs cembed's on the same batch"),
)
SAMPLED = ("train", "stock")  # (e) GPU utilisation sampled while these run


# --------------------------------------------------------------------------------------------
# the bundle
# --------------------------------------------------------------------------------------------


def _dist_name(wheel: str) -> str:
    return wheel.split("/")[-1].split("-")[0].lower().replace("-", "_").replace(".", "_")


def check_bundle(bundle: Path | None) -> dict:
    """Check a bundle against its ``MANIFEST.json``: every listed file present with its size and
    sha256, the total within 60 MiB, one wheel per needed package, the model folder complete.

    Returns:
        ``{"ok": bool, "problems": [...], "wheels": [...], "total_mib": float, ...}``; ``ok`` is
        True with ``bundle: null`` when no bundle is used.
    """
    if bundle is None:
        return {"ok": True, "bundle": None, "note": "no --bundle: the current environment is used"}
    problems: list[str] = []
    manifest_path = bundle / "MANIFEST.json"
    if not manifest_path.is_file():
        return {"ok": False, "bundle": str(bundle), "problems": [f"{manifest_path} is missing"]}
    manifest = json.loads(manifest_path.read_text())
    for rel, meta in manifest.get("files", {}).items():
        path = bundle / rel
        if not path.is_file():
            problems.append(f"missing {rel}")
        elif path.stat().st_size != meta["bytes"]:
            problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {meta['bytes']}")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != meta["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest")
    wheels = sorted(str(p.relative_to(bundle)) for p in (bundle / "wheels").glob("*.whl"))
    names = [_dist_name(w) for w in wheels]
    for pkg in BUNDLE_PACKAGES:
        count = names.count(pkg)
        if count != 1:
            problems.append(f"wheels/: {count} wheels of {pkg} (need exactly 1)")
    model = bundle / manifest.get("model", "all-MiniLM-L6-v2-fp16")
    problems += [f"model folder lacks {f}" for f in MODEL_FILES if not any(model.rglob(f))]
    if not (bundle / manifest.get("coco_pairs", "coco_pairs.jsonl.gz")).is_file():
        problems.append("coco pairs file missing")
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    if total > BUNDLE_LIMIT:
        problems.append(f"bundle is {total / 2**20:.1f} MiB, over 60 MiB")
    return {
        "ok": not problems,
        "bundle": str(bundle),
        "problems": problems,
        "wheels": wheels,
        "model": str(model),
        "total_mib": round(total / 2**20, 2),
    }


def install_command(py: str, bundle: Path, site: Path) -> list[str]:
    """The pip call that installs the bundle's wheels into ``site`` without an index."""
    wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
    return [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site), *wheels]


# --------------------------------------------------------------------------------------------
# the orchestrator
# --------------------------------------------------------------------------------------------


class GpuSampler:
    """Samples GPU utilisation (%) and memory used every ``period`` s in a thread, through
    nvidia-ml-py (``pynvml``) or, without it, ``nvidia-smi``."""

    def __init__(self, period: float = 0.25) -> None:
        self.period, self.samples, self.source = period, [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.source = "nvidia-ml-py"

            def read():
                u = pynvml.nvmlDeviceGetUtilizationRates(handle)
                return u.gpu, pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30

            return read
        except Exception:
            if shutil.which("nvidia-smi") is None:
                return None
            self.source = "nvidia-smi"

            def read():
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--id=0",
                        "--query-gpu=utilization.gpu,memory.used",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.split(",")
                return float(out[0]), float(out[1]) / 1024

            return read

    def _run(self) -> None:
        read = self._reader()
        while read is not None and not self._stop.is_set():
            try:
                self.samples.append((time.time(), *read()))
            except Exception:
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def stats(self) -> dict:
        util = [s[1] for s in self.samples]
        if not util:
            return {"source": self.source, "samples": 0}
        return {
            "source": self.source,
            "samples": len(util),
            "mean_pct": round(statistics.fmean(util), 1),
            "median_pct": statistics.median(util),
            "min_pct": min(util),
            "share_ge_90pct": round(sum(u >= 90 for u in util) / len(util), 3),
            "max_mem_gib": round(max(s[2] for s in self.samples), 2),
        }


def stage_command(py: str, name: str, run_dir: Path) -> list[str]:
    return [py, str(Path(__file__).resolve()), "--stage", name, "--run-dir", str(run_dir)]


def run_stage(name: str, timeout: float, cmd: list[str], env: dict, run_dir: Path) -> dict:
    """Run one stage's process; its result is the ``result.json`` it writes (status pass/fail),
    else ``error`` (it crashed) or ``timeout``."""
    work = run_dir / name
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        try:
            rc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=work
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = round(time.perf_counter() - started, 1)
    result_path = work / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if rc is None:
        status = "timeout"
    elif result.get("status") == "skipped":
        status = result.pop("status")
    elif rc != 0 or "status" not in result:
        status = "error"
    else:
        status = result.pop("status")
    out = {"status": status, "seconds": seconds, "timeout_s": round(timeout, 1), **result}
    if status in ("error", "timeout"):
        tail = (work / "log.txt").read_text(errors="replace").strip().splitlines()[-6:]
        out["log_tail"] = tail
    return out


def orchestrate(args) -> int:
    py = args.python or sys.executable
    bundle = Path(args.bundle).resolve() if args.bundle else None
    root = Path(args.root)
    run_dir = Path(args.out) if args.out else root / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    selected = [s for s in STAGES if not args.stages or s[0] in args.stages.split(",")]
    site = run_dir / "site"
    plan = {
        "run_dir": str(run_dir),
        "deadline_s": args.deadline,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "stages": [
            {
                "name": n,
                "timeout_s": t,
                "what": w,
                "command": " ".join(install_command(py, bundle, site))
                if n == "install" and bundle
                else " ".join(stage_command(py, n, run_dir)),
            }
            for n, t, w in selected
        ],
    }
    bundle_check = check_bundle(bundle)
    if args.dry_run:
        print(json.dumps({"dry_run": True, "ok": bundle_check["ok"], "bundle_check": bundle_check, **plan}, indent=1))
        return 0 if bundle_check["ok"] else 1
    if run_dir.exists():
        print(json.dumps({"ok": False, "error": f"{run_dir} exists; give a fresh --out"}))
        return 2
    run_dir.mkdir(parents=True)
    context = {
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "cache_dir": str(root / "cache"),
        "device": args.device,
        "bundle": str(bundle) if bundle else None,
        "model": bundle_check.get("model") or "all-MiniLM-L6-v2",
        "coco": str(bundle / "coco_pairs.jsonl.gz") if bundle else None,
    }
    (run_dir / "context.json").write_text(json.dumps(context))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    env.update({k: "1" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")})
    env["TOKENIZERS_PARALLELISM"] = "false"
    tests = str(REPO / "tests")
    # The bundle's wheels first (cembed's included), then this checkout (its cembed where no bundle
    # is used), tests/ for the tiny-model helper.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(site)] * bool(bundle) + [str(REPO), tests] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    )
    deadline = time.perf_counter() + args.deadline
    stages, util = {}, {}
    for name, timeout, _ in selected:
        timeout *= args.timeout_scale
        left = deadline - time.perf_counter()
        if left < 15:
            stages[name] = {"status": "skipped", "reason": "the overall deadline was reached"}
            continue
        if name == "install":
            if bundle is None:
                cmd = stage_command(py, "install", run_dir)
            elif not bundle_check["ok"]:
                stages[name] = {"status": "fail", "bundle_check": bundle_check}
                break
            else:
                pip = subprocess.run(install_command(py, bundle, site), capture_output=True, text=True, timeout=timeout)
                if pip.returncode != 0:
                    stages[name] = {"status": "fail", "pip": pip.stderr.strip().splitlines()[-6:]}
                    break
                cmd = stage_command(py, "install", run_dir)
        else:
            cmd = stage_command(py, name, run_dir)
        if name in SAMPLED:
            with GpuSampler() as sampler:
                stages[name] = run_stage(name, min(timeout, left), cmd, env, run_dir)
            util[name] = stages[name]["gpu_util"] = sampler.stats()
        else:
            stages[name] = run_stage(name, min(timeout, left), cmd, env, run_dir)
        if name in ("install", "env") and stages[name]["status"] != "pass":
            break  # nothing else can run
    report = {
        "ok": all(s["status"] in ("pass", "skipped") for s in stages.values())
        and not any(s.get("reason") == "the overall deadline was reached" for s in stages.values())
        and len(stages) == len(selected),
        "run_dir": str(run_dir),
        "seconds": round(args.deadline - (deadline - time.perf_counter()), 1),
        "summary": {
            "correctness": stages.get("correctness", {}).get("checks"),
            "probe": stages.get("probe", {}).get("probe"),
            "train": stages.get("train", {}).get("throughput"),
            "stock": stages.get("stock", {}).get("comparison"),
            "gpu_util": util,
        },
        "stages": stages,
    }
    (run_dir / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


# --------------------------------------------------------------------------------------------
# the stages (each in its own process; they import cembed)
# --------------------------------------------------------------------------------------------


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
    import torch

    return torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])


def stage_install(ctx: dict, work: Path) -> dict:
    """cembed imports, and every requirement of cembed and of the bundled packages is met."""
    from importlib import metadata

    from packaging.requirements import Requirement

    unmet, versions = [], {}
    for dist in ("cembed", "sentence-transformers", "datasets", "pydantic", "torch", "transformers", "accelerate"):
        versions[dist] = metadata.version(dist)
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
    import cembed.cli.app  # noqa: F401  (the whole CLI imports: pydantic, datasets, typer, rich)

    return {"status": "pass" if not unmet else "fail", "versions": versions, "unmet": unmet, "cembed": cembed.__file__}


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
    """(a) On 64 COCO pairs at 64 tokens: fp32 cached == fp32 plain (TF32 off); bf16 cached (model
    forward under autocast, TF32 on) vs fp32 plain; dropout replay (RandContext) bit-exact, with a
    negative control that differs."""
    import torch
    from sentence_transformers.base.losses.gradcache import RandContext
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from cembed.config.schema import ModelConfig, loss_config
    from cembed.losses.registry import build_loss
    from cembed.model.load import load_model
    from cembed.plan.precision import enable_tf32

    dev = ctx["device"]
    model = load_model(ModelConfig(name_or_path=ctx["model"], max_seq_length=64, device=dev), dev)
    rows = coco_rows(ctx, 64)
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
    cached = build_loss(model, loss_config(), 16).module
    fp32_loss, fp32_grad = run(cached)
    enable_tf32()
    restore = _autocast_forward(model, torch.bfloat16)
    bf16_loss, bf16_grad = run(cached)
    restore()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    checks = {
        "fp32_cached_vs_plain": {
            "loss_rel": abs(fp32_loss - plain_loss) / abs(plain_loss),
            "grad_rel_l2": rel(fp32_grad, plain_grad),
        },
        "bf16_cached_vs_fp32_plain": {
            "loss": [bf16_loss, plain_loss],
            "loss_rel": abs(bf16_loss - plain_loss) / abs(plain_loss),
            "grad_rel_l2": rel(bf16_grad, plain_grad),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(bf16_grad, plain_grad, dim=0)),
        },
    }
    model.train()  # dropout 0.1 on: the replayed forward must see the first forward's masks
    replay = {}
    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        restore = _autocast_forward(model, dtype) if dtype else (lambda: None)
        f = {k: v[:16] if hasattr(v, "to") else v for k, v in feats[1].items()}
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
    return {"status": "pass" if ok else "fail", "checks": checks}


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
    from cembed.cli.train import RichRunDisplay

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

    from cembed.config.schema import ModelConfig, loss_config
    from cembed.probe.trials import CudaTrial, TrialSpec

    m = make_tiny_model(work / "tiny")
    mc = ModelConfig(name_or_path=str(m), max_seq_length=32, device="cuda", precision="bf16").model_dump()
    peaks = {}
    for w in (1, 8):
        spec = TrialSpec(
            model=mc, loss=loss_config().model_dump(), n_columns=3, batch_size=4096, device="cuda", world_size=w
        )
        t = CudaTrial(spec)
        peaks[w] = t(1024).peak_bytes
        t.close()
    ok = peaks[8] > peaks[1] + 2**30  # ~6 fp32 chunk matrices of 1024 x 98304 more
    return {"status": "pass" if ok else "fail", "peak_gib": {w: round(b / 2**30, 3) for w, b in peaks.items()}}


def stage_probe(ctx: dict, work: Path) -> dict:
    from cembed.config.schema import ModelConfig, loss_config
    from cembed.probe.search import run_probe

    dev = ctx["device"]
    mc = ModelConfig(name_or_path=ctx["model"], max_seq_length=ctx["seq"], device=dev)
    started = time.perf_counter()
    result = run_probe(mc, loss_config(), ctx["batch"], 2, dev, max_memory=None if dev == "cuda" else 4 * 2**30)
    d = result.to_dict()
    d["seconds"] = round(time.perf_counter() - started, 1)
    (work / "probe.json").write_text(json.dumps(d, indent=1))
    return {"status": "pass" if result.recommended >= 1 else "fail", "probe": d}


def _mini_batch(ctx: dict) -> int:
    """The probe stage's recommendation (same run), else 2048 (at most the batch)."""
    probe = Path(ctx["run_dir"]) / "probe" / "probe.json"
    return json.loads(probe.read_text())["recommended"] if probe.is_file() else min(2048, ctx["batch"])


def stage_train(ctx: dict, work: Path) -> dict:
    """(c) ``run_training`` at batch 65536 on COCO pairs (repeated to fill the steps; the
    no-duplicates sampler is off since 50k pairs cannot fill a duplicate-free batch of 65536)."""
    from datasets import Dataset

    from cembed.config.file import config_from_dict
    from cembed.data.prepare import PreparedData
    from cembed.plan.resolve import resolve_plan
    from cembed.train.recipe import run_training

    b, steps = ctx["batch"], ctx["steps"]
    mini = _mini_batch(ctx)
    rows = coco_rows(ctx, b * steps)
    data = PreparedData(Dataset.from_dict(rows), source="coco", rows_read=b * steps, roles={c: c for c in rows})
    cfg = config_from_dict(
        {
            "model": {"name_or_path": ctx["model"], "max_seq_length": ctx["seq"], "device": ctx["device"]},
            "data": {"train": "coco.jsonl", "cache_dir": ctx["cache_dir"]},
            "batch": {"per_device_train_batch_size": b, "mini_batch_size": mini},
            "sampler": {"no_duplicates": False},
            "optim": {"warmup_ratio": 0.0},
            "train": {"max_steps": steps, "logging_steps": 1, "output_dir": str(work / "out")},
        },
        base=work,
    )
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


def stage_stock(ctx: dict, work: Path) -> dict:
    """(d) One batch of ``batch`` COCO rows through stock sentence-transformers (its tokenizing
    collator, ``CachedMultipleNegativesRankingLoss``) and through cembed (pre-tokenized ids, the
    padding collator, the length-sorted cached loss), same model, precision and mini-batch size;
    1 warm-up and 2 timed steps each (forward + backward, synchronized)."""
    import torch
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from cembed.config.schema import ModelConfig, loss_config
    from cembed.data.tokenize import collator_for, pretokenize
    from cembed.losses.registry import build_loss
    from cembed.model.load import load_model
    from cembed.plan.precision import enable_tf32, resolve_precision

    b, mini, dev = ctx["batch"], _mini_batch(ctx), ctx["device"]
    model = load_model(ModelConfig(name_or_path=ctx["model"], max_seq_length=ctx["seq"], device=dev), dev)
    model.eval()  # dropout off: both paths compute the same loss
    precision = resolve_precision("auto", dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if precision.tf32:
        enable_tf32()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision.precision)
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
    paths = {
        "stock": (CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini), stock_feats),
        "cembed": (build_loss(model, loss_config(), mini).module, ours_feats),
    }
    times, losses = {k: [] for k in paths}, {}
    for r in range(3):
        for label, (loss, feats) in paths.items():
            model.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            value = loss(feats, None)
            value.backward()
            sync()
            if r > 0:
                times[label].append(time.perf_counter() - t0)
            losses[label] = float(value.detach())
    step = {k: statistics.median(v) for k, v in times.items()}
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
    ok = comparison["loss_rel"] <= 2e-2
    return {"status": "pass" if ok else "fail", "comparison": comparison}


CUDA_ONLY = ("sticky", "fp16_skip", "gather")


def run_one_stage(name: str, run_dir: Path) -> int:
    ctx = {**json.loads((run_dir / "context.json").read_text()), "run_dir": str(run_dir)}
    work = run_dir / name
    if ctx["device"] != "cuda" and name in CUDA_ONLY:
        result = {"status": "skipped", "reason": f"CUDA only; --device {ctx['device']}"}
    else:
        result = globals()[f"stage_{name}"](ctx, work)
    (work / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", help="offline bundle made by scripts/gpu_bundle.sh")
    p.add_argument("--dry-run", action="store_true", help="print the plan and check the bundle; no CUDA")
    p.add_argument("--out", help="this run's folder (must not exist); default a fresh one under --root")
    p.add_argument("--root", default="/tmp/cembed-gpu-check", help="where run folders and the shared cache go")
    p.add_argument("--stages", help="comma-separated subset of: " + ",".join(s[0] for s in STAGES))
    p.add_argument("--deadline", type=float, default=470.0, help="seconds for the whole check")
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--python", help="the interpreter the stages run in (default: this one)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every stage's timeout (slow machines)")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the stages' code at small sizes (a smoke test)")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage:
        return run_one_stage(args.stage, Path(args.run_dir))
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
