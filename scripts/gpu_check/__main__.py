#!/usr/bin/env python
"""One-call GPU verification of cembed (issue 14), run by ``scripts/gpu_check.sh``.

Runs each stage in its own process with a budget (``STAGES``; the budgets sum under the overall
deadline, default 570 s on a GPU, an estimate never timed there), and prints one JSON object: a
pass/fail status per stage with its seconds, CPU seconds and budget and, under ``summary``:

  (a) ``correctness``: fp32 cached == fp32 plain (TF32 off), bf16 cached vs fp32 plain loss and
      gradient on a small batch, and dropout replay exact on the GPU (with a negative control);
  (b) ``probe``: ``probe-minibatch`` for all-MiniLM-L6-v2 at 256 tokens, batch 65536;
  (c) ``train``: tokens/s, MFU/FLOP/s (whatever the meter records), data-wait and padded share over a
      few steps at batch 65536 on the COCO pairs (read from the run's ``run_summary.json``);
  (d) ``stock``: stock sentence-transformers' step (tokenizing collator, its cached loss) and cembed's
      on the same 65536 rows, timed alike, and their ratio;
  (e) ``gpu_util``: GPU utilisation sampled (nvidia-ml-py, else nvidia-smi) during (c) and (d);
  (f) ``estimate``: ``cembed estimate --calibrate 2`` against the same config's real run (issue 26:
      within 15 % on the GPU; reported, not judged, with ``--quick``);
  (g) ``attention``: per attention implementation (sdpa, eager, flash attention 2/3 when importable,
      flex attention with its kernel compiled and not), for all-MiniLM-L6-v2 and a small Qwen2
      decoder: packed rows vs each row alone, packed vs padded step on skewed lengths, the fastest;
  (h) ``maxsim``: the cached MaxSim loss of all-MiniLM-L6-v2 as a ColBERT model (issue 40): cembed's tiled
      path, the fused kernel of late-interaction-kernels (when it imports on CUDA: the bundle carries its
      wheel) and stock sentence-transformers on the same batch, loss and gradients against stock, the path
      ``loss.score_kernel: auto`` chose; MaxSim alone (tiled vs fused, fp32 and bf16): step time, peak
      memory, agreement (alone: ``--stages install,env,maxsim``).

Also issue 13's CUDA-only checks (a sticky CUDA error, fp16 + nonfinite_loss: skip under the real
GradScaler, the probe's gathered loss stage). Every run writes under a fresh folder
(``--out``, default ``/tmp/cembed-gpu-check/run-<time>-<pid>``), so a second run never trips on the
first one's outputs; the tokenization cache beside it is keyed by content and shared.

``--device cpu --quick`` runs the same stages on CPU at small sizes (batch 32, 32 tokens, 2 steps,
deadline 360 s; the CUDA-only stages skipped, the stock stage in bf16 autocast as on a GPU) in the
current environment, installing nothing: the CI run (tests/scripts/test_gpu_check.py).

``--bundle DIR`` (made by ``scripts/gpu_bundle.sh``) installs the bundle's wheels with no package
index (``pip install --no-index --no-deps --target``), checks cembed's requirements are met, and
uses the bundle's fp16 all-MiniLM-L6-v2 and COCO pairs. ``--dry-run`` prints the plan (stages,
commands, timeouts) and checks the bundle's contents against its manifest, without CUDA or torch.

The check is a folder run as a program (``python scripts/gpu_check``), split along its import
boundary: this orchestrator, ``bundle.py`` (the bundle's check and install) and ``sampler.py`` (GPU
utilisation) use the standard library only, since the GPU image lacks pydantic and datasets until the
bundle is installed (tests/scripts/test_gpu_check.py asserts it); ``stages.py``, run in a process of its own
per stage, is the only module that imports cembed and torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# Run as ``python scripts/gpu_check``: this folder is sys.path[0], so its stdlib modules import by name.
from bundle import check_bundle, coco_pairs_of, install_command
from sampler import GpuSampler

REPO = Path(__file__).resolve().parents[2]
STAGES_PY = Path(__file__).resolve().with_name("stages.py")  # run, never imported: it imports cembed
# name, budget (s) on one H200 at the full sizes, budget (s) on CPU with --quick, what it checks.
# Each column sums under its deadline (DEADLINES), so no stage is cut short by the overall deadline.
# The GPU column is an estimate (never measured on a GPU). The CPU column: a --quick run on a 2-core
# machine shared with other jobs, empty tokenization cache, took (wall / CPU s) install 9 / 9, env 2 / 2,
# correctness 9 / 11, probe 13 / 2 + its trial processes, train 62 / 58, stock 16 / 17: 110 s in all (the
# CUDA-only stages skip at once); at a load of ~6 on 2 cores, 240 s. What a stage leaves unused goes
# to the later ones. attention (issue 34, added later): 16 s wall on the CPU at a load of ~4 (sdpa and
# eager, never measured on a GPU); with it the GPU column sums to 680 s, over the 570 s deadline, so a
# full run shrinks every budget in proportion (stage_budgets): on a GPU run it alone with
# ``--stages install,env,attention``. maxsim (issue 40, added later): 82 s wall / 43 CPU s on the CPU at a
# load of ~4 (never measured on a GPU); run it alone on a GPU with ``--stages install,env,maxsim``.
STAGES = (
    ("install", 30, 20, "install the bundle's wheels (no index), report the image's versions and unmet pins"),
    ("env", 20, 10, "CUDA device, driver, torch/cembed versions, /dev/shm, precision auto resolution"),
    ("correctness", 45, 45, "(a) fp32 cached == plain, bf16 cached vs fp32 plain, dropout replay exact"),
    ("sticky", 20, 3, "issue 13 C5: a sticky CUDA error; cembed's health check and trial close"),
    ("fp16_skip", 45, 3, "issue 13 C3: fp16 + nonfinite_loss: skip with the real GradScaler"),
    ("gather", 40, 3, "issue 13 C2: the probe's loss stage over 8 ranks' gathered candidates"),
    ("probe", 80, 60, "(b) probe-minibatch, all-MiniLM-L6-v2, 256 tokens, batch 65536"),
    ("train", 110, 75, "(c) cembed train at batch 65536 on COCO pairs: tokens/s, MFU, data-wait, padding"),
    ("stock", 70, 75, "(d) stock sentence-transformers step vs cembed's on the same batch, each side's attention path"),
    ("estimate", 100, 45, "issue 26: estimate --calibrate 2 predicts the same config's train wall time (15 %)"),
    ("attention", 120, 20, "issue 34: per attention implementation, packed rows == rows alone, packed vs padded step"),
    (
        "maxsim",
        60,
        45,
        "issue 40: the cached MaxSim loss, tiled vs fused kernel (if present) vs stock, and MaxSim alone",
    ),
)
DEADLINES = {"full": 570.0, "quick": 360.0}  # seconds for the whole check, per size
# --quick: small sizes for a CPU smoke run of the same stages (CI); the full sizes are the GPU's.
SIZES = {"full": {"batch": 65536, "seq": 256, "steps": 4}, "quick": {"batch": 32, "seq": 32, "steps": 2}}


def stage_budgets(selected: list[tuple], deadline: float, quick: bool, scale: float = 1.0) -> dict[str, float]:
    """Each selected stage's budget (s): its column of ``STAGES`` times ``scale``, shrunk in proportion
    when the budgets would sum over ``deadline``, so that they always sum to at most ``deadline``."""
    budgets = {s[0]: (s[2] if quick else s[1]) * scale for s in selected}
    total = sum(budgets.values())
    shrink = min(1.0, deadline / total) if total else 1.0
    # rounded down to 0.1 s: rounded to nearest, 12 shrunk budgets summed to 100.1 for a 100 s deadline
    return {name: math.floor(b * shrink * 10) / 10 for name, b in budgets.items()}


SAMPLED = ("train", "stock")  # (e) GPU utilisation sampled while these run
DEADLINE_REACHED = "the overall deadline was reached"


def stage_command(py: str, name: str, run_dir: Path) -> list[str]:
    """The command that runs stage ``name`` of the run in ``run_dir`` in its own process (stages.py)."""
    return [py, str(STAGES_PY), "--stage", name, "--run-dir", str(run_dir)]


def _children_cpu() -> float:
    """CPU seconds (user + system) used so far by this process's finished children: a stage's cost
    that does not depend on how busy a shared machine is."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_stage(name: str, timeout: float, cmd: list[str], env: dict, run_dir: Path) -> dict:
    """Run one stage's process; its result is the ``result.json`` it writes (status pass/fail),
    else ``error`` (it crashed) or ``timeout``."""
    work = run_dir / name
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cpu_before = _children_cpu()
    with open(work / "log.txt", "w") as log:
        try:
            rc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=work
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = round(time.perf_counter() - started, 1)
    cpu_seconds = round(_children_cpu() - cpu_before, 1)
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
    out = {"status": status, "seconds": seconds, "cpu_seconds": cpu_seconds, "timeout_s": round(timeout, 1), **result}
    if status in ("error", "timeout"):
        tail = (work / "log.txt").read_text(errors="replace").strip().splitlines()[-6:]
        out["log_tail"] = tail
    return out


def installs_wheels(args, bundle: Path | None) -> bool:
    """Whether the run pip-installs the bundle's wheels: only with ``--bundle`` on a GPU run; with
    ``--device cpu`` (CI) the current environment is used as it is and nothing is installed."""
    return bundle is not None and args.device == "cuda"


def run_plan(args, py: str, bundle: Path | None, run_dir: Path, selected: list[tuple]) -> dict:
    """What ``--dry-run`` prints beside the bundle check: the run folder, the sizes, the deadline and
    the budgets' sum, and per selected stage its timeout (s, its budget), what it checks and its
    command (the pip call for ``install`` when the bundle's wheels are installed)."""
    site = run_dir / "site"
    budgets = stage_budgets(selected, args.deadline, args.quick, args.timeout_scale)
    return {
        "run_dir": str(run_dir),
        "device": args.device,
        "quick": args.quick,
        "deadline_s": args.deadline,
        "budget_sum_s": round(sum(budgets.values()), 1),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "stages": [
            {
                "name": n,
                "timeout_s": budgets[n],
                "what": w,
                "command": " ".join(install_command(py, bundle, site, image_pyarrow()))
                if n == "install" and installs_wheels(args, bundle)
                else " ".join(stage_command(py, n, run_dir)),
            }
            for n, *_, w in selected
        ],
    }


def stage_context(args, root: Path, bundle: Path | None, bundle_check: dict) -> dict:
    """The ``context.json`` every stage reads: sizes, device, precision, the shared cache, the model
    and COCO pairs (the bundle's, else the defaults the stages resolve), whether the bundle's wheels
    were installed."""
    return {
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "quick": args.quick,
        "cache_dir": str(root / "cache"),
        "device": args.device,
        "precision": args.precision,
        "bundle": str(bundle) if bundle else None,
        "bundle_wheels_installed": installs_wheels(args, bundle),
        "model": bundle_check.get("model") or "all-MiniLM-L6-v2",
        "coco": str(bundle / coco_pairs_of(bundle)) if bundle else None,
    }


def child_env(site: Path | None) -> dict:
    """The stages' environment: offline Hugging Face, unbuffered, no tqdm, and ``PYTHONPATH`` with
    the bundle's site folder first when its wheels were installed (cembed's wheel included), then this
    checkout (its cembed where no bundle is installed), then tests/ (the tiny-model helper), then the
    caller's."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    env.update({k: "1" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")})
    env["TOKENIZERS_PARALLELISM"] = "false"
    tests = str(REPO / "tests")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(site)] * bool(site) + [str(REPO), tests] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    )
    return env


def image_pyarrow() -> str | None:
    """The image's pyarrow version (this interpreter's; the stages run under the same one), which picks
    the bundle's datasets (bundle.chosen_wheels); None when it has none."""
    from importlib import metadata

    try:
        return metadata.version("pyarrow")
    except metadata.PackageNotFoundError:
        return None


def install_wheels(py: str, bundle: Path, bundle_check: dict, site: Path, timeout: float) -> dict | None:
    """Install the bundle's wheels, and nothing else, into ``site`` (pip with no index and no
    dependencies, ``timeout`` s) before the install stage runs.

    Returns:
        None when installed; else the install stage's result (status ``fail``): the bundle failed its
        check, pip failed, or pip ran past ``timeout``.
    """
    if not bundle_check["ok"]:
        return {"status": "fail", "bundle_check": bundle_check}
    try:
        pip = subprocess.run(
            install_command(py, bundle, site, image_pyarrow()), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "pip": f"pip install ran past {timeout:.0f} s"}
    if pip.returncode != 0:
        return {"status": "fail", "pip": pip.stderr.strip().splitlines()[-6:]}
    return None


def run_stages(args, py: str, bundle, bundle_check: dict, run_dir: Path, env: dict, deadline: float, selected):
    """Run the selected stages in order. Each stage's timeout is its budget plus whatever earlier
    stages left unused (what is left of ``deadline``, a ``time.perf_counter()`` value, minus the
    budgets of the stages after it), so a slow stage cannot eat a later stage's budget. A stage with
    under 5 s left is skipped, and a failed install or env stage ends the run.

    Returns:
        ``(stages, util)``: each stage's result by name, and the GPU utilisation sampled per stage.
    """
    budgets = stage_budgets(selected, args.deadline, args.quick, args.timeout_scale)
    names = [s[0] for s in selected]
    stages, util = {}, {}
    for i, name in enumerate(names):
        left = deadline - time.perf_counter()
        timeout = max(budgets[name], left - sum(budgets[n] for n in names[i + 1 :]))
        timeout = min(timeout, left)
        if timeout < 5:
            stages[name] = {"status": "skipped", "reason": DEADLINE_REACHED}
            continue
        if name == "install" and installs_wheels(args, bundle):
            started = time.perf_counter()
            failed = install_wheels(py, bundle, bundle_check, run_dir / "site", timeout)
            if failed is not None:
                stages[name] = {**failed, "seconds": round(time.perf_counter() - started, 1)}
                break
            timeout -= time.perf_counter() - started
        cmd = stage_command(py, name, run_dir)
        if name in SAMPLED:
            with GpuSampler() as sampler:
                stages[name] = run_stage(name, timeout, cmd, env, run_dir)
            util[name] = stages[name]["gpu_util"] = sampler.stats()
        else:
            stages[name] = run_stage(name, timeout, cmd, env, run_dir)
        stages[name]["budget_s"] = budgets[name]
        if name in ("install", "env") and stages[name]["status"] != "pass":
            break  # nothing else can run
    return stages, util


def run_report(stages: dict, util: dict, selected: list[tuple], run_dir: Path, seconds: float) -> dict:
    """The one JSON object a run prints: ``ok`` (every selected stage ran and passed or was skipped
    for a reason other than the deadline), the run's ``seconds``, each stage's ``seconds`` in one
    place, the ``summary`` of (a)-(e) plus the install stage's versions and the stock stage's
    attention paths, and every stage's result."""
    return {
        "ok": all(s["status"] in ("pass", "skipped") for s in stages.values())
        and not any(s.get("reason") == DEADLINE_REACHED for s in stages.values())
        and len(stages) == len(selected),
        "run_dir": str(run_dir),
        "seconds": seconds,
        "stage_seconds": {n: s.get("seconds") for n, s in stages.items()},
        "stage_cpu_seconds": {n: s.get("cpu_seconds") for n, s in stages.items()},
        "summary": {
            "versions": stages.get("install", {}).get("versions"),
            "unmet": stages.get("install", {}).get("unmet"),
            "correctness": stages.get("correctness", {}).get("checks"),
            "probe": stages.get("probe", {}).get("probe"),
            "train": stages.get("train", {}).get("throughput"),
            "stock": stages.get("stock", {}).get("comparison"),
            "attention_paths": stages.get("stock", {}).get("paths"),
            "estimate": stages.get("estimate", {}).get("estimate"),
            "attention_fastest": stages.get("attention", {}).get("fastest"),
            "maxsim": stages.get("maxsim", {}).get("loss"),
            "gpu_util": util,
        },
        "stages": stages,
    }


def orchestrate(args) -> int:
    """Plan the run, then (unless ``--dry-run``) run every selected stage in a fresh run folder and
    print the report. Returns the exit code: 0 ok, 1 a stage or the bundle check failed, 2 the run
    folder exists."""
    py = args.python or sys.executable
    bundle = Path(args.bundle).resolve() if args.bundle else None
    root = Path(args.root)
    run_dir = Path(args.out) if args.out else root / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = run_dir.absolute()  # the stages run with their own folder as the working directory
    selected = [s for s in STAGES if not args.stages or s[0] in args.stages.split(",")]
    plan = run_plan(args, py, bundle, run_dir, selected)
    bundle_check = check_bundle(bundle)
    if args.dry_run:
        print(json.dumps({"dry_run": True, "ok": bundle_check["ok"], "bundle_check": bundle_check, **plan}, indent=1))
        return 0 if bundle_check["ok"] else 1
    if run_dir.exists():
        print(json.dumps({"ok": False, "error": f"{run_dir} exists; give a fresh --out"}))
        return 2
    run_dir.mkdir(parents=True)
    (run_dir / "context.json").write_text(json.dumps(stage_context(args, root, bundle, bundle_check)))
    env = child_env(run_dir / "site" if installs_wheels(args, bundle) else None)
    deadline = time.perf_counter() + args.deadline
    stages, util = run_stages(args, py, bundle, bundle_check, run_dir, env, deadline, selected)
    report = run_report(stages, util, selected, run_dir, round(args.deadline - (deadline - time.perf_counter()), 1))
    (run_dir / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


def parse_args(argv=None) -> argparse.Namespace:
    """The check's command line (see the module docstring); sizes, deadline and precision not given
    take the defaults of the mode (``--quick`` or full) and the device."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", help="offline bundle made by scripts/gpu_bundle.sh")
    p.add_argument("--dry-run", action="store_true", help="print the plan and check the bundle; no CUDA")
    p.add_argument("--out", help="this run's folder (must not exist); default a fresh one under --root")
    p.add_argument("--root", default="/tmp/cembed-gpu-check", help="where run folders and the shared cache go")
    p.add_argument("--stages", help="comma-separated subset of: " + ",".join(s[0] for s in STAGES))
    p.add_argument("--quick", action="store_true", help="small sizes (batch 32, 32 tokens, 2 steps): a CPU smoke run")
    p.add_argument("--deadline", type=float, help="seconds for the whole check (default 570; 360 with --quick)")
    p.add_argument("--batch", type=int, help="rows per step (default 65536; 32 with --quick)")
    p.add_argument("--seq", type=int, help="max tokens per text (default 256; 32 with --quick)")
    p.add_argument("--steps", type=int, help="training steps (default 4; 2 with --quick)")
    p.add_argument("--python", help="the interpreter the stages run in (default: this one)")
    p.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        help="multiply every stage's budget and the default deadline (slow or shared machines)",
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda; cpu runs the same stages' code (CUDA-only ones skipped) in the current environment",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        help="the stock stage's precision (default auto on cuda; bf16 on cpu, so the CPU run takes the "
        "GPU's bf16 autocast path)",
    )
    args = p.parse_args(argv)
    mode = "quick" if args.quick else "full"
    for key, value in SIZES[mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.deadline is None:
        args.deadline = DEADLINES[mode] * args.timeout_scale
    if args.precision is None:
        args.precision = "auto" if args.device == "cuda" else "bf16"
    return args


def main(argv=None) -> int:
    """Run the check (see the module docstring); returns orchestrate's exit code."""
    return orchestrate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
