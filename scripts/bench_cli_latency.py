"""How fast ``cembed`` answers what needs no model: ``--help``, ``suggest-lr``, ``init --example`` and a
typo'd config key (``validate`` and ``train``). Each case runs N times in a fresh interpreter
(``python -c`` running the ``cembed`` module, as the console script does); the table gives the median
wall time and, from the last run, how many modules were loaded and which training libraries among
them (torch, transformers, sentence_transformers, datasets). Module counts do not depend on how
busy the machine is; seconds do.

    python scripts/bench_cli_latency.py                      # this checkout, 5 runs per case
    python scripts/bench_cli_latency.py --tree ../main --tree .   # before -> after, side by side

``--tree DIR`` puts DIR first on PYTHONPATH (a checkout of cembed); without it the cembed that
``python`` imports is timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch", "transformers", "sentence_transformers", "datasets")

# Runs cembed with ARGS and, at exit (after typer's SystemExit), prints the loaded-module facts.
HOOK = (
    "import atexit, sys, runpy\n"
    "atexit.register(lambda: print('BENCH', len(sys.modules), ','.join(m for m in {heavy!r} if m in sys.modules)"
    " or '-', file=sys.stderr))\n"
    "sys.argv = ['cembed', *{args!r}]\n"
    "runpy.run_module('cembed', run_name='__main__')\n"
)

TYPO_CONFIG = "model:\n  name_or_path: all-MiniLM-L6-v2\n  nmae: x\ndata:\n  train: pairs.jsonl\n"


def cases() -> dict[str, list[str]]:
    """Case name -> cembed arguments (``{n}`` is replaced by the run's number: a new file each run)."""
    return {
        "--help": ["--help"],
        "train -h": ["train", "-h"],
        "suggest-lr": ["suggest-lr", "--base-lr", "2e-5", "--base-bs", "32", "--bs", "65536"],
        "init --example": ["init", "quick{n}.yaml", "--example", "quickstart"],
        "validate, typo'd key": ["validate", "typo.yaml"],
        "train, typo'd key": ["train", "typo.yaml"],
    }


def run_once(python: str, args: list[str], cwd: Path, env: dict) -> tuple[float, int, str, int]:
    """``(seconds, modules loaded, heavy libraries loaded, exit code)`` of one ``cembed ARGS``."""
    code = HOOK.format(heavy=HEAVY, args=args)
    start = time.perf_counter()
    r = subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    line = next((x for x in r.stderr.splitlines()[::-1] if x.startswith("BENCH ")), None)
    if line is None:
        raise SystemExit(f"cembed {' '.join(args)}: no module report; stderr:\n{r.stderr[-2000:]}")
    _, modules, heavy = line.split(" ", 2)
    return seconds, int(modules), heavy, r.returncode


def bench(python: str, tree: str | None, runs: int) -> dict[str, tuple[float, float, float, int, str, int]]:
    """Case -> ``(median s, min s, max s, modules, heavy, exit code)`` for one cembed tree."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = {}
    with tempfile.TemporaryDirectory(prefix="cembed-bench-") as tmp:
        cwd = Path(tmp)
        (cwd / "typo.yaml").write_text(TYPO_CONFIG)
        for name, args in cases().items():
            results = [run_once(python, [a.format(n=i) for a in args], cwd, env) for i in range(runs)]
            seconds = [r[0] for r in results]
            _, modules, heavy, rc = results[-1]
            out[name] = (statistics.median(seconds), min(seconds), max(seconds), modules, heavy, rc)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per case (the median is reported)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with cembed's dependencies")
    parser.add_argument("--tree", action="append", help="cembed checkout to time (repeatable; default: installed)")
    args = parser.parse_args()
    trees = args.tree or [None]
    tables = {tree: bench(args.python, tree, args.runs) for tree in trees}
    print(
        f"cembed CLI latency: median of {args.runs} runs per case, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print("| case | tree | median s | min s | max s | modules | training libraries loaded | exit |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for name in cases():
        for tree in trees:
            median, lo, hi, modules, heavy, rc = tables[tree][name]
            label = tree or "installed"
            print(f"| {name} | {label} | {median:.2f} | {lo:.2f} | {hi:.2f} | {modules} | {heavy} | {rc} |")


if __name__ == "__main__":
    main()
