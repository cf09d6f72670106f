"""Batch-size study: fine-tune on the SciFact train pairs at several per-device batch sizes, with the
learning rate scaled by the sqrt rule vs. held fixed, and report SciFact test NDCG@10.

Training pairs: cembed's BEIR source, ``data.train: {beir: <scifact>, split: train}``: ``qrels/train.tsv``
joined to ``queries.jsonl`` (anchor = claim) and ``corpus.jsonl.gz`` (positive =
``(title + " " + text).strip()``): 919 pairs, 565 distinct abstracts,
so a duplicate-free batch holds at most 565 rows (the no-duplicates sampler refuses more).

Each run goes through cembed itself (config -> check_run_inputs -> run_training), then the saved model is
scored with ``cembed.eval.evaluators.evaluate_retrieval`` on the SciFact test split (full corpus). The
untrained model is scored the same way as the baseline, next to the published MTEB 0.64508.

Writes ``<out>/batch_size_study.md`` (table + the command), ``.png`` (NDCG@10 vs batch size) and
``.json`` (every number). Slow on CPU: every evaluation encodes the 5,183 abstracts (~10 min on 2
cores at max_seq_length 256). A smoke run:

    python scripts/study_batch_size.py --batch-sizes 8 16 --max-train-pairs 64 --max-seq-length 32 \\
        --model <tiny model dir> --out /tmp/study-smoke
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's cembed, even when another copy is installed
SCIFACT = REPO.parent / "shared" / "data" / "scifact"
PUBLISHED_NDCG10 = 0.64508  # MTEB results, sentence-transformers__all-MiniLM-L6-v2/.../SciFact.json (test)


def scifact_train_pairs(scifact: Path) -> list[dict]:
    """(claim, abstract) rows from qrels/train.tsv in file order, only qrels score > 0: cembed's BEIR
    training source (``data.train: {beir: <folder>, split: train}``)."""
    from cembed.config.sources import BeirSource
    from cembed.data.sources.registry import load_source

    return load_source(BeirSource(path=str(scifact), split="train")).to_list()


def run_config(args, bs: int, rule: str, out_dir: Path) -> dict:
    return {
        "model": {
            "name_or_path": args.model,
            "max_seq_length": args.train_max_seq_length or args.max_seq_length,
            "device": args.device,
        },
        "data": {
            "train": {"beir": str(SCIFACT), "split": "train"},
            "columns": {"anchor": "anchor", "positive": "positive"},
            "max_samples": args.max_train_pairs,
        },
        "batch": {
            "per_device_train_batch_size": bs,
            "mini_batch_size": min(bs, args.mini_batch_size),
            "drop_last": True,
        },
        "optim": {
            "learning_rate": args.base_lr,
            "base_batch_size": args.base_batch_size,
            "lr_scaling": rule,
            "warmup_ratio": args.warmup_ratio,
        },
        "loss": {"name": "cached_mnrl", "scale": 20},
        "sampler": {"no_duplicates": True},
        "train": {"num_train_epochs": args.epochs, "seed": args.seed, "logging_steps": 5, "output_dir": str(out_dir)},
    }


def evaluate_model(path: str, args, cache_dir: Path) -> tuple[float, float]:
    from cembed.eval.evaluators import evaluate_retrieval
    from cembed.eval.sets import load_beir
    from cembed.model.load import load_eval_model

    model = load_eval_model(path, args.device, args.max_seq_length)
    t0 = time.perf_counter()
    metrics, _ = evaluate_retrieval(model, load_beir(SCIFACT, "test", "scifact-test"), args.eval_batch_size, cache_dir)
    return metrics["scifact-test_cosine_ndcg@10"], time.perf_counter() - t0


def plot(results: list[dict], baseline: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rule, label in (("sqrt", "LR sqrt-scaled"), ("none", "LR fixed")):
        pts = sorted((r["batch_size"], r["ndcg@10"]) for r in results if r["lr_scaling"] == rule)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.axhline(baseline, color="gray", linestyle="--", label=f"no fine-tuning (measured {baseline:.4f})")
    ax.axhline(PUBLISHED_NDCG10, color="black", linestyle=":", label=f"published MTEB {PUBLISHED_NDCG10}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("per-device batch size")
    ax.set_ylabel("SciFact test NDCG@10")
    ax.set_title("Fine-tuning on SciFact train pairs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    from cembed.files import write_atomic

    write_atomic(png, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)


def markdown(results: list[dict], baseline: float, args, command: str, n_pairs: int) -> str:
    lines = [
        "# Batch-size study: SciFact train pairs -> SciFact test NDCG@10",
        "",
        f"Model `{args.model}`, max_seq_length {args.train_max_seq_length or args.max_seq_length} in training and "
        f"{args.max_seq_length} in evaluation, {n_pairs} training pairs "
        f"(qrels/train.tsv joined to queries and corpus), {args.epochs:g} epoch(s), cached MNRL (scale 20), "
        f"no-duplicates sampler, warmup_ratio {args.warmup_ratio}, seed {args.seed}. "
        f"LR: base {args.base_lr:g} at batch {args.base_batch_size}; `sqrt` = base x sqrt(batch / {args.base_batch_size}), "
        "`none` = base for every batch. Evaluated on the full SciFact test split (300 queries, 5,183 documents) "
        "with `cembed.eval.evaluators` (sentence-transformers InformationRetrievalEvaluator, cosine).",
        "",
        f"Baseline without fine-tuning: measured NDCG@10 **{baseline:.5f}**, published (MTEB) {PUBLISHED_NDCG10}.",
        "",
        "| batch | LR rule | effective LR | steps | train s | NDCG@10 | vs baseline | vs published |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(results, key=lambda r: (r["batch_size"], r["lr_scaling"])):
        lines.append(
            f"| {r['batch_size']} | {r['lr_scaling']}{' (same run as ' + r['same_run_as'] + ')' if r.get('same_run_as') else ''} | {r['learning_rate']:.2e} | {r['steps']} | {r['train_seconds']:.0f} "
            f"| {r['ndcg@10']:.5f} | {r['ndcg@10'] - baseline:+.5f} | {r['ndcg@10'] - PUBLISHED_NDCG10:+.5f} |"
        )
    lines += ["", "![NDCG@10 vs batch size](batch_size_study.png)", "", "Command:", "", "```bash", command, "```", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The study's command line (``argv`` None: ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--rules", nargs="+", default=["sqrt", "none"], choices=["sqrt", "none", "linear"])
    p.add_argument("--base-lr", type=float, default=2e-5)
    p.add_argument("--base-batch-size", type=int, default=16)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--warmup-ratio", type=float, default=0.0)
    p.add_argument("--max-seq-length", type=int, default=256, help="evaluation (and, by default, training) truncation")
    p.add_argument("--train-max-seq-length", type=int, default=None, help="training truncation, to save time on CPU")
    p.add_argument("--mini-batch-size", type=int, default=32)
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--max-train-pairs", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", type=Path, default=REPO / "docs")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "study_batch_size")
    return p.parse_args(argv)


def run_display(console):
    """What ``cembed train`` prints for a run (probe, header, components) on ``console``, without the progress bar."""
    from cembed.cli.display.run import RichRunDisplay

    return RichRunDisplay(console, progress=False)


def train_and_score(cfg, plan, data, args, bs: int, rule: str, out_dir: Path, cache_dir: Path, console) -> dict:
    """Train one configuration through cembed (``run_training``) and score the saved model on the
    SciFact test split; returns its row of the results (seconds are wall-clock)."""
    from cembed.train.recipe import run_training

    t0 = time.perf_counter()
    summary = run_training(cfg, plan, data, run_display(console))
    train_s = time.perf_counter() - t0
    ndcg, eval_s = evaluate_model(str(out_dir), args, cache_dir)
    return {
        "batch_size": bs,
        "lr_scaling": rule,
        "learning_rate": plan.learning_rate,
        "steps": summary["steps"],
        "train_seconds": round(train_s, 1),
        "eval_seconds": round(eval_s, 1),
        "ndcg@10": ndcg,
        "first_loss": summary["first_loss"],
        "last_loss": summary["last_loss"],
    }


def write_report(results: list[dict], baseline: float, args, command: str, n_pairs: int) -> None:
    """Write ``<out>/batch_size_study.{json,md,png}`` from the results so far (atomically, so a long
    study that is stopped keeps what it measured)."""
    from cembed.files import write_atomic, write_json_atomic

    report = {
        "command": command,
        "baseline_ndcg@10": baseline,
        "published_ndcg@10": PUBLISHED_NDCG10,
        "train_pairs": n_pairs,
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    write_json_atomic(args.out / "batch_size_study.json", report)
    table = markdown(results, baseline, args, command, n_pairs)
    write_atomic(args.out / "batch_size_study.md", lambda f: f.write(table))
    plot(results, baseline, args.out / "batch_size_study.png")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python scripts/study_batch_size.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )

    from rich.console import Console

    from cembed.config.file import config_from_dict
    from cembed.errors import UserError
    from cembed.files import cache_root
    from cembed.train.recipe import check_run_inputs

    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = cache_root("embeddings")
    pairs = scifact_train_pairs(SCIFACT)[: args.max_train_pairs]
    console.print(f"{len(pairs)} training pairs, {len({r['positive'] for r in pairs})} distinct positives")

    baseline, secs = evaluate_model(args.model, args, cache_dir)
    console.print(f"baseline NDCG@10 {baseline:.5f} ({secs:.0f}s)")
    results = []
    for bs in args.batch_sizes:
        for rule in args.rules:
            out_dir = args.work_dir / f"bs{bs}-{rule}"
            cfg = config_from_dict(run_config(args, bs, rule, out_dir), "study", REPO)
            try:
                plan, data = check_run_inputs(cfg)
            except UserError as err:
                console.print(f"[yellow]skip batch {bs} ({rule}): {err}[/]")
                continue
            same = next(
                (r for r in results if r["batch_size"] == bs and r["learning_rate"] == plan.learning_rate), None
            )
            if same is not None:  # e.g. batch == base_batch_size: sqrt and fixed are the same run
                results.append({**same, "lr_scaling": rule, "same_run_as": same["lr_scaling"]})
                continue
            row = train_and_score(cfg, plan, data, args, bs, rule, out_dir, cache_dir, console)
            results.append(row)
            console.print(
                f"batch {bs} {rule}: lr {plan.learning_rate:.2e}, {row['steps']} steps, NDCG@10 {row['ndcg@10']:.5f}"
            )
            # Write after every run, so a long study that is stopped keeps what it measured.
            write_report(results, baseline, args, command, len(pairs))
    if not results:
        console.print("[red]no run finished[/]")
        return 1
    console.print(f"table: {args.out / 'batch_size_study.md'}  plot: {args.out / 'batch_size_study.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
