"""Calibration benchmark for ``cembed estimate`` (issue 26 item 2): predicted vs measured wall time.

For each of three configs (the quickstart; a skewed-length file: most rows short, a few long; a
3-column file: anchor, positive, negative) it runs ``cembed estimate CONFIG --calibrate STEPS`` and
then the same config's real ``cembed train``, and prints the predicted run time (``run_seconds``)
beside the measured one (``run_summary.json``'s ``wall_time_s``, the training loop's wall time).
The two small files are made here from the packaged COCO pairs. A benchmark, not a test: run it on
a quiet machine, e.g. ``nice -n 10 python scripts/bench_estimate.py --calibrate 3``.

Usage: python scripts/bench_estimate.py [--calibrate 3] [--max-steps N] [--set KEY=VALUE] [--only NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
COCO_PAIRS = REPO / "cembed" / "samples" / "coco_captions" / "train_pairs.jsonl.gz"


def coco_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` random caption pairs of the packaged COCO data (one pair per image, so no duplicates)."""
    with gzip.open(COCO_PAIRS, "rt") as f:
        rows = [json.loads(line) for line in f]
    seen, out = set(), []
    random.Random(seed).shuffle(rows)
    for row in rows:
        if row["image_id"] in seen:
            continue
        seen.add(row["image_id"])
        out.append({"anchor": row["anchor"], "positive": row["positive"]})
    return out[:n]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def skewed_rows(n: int) -> list[dict]:
    """Most anchors one caption, one in eight five captions joined (long rows pad the short ones)."""
    rows = coco_rows(n + n // 8 * 4, seed=1)
    base, extra = rows[:n], rows[n:]
    for i in range(0, n, 8):
        base[i]["anchor"] = " ".join([base[i]["anchor"], *(r["anchor"] for r in extra[i // 8 * 4 : i // 8 * 4 + 4])])
    return base


def three_column_rows(n: int) -> list[dict]:
    """anchor, positive and a negative: another image's caption."""
    rows = coco_rows(n + 1, seed=2)
    return [{**rows[i], "negative": rows[i + 1]["positive"]} for i in range(n)]


def configs(folder: Path) -> dict[str, Path]:
    """The three configs: the quickstart as shipped, and two made from it with the small files."""
    base = yaml.safe_load(QUICKSTART.read_text())
    base["data"]["train"] = "cembed:coco-captions"
    out = {"quickstart": QUICKSTART}
    for name, rows, columns in (
        ("skewed", skewed_rows(2048), {"anchor": "anchor", "positive": "positive"}),
        (
            "three-column",
            three_column_rows(2048),
            {"anchor": "anchor", "positive": "positive", "negatives": ["negative"]},
        ),
    ):
        cfg = json.loads(json.dumps(base))
        cfg["model"]["max_seq_length"] = 128
        cfg["data"] = {"train": str(write_jsonl(folder / f"{name}.jsonl", rows)), "columns": columns}
        cfg["train"]["output_dir"] = str(folder / f"run-{name}")
        cfg["train"]["max_steps"] = 20
        cfg.pop("eval", None)
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        out[name] = path
    return out


def cembed(*args: str) -> float:
    """Run ``cembed ARGS`` (this interpreter); return its wall seconds; stop on failure."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cembed", *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"cembed {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", type=int, default=3, help="calibration steps")
    parser.add_argument("--max-steps", type=int, default=None, help="override train.max_steps of every config")
    parser.add_argument("--set", action="append", default=[], help="extra section.field=value override (repeatable)")
    parser.add_argument("--only", action="append", help="run only this config (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp folder)")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="bench-estimate-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, path in configs(folder).items():
        if args.only and name not in args.only:
            continue
        overrides = [f"train.output_dir={folder / ('run-' + name)}"]
        overrides += [f"train.max_steps={args.max_steps}"] if args.max_steps else []
        overrides += args.set
        estimate_json = folder / f"estimate-{name}.json"
        est_s = cembed(
            "estimate", str(path), *overrides, "--calibrate", str(args.calibrate), "--json", str(estimate_json)
        )
        estimate = json.loads(estimate_json.read_text())
        train_s = cembed("train", str(path), *overrides, "--overwrite")
        summary = json.loads((folder / f"run-{name}" / "run_summary.json").read_text())
        predicted, measured = estimate["run_seconds"]["value"], summary["wall_time_s"]
        row = {
            "config": name,
            "steps": summary["steps"],
            "predicted_s": round(predicted, 1),
            "measured_s": round(measured, 1),
            "error": round(predicted / measured - 1, 3),
            "padded_share": round(estimate["data"]["padded_share"]["value"], 3),
            "estimate_command_s": round(est_s, 1),
            "train_command_s": round(train_s, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| config | steps | predicted s | measured s | error | padded share | estimate cmd s | train cmd s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['steps']} | {r['predicted_s']} | {r['measured_s']} | {r['error']:+.1%} "
            f"| {r['padded_share']} | {r['estimate_command_s']} | {r['train_command_s']} |"
        )


if __name__ == "__main__":
    main()
