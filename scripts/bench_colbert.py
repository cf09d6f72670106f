#!/usr/bin/env python
"""Late-interaction (ColBERT) benchmark: sentence-transformers' stock path vs cembed, side by side.

Stock path: ``MultiVectorEncoderDataCollator`` (tokenizes every batch) and
``CachedMultiVectorMultipleNegativesRankingLoss`` (padded token cache, chunked padded MaxSim). cembed:
pre-tokenized ids + ``PaddingCollator`` and ``cached_maxsim`` (:class:`cembed.losses.cached_maxsim.CachedMaxSimLoss`:
sorted, packed mini-batches, ragged token cache, tiled MaxSim). Every measurement of memory runs in a
fresh child process (one path at a time, nothing else alive).

Sections (``--sections``, default both):
  step     all-MiniLM-L6-v2 turned into a 128-dim MultiVectorEncoder, one training step (forward +
           backward) at batch 256 (``--batch``), mini-batch 32, on the seeded skewed-length pairs of
           scripts/bench_throughput.py: step time (median of ``--rounds``), padded share of the encoder's
           positions, the memory the step allocates above the model and the optimizer state, and the
           loss (the paths must agree within 1e-5 relative: the script exits 1 after its tables if not).
           The memory is that of the first step (before any timed round); ``--rounds 0`` measures it and
           the loss only (batch 4,096 on a CPU: one step per path). ``--paths cembed,stock`` picks the paths
           and their order; each child prints its pid and memory mark on stderr, so a long run's peak so far
           can be read from outside (``VmHWM`` in ``/proc/<pid>/status`` minus the mark).
  scoring  the loss stage alone (MaxSim + cross entropy + backward into the cache) on synthetic cached
           token vectors (``--score-dim`` 8, queries of ``--query-tokens`` 4..12 tokens, documents of
           ``--document-tokens`` 8..40; the sizes of a tiny model; smaller ones make 65k rows feasible on a
           CPU, whose tiled path costs about a pair of tokens per few ns) at 1k, 4k, 16k and 65k rows
           (``--rows``): the memory it allocates above the cache and the cache's gradient (the
           leaves' ``.grad`` after the stage, subtracted: as in training they start as None, and both
           grow with the rows as the step's input and output, not scoring), stock vs cembed. Stock
           rows whose score matrix alone would pass ``--stock-max-gib`` are not run.

Memory: on CUDA the peak of ``torch.cuda.max_memory_allocated`` above what was allocated before the
measured stage; on CPU the peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``)
above the resident memory before it, with glibc told (``mallopt``, as scripts/bench_sparse.py does) to
serve every allocation of 64 KiB or more by ``mmap`` and trim its heap at once, so that freed tiles leave
the resident set (with glibc's default, its growing mmap threshold keeps freed tiles in the heap: the
resident peak then grows with the number of tiles run, not with what is alive).

Usage: ``python scripts/bench_colbert.py [--rounds 3] [--sections step,scoring] [--device cpu]``
(``--quick``: a tiny random model, small batches and rows, for a smoke run).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import skewed_pairs  # noqa: E402

LOSS_TOLERANCE = 1e-5
# The scoring section's warm-up: four document chunks of the default tiles (1,024 rows each) against every
# query tile of these rows, so that each tile shape has run and glibc's heap of small blocks (index tensors,
# Python objects) is at its steady state before the mark, as in training after its first step.
WARM_ROWS = 4096
PATHS = ("stock", "cembed")


# --- memory --------------------------------------------------------------------------------------


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def memory_mark(device: str) -> int:
    """What is held now, and the peak counter restarted (CUDA: allocated bytes; CPU: resident bytes)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident size
        f.write("5")
    return _rss("VmRSS")


def memory_peak(device: str) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _rss("VmHWM")


# --- the models and the two paths -----------------------------------------------------------------


def load_model(quick: bool, tmp: Path, device: str):
    """A MultiVectorEncoder built by cembed's multi-vector kind: from all-MiniLM-L6-v2 (dim 128), or with
    ``quick`` from a tiny random BERT (dim 16); dropout off (eval mode: the paths must agree)."""
    from cembed.config.model import model_config
    from cembed.model.load import load_model as cembed_load

    if quick:
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import make_tiny_model

        cfg = model_config(kind="multi_vector", name_or_path=str(make_tiny_model(tmp / "tiny")), dim=16)
    else:
        cfg = model_config(kind="multi_vector", name_or_path="all-MiniLM-L6-v2", dim=128, max_seq_length=256)
    return cembed_load(cfg, device, seed=0).eval()


def batches(model, data: dict[str, list[str]], cache: Path) -> dict[str, list[dict]]:
    """One step's features per path: stock tokenizes with its collator, cembed pads its stored ids."""
    from datasets import Dataset
    from sentence_transformers.multi_vector_encoder import MultiVectorEncoderDataCollator

    from cembed.data.tokens.collator import TokenIdRows, collator_for
    from cembed.data.tokens.model_check import column_layouts
    from cembed.data.tokens.tokenize import pretokenize

    roles = ["anchor", "positive"]
    ds = Dataset.from_dict(data)
    lengths, expansions, _ = column_layouts(model, roles)
    ids = pretokenize(ds, roles, model.tokenizer, model.max_seq_length, cache, role_lengths=lengths).dataset
    ours = collator_for(model, roles, expansions=expansions)(TokenIdRows(ids, roles).__getitems__(list(range(len(ds)))))
    stock = MultiVectorEncoderDataCollator(preprocess_fn=model.preprocess)([ds[i] for i in range(len(ds))])

    def split(batch):
        return [{k.removeprefix(f"{r}_"): v for k, v in batch.items() if k.startswith(f"{r}_")} for r in roles]

    return {"stock": split(stock), "cembed": split(ours)}


def build_loss(model, path: str, mini_batch: int):
    if path == "stock":
        from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

        return CachedMultiVectorMultipleNegativesRankingLoss(model, scale=1.0, mini_batch_size=mini_batch)
    from cembed.config.loss import loss_config
    from cembed.losses.registry import build_loss as cembed_build

    return cembed_build(model, loss_config(name="cached_maxsim"), mini_batch).module


def positions(features: list[dict], path: str, mini_batch: int) -> tuple[int, int]:
    """``(real, processed)`` encoder positions of a path's mini-batches: stock pads each mini-batch to its
    longest row in data order; cembed sorts and packs (no padding)."""
    real = processed = 0
    for f in features:
        lengths = f["attention_mask"].sum(1).tolist()
        real += sum(lengths)
        if path == "cembed":
            processed += sum(lengths)
            continue
        for b in range(0, len(lengths), mini_batch):
            chunk = lengths[b : b + mini_batch]
            processed += max(chunk) * len(chunk)
    return real, processed


def _move(features, device):
    import torch

    return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in f.items()} for f in features]


def _step_child(args, path: str, queue) -> None:
    """One path's step in a fresh process: the loss value, the step times, and the memory the step
    allocates above the model and its (allocated) AdamW state."""
    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(args.quick, Path(tmp), args.device)
        features = _move(batches(model, skewed_pairs(args.batch, seed=1), Path(tmp) / "cache")[path], args.device)
        loss = build_loss(model, path, args.mini_batch)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=0.0)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # the AdamW state allocated, as after a first step
        optimizer.zero_grad(set_to_none=True)
        times, value, above = [], None, None
        for i in range(args.rounds + 1):  # the first round warms up and is the one measured for memory
            base = memory_mark(args.device) if i == 0 else None
            if i == 0:  # lets an observer bound a long run's peak from outside: VmHWM of this pid - base
                print(f"[{path}] pid {os.getpid()} memory mark {base} bytes", file=sys.stderr, flush=True)
            start = time.perf_counter()
            out = loss([dict(f) for f in features], None)
            out.backward()
            if args.device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if i == 0:
                above = memory_peak(args.device) - base
            else:
                times.append(elapsed)
            value = float(out.detach())
            optimizer.zero_grad(set_to_none=True)
        real, processed = positions(features, path, args.mini_batch)
        step_s = statistics.median(times) if times else None  # --rounds 0: memory and loss only
        result = {"loss": value, "step_s": step_s, "above": above, "padded": 1 - real / processed}
        print(f"[{path}] {result}", file=sys.stderr, flush=True)  # kept if the other path never finishes
        queue.put(result)


def _scoring_child(args, path: str, rows: int, queue) -> None:
    """The loss stage alone for ``rows`` rows of synthetic cached token vectors: the bytes it allocates
    above the cache and the cache's gradient (and the loss). One call on the first ``WARM_ROWS`` rows runs first:
    the library code it touches, torch's worker threads (started by the first op large enough to run in
    parallel; their stacks are resident) and lazily loaded kernels are resident before the mark, as they
    are in training after its first step."""
    import torch

    if args.device == "cpu":
        from bench_sparse import configure_malloc

        configure_malloc()
    g = torch.Generator().manual_seed(rows)
    dim = args.score_dim
    q_len = torch.randint(args.query_tokens[0], args.query_tokens[1] + 1, (rows,), generator=g)
    d_len = torch.randint(args.document_tokens[0], args.document_tokens[1] + 1, (rows,), generator=g)

    def ragged(lengths):
        return torch.nn.functional.normalize(torch.randn(int(lengths.sum()), dim, generator=g), dim=-1).to(args.device)

    q, d = ragged(q_len), ragged(d_len)
    loss, inputs = _scoring_loss(args, path)
    warm = min(rows, WARM_ROWS)
    loss.calculate_loss(
        *inputs(q[: int(q_len[:warm].sum())], q_len[:warm], d[: int(d_len[:warm].sum())], d_len[:warm]),
        with_backward=True,
    )
    reps, masks = inputs(q, q_len, d, d_len)
    base = memory_mark(args.device)
    value = loss.calculate_loss(reps, masks, with_backward=True)
    peak = memory_peak(args.device)
    # the cache's gradient (what GradCache keeps: the leaves' .grad, as in training, where they start None):
    # the stage's output, counted apart from the scoring memory
    gradient = sum(leaf.grad.numel() * leaf.grad.element_size() for column in reps for leaf in column)
    queue.put({"above": peak - base - gradient, "gradient": gradient, "loss": float(value)})


def _scoring_loss(args, path: str):
    """``(loss, inputs)``: the path's loss stage and ``inputs(q, q_len, d, d_len)`` -> its ``(reps, masks)``
    for ragged query and document vectors (cembed: the ragged cache; stock: one padded tensor and mask per
    mini-batch, as its cache holds them), every tensor a fresh leaf."""
    import torch

    mini = args.mini_batch
    if path == "cembed":
        from cembed.losses.cached_maxsim import CachedMaxSimLoss
        from cembed.losses.counts import TokenCounts
        from cembed.model.maxsim import Tiles
        from cembed.model.maxsim_kernel import find_fused_maxsim

        loss = object.__new__(CachedMaxSimLoss)  # its calculate_loss needs no model: only scale, tiles, gathering
        torch.nn.Module.__init__(loss)
        loss.scale, loss.tiles, loss.gather_across_devices, loss._inverse, loss.model = 1.0, Tiles(), False, [], None
        # the scoring path as training chooses it (score_kernel auto: tiled on CPU, a fused kernel where one
        # agrees on CUDA), decided on the first batch
        loss.score_kernel, loss.find_kernel, loss.scoring, loss.notes = "auto", find_fused_maxsim, None, []
        loss.token_counts = TokenCounts()  # the meter's scored pairs

        def inputs(q, q_len, d, d_len):
            return [[q.detach().clone().requires_grad_()], [d.detach().clone().requires_grad_()]], [[q_len], [d_len]]

        return loss, inputs
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    class _Similarity:  # the model's MaxSim, as the stock loss calls model.similarity
        def similarity(self, *a, **k):
            from sentence_transformers.util import maxsim

            return maxsim(*a, **k)

    loss = CachedMultiVectorMultipleNegativesRankingLoss(_Similarity(), scale=1.0, mini_batch_size=mini)

    def padded(values, lengths):  # the cache as the stock loss holds it: one padded tensor per mini-batch
        parts = list(torch.split(values, lengths.tolist()))
        emb, masks = [], []
        for b in range(0, len(parts), mini):
            chunk = parts[b : b + mini]
            emb.append(torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True).detach().requires_grad_())
            width = emb[-1].shape[1]
            masks.append(
                torch.arange(width, device=values.device)[None, :] < lengths[b : b + mini, None].to(values.device)
            )
        return emb, masks

    def inputs(q, q_len, d, d_len):
        (qe, qm), (de, dm) = padded(q, q_len), padded(d, d_len)
        return [qe, de], [qm, dm]

    return loss, inputs


def in_child(target, *args):
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=target, args=(*args, queue))
    proc.start()
    out = queue.get()
    proc.join()
    return out


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def section_step(args) -> bool:
    results = {path: in_child(_step_child, args, path) for path in args.paths}
    stock, ours = results["stock"], results["cembed"]
    agree = abs(ours["loss"] - stock["loss"]) <= LOSS_TOLERANCE * abs(stock["loss"])
    model = "tiny random BERT (dim 16)" if args.quick else "all-MiniLM-L6-v2 -> 128-dim ColBERT"
    print(f"\n## step: {model}, batch {args.batch}, mini-batch {args.mini_batch}, skewed pairs, {args.device}")
    print("| path | step (median) | padded share | memory above model + optimizer | loss |")
    print("|---|---|---|---|---|")
    for path in PATHS:
        r = results[path]
        step = f"{r['step_s']:.3f} s" if r["step_s"] is not None else "not timed"
        print(f"| {path} | {step} | {r['padded']:.1%} | {mib(r['above'])} | {r['loss']:.7f} |")
    speed = f"speed {stock['step_s'] / ours['step_s']:.2f}x, " if ours["step_s"] and stock["step_s"] else ""
    print(
        f"cembed / stock: {speed}memory {ours['above'] / max(stock['above'], 1):.2f}x; "
        f"losses {'agree' if agree else 'DIFFER'} (|d| {abs(ours['loss'] - stock['loss']):.2e})"
    )
    return agree


def section_scoring(args) -> None:
    (q0, q1), (d0, d1) = args.query_tokens, args.document_tokens
    print(
        f"\n## scoring: the loss stage alone (dim {args.score_dim}, queries {q0}-{q1} tokens, documents {d0}-{d1}), "
        f"memory above the cache and its gradient, {args.device}"
    )
    print("| rows | stock | cembed | cembed / cembed at the first rows | loss (cembed) | stock - cembed loss |")
    print("|---|---|---|---|---|---|")
    first = None
    for rows in args.rows:
        outs = {}
        for path in PATHS:
            if path == "stock" and 4 * rows * rows > args.stock_max_gib * 2**30:
                continue  # its (rows x rows) score matrix alone would pass the cap
            outs[path] = in_child(_scoring_child, args, path, rows)
        stock = (
            mib(outs["stock"]["above"])
            if "stock" in outs
            else f"not run (score matrix {4 * rows * rows / 2**30:.0f} GiB)"
        )
        delta = f"{abs(outs['stock']['loss'] - outs['cembed']['loss']):.1e}" if "stock" in outs else "-"
        first = first or outs["cembed"]["above"]
        print(
            f"| {rows:,} | {stock} | {mib(outs['cembed']['above'])} | {outs['cembed']['above'] / first:.3f} "
            f"| {outs['cembed']['loss']:.6f} | {delta} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="step,scoring")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--mini-batch", type=int, default=32)
    parser.add_argument("--rows", default="1024,4096,16384,65536")
    parser.add_argument("--score-dim", type=int, default=8)
    parser.add_argument("--query-tokens", default="4,12", help="scoring: min,max tokens per query")
    parser.add_argument("--document-tokens", default="8,40", help="scoring: min,max tokens per document")
    parser.add_argument("--stock-max-gib", type=float, default=8.0, help="scoring: skip stock above this")
    parser.add_argument("--device", default="cuda" if "--device" not in sys.argv and _has_cuda() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--paths", default="stock,cembed", help="step: the paths, in the order run")
    args = parser.parse_args()
    args.paths = tuple(args.paths.split(","))
    if sorted(args.paths) != sorted(PATHS):  # the step table compares the two
        parser.error(f"--paths: both of {', '.join(PATHS)}, in the order to run them")
    args.rows = [int(r) for r in args.rows.split(",")]
    args.query_tokens = tuple(int(t) for t in args.query_tokens.split(","))
    args.document_tokens = tuple(int(t) for t in args.document_tokens.split(","))
    if args.quick:
        args.batch, args.mini_batch, args.rounds, args.rows = 16, 4, 1, [64, 256]
    ok = True
    if "step" in args.sections:
        ok = section_step(args)
    if "scoring" in args.sections:
        section_scoring(args)
    sys.exit(0 if ok else 1)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
