#!/usr/bin/env python
"""Memory and communication of the cached loss's per-mini-batch backward: DDP vs the two FSDP2 choices.

Two gloo ranks on CPU, a small random BERT (``--hidden``, ``--layers``; built like the tests' tiny
model), sentence-transformers' CachedMultipleNegativesRankingLoss with gathered negatives, AdamW,
``--steps`` optimizer steps; for ``n`` mini-batches per step per rank (both columns together: anchor
and positive each cut into ``n / 2``) and each mode:

- ``ddp``: DistributedDataParallel; sentence-transformers runs all but the last mini-batch's backward
  in ``no_sync``, so gradients are all-reduced once per step.
- ``fsdp``: ``fully_shard`` per layer + root, ``reshard_after_forward=True`` (cembed's default):
  every mini-batch's backward reduce-scatters its gradients into the sharded ``.grad``.
- ``fsdp-deferred``: as ``fsdp``, but all but the last mini-batch run with
  ``set_requires_gradient_sync(False)``: FSDP accumulates unsharded gradients, one reduce-scatter
  per step.
- ``fsdp-reshard-replay``: as ``fsdp``, plus a forward hook that reshards each layer unit after its
  replay forward (see below; not what cembed does): a what-if for the gathered-parameter peak.

Every mode trains the same data from the same weights: the last column is the largest difference of
any weight from DDP's after the steps (exactness check).

Measured per rank (rank 0), on the last step: bytes of parameters (this rank's shards), the most
parameter bytes FSDP holds gathered at once, gradients held between mini-batches (the largest over
the step), gradients after the step's backward, AdamW state (counted from the tensors: CPU has no
allocator statistics like ``torch.cuda.max_memory_allocated``, and the process's peak RSS is set by
loading, not by the step); each collective's calls and payload bytes (``torch.distributed``'s Python
functions wrapped: FSDP2 issues ``all_gather_single`` / ``reduce_scatter_single``, the gathered loss
``all_gather``; DDP's reducer goes through ``all_reduce`` once its default comm hook is registered).

Analytic model (P parameter elements, T of them trainable, b = 4 bytes, W ranks, n mini-batches per
step; payload = the full, unsharded size; a ring sends (W-1)/W of it per rank for an all-gather or a
reduce-scatter, 2(W-1)/W for an all-reduce):

- DDP: all-reduce T*b once per step; gradients T*b held all step, AdamW 2*T*b, parameters P*b.
- FSDP, reduce-scatter per mini-batch (cembed's default): reduce-scatter n*T*b per step;
  all-gather 2*n*P*b: each unit once in the no-grad pass and once in the replay. The replay's forward
  runs inside the loss's backward (the GradCache hook), where FSDP2 does not reshard after forward
  (``FSDPParamGroup.post_forward``: ``if not is_bw(): self.reshard()``, as for activation
  checkpointing's recomputation), so the backward reuses the gathered parameters instead of gathering
  again, and a rank holds all P*b gathered at the end of each mini-batch's replay forward.
  Gradients held T*b/W, AdamW 2*T*b/W, parameters P*b/W between mini-batches.
- FSDP deferred: the same all-gathers; reduce-scatter T*b once per step; but T*b of unsharded
  gradients held from the first mini-batch's backward to the step's last (as DDP).
- FSDP reshard-replay: as FSDP per mini-batch, but each layer unit is gathered a third time per
  mini-batch (for its backward): all-gather 3*n*P_l*b + 2*n*P_r*b (P_r: the root unit's embeddings
  and pooler, P_l = P - P_r), and at most about one layer unit plus the root gathered at once.

The table prints the measurement next to the formula. Usage:
``python scripts/bench_fsdp.py [--hidden 128] [--layers 4] [--rows 16] [--steps 2]``
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("ddp", "fsdp", "fsdp-deferred", "fsdp-reshard-replay")
COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "broadcast",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _count_collectives(counts: dict):
    """Wrap torch.distributed's collectives: name -> [calls, payload bytes] (all-gather: the output,
    reduce-scatter: the input, all-reduce / broadcast: the tensor, list all-gather: the list)."""
    import torch.distributed as dist

    def nbytes(t):
        return (
            sum(x.numel() * x.element_size() for x in t)
            if isinstance(t, (list, tuple))
            else t.numel() * t.element_size()
        )

    def wrap(name, fn):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            if counts.get("on"):
                bound = list(signature.bind(*args, **kwargs).arguments.values())
                payload = bound[1] if name.startswith("reduce_scatter") else bound[0]
                entry = counts.setdefault(name, [0, 0])
                entry[0] += 1
                entry[1] += nbytes(payload)
            return fn(*args, **kwargs)

        return counted

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _grad_bytes(model) -> int:
    """Bytes of gradients this rank holds: ``.grad`` of the (sharded) parameters plus FSDP2's
    unsharded gradients waiting for a deferred reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            total += g.numel() * g.element_size()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group else []:
            for g in (getattr(getattr(fp, "_unsharded_param", None), "grad", None), fp.unsharded_accumulated_grad):
                if g is not None:
                    total += g.numel() * g.element_size()
    return total


def _track_unsharded(tracker: dict) -> None:
    """Record the largest number of parameter bytes FSDP2 holds gathered (unsharded) at once:
    ``tracker["max"]`` while ``tracker["on"]``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    live: dict[int, int] = {}
    to_unsharded, to_sharded = FSDPParamGroup._to_unsharded, FSDPParamGroup._to_sharded

    def unsharded(self):
        to_unsharded(self)
        live[id(self)] = sum(fp._orig_size.numel() * 4 for fp in self.fsdp_params)
        if tracker.get("on"):
            tracker["max"] = max(tracker.get("max", 0), sum(live.values()))

    def sharded(self):
        to_sharded(self)
        live.pop(id(self), None)

    FSDPParamGroup._to_unsharded, FSDPParamGroup._to_sharded = unsharded, sharded


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    out = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        out += t.numel() * t.element_size()
    return out


def _replay_context(mode: str, held: list):
    """sentence-transformers' per-mini-batch replay context, extended: under ``fsdp-deferred`` all
    but the last mini-batch skip FSDP's gradient sync; every mode records the gradient bytes held
    after each mini-batch's backward."""
    import sentence_transformers.base.losses.gradcache as gc

    original = gc._ddp_replay_context

    @contextmanager
    def context(model, synchronize):
        from torch.distributed.fsdp import FSDPModule

        deferred = mode == "fsdp-deferred" and isinstance(model, FSDPModule)
        if deferred:
            model.set_requires_gradient_sync(synchronize)
        with original(model, synchronize):
            yield
        held.append(_grad_bytes(model))

    gc._ddp_replay_context = context


def _reshard_in_backward(module, inputs, output):
    """After FSDP's own post-forward hook: reshard a unit whose forward ran inside a backward (the
    replay), which FSDP2 leaves gathered; its pre-backward hook gathers it again when needed."""
    import torch

    if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
        module.reshard()
    return output


def _weights(model) -> list[float]:
    """Every parameter's full values, flattened (a collective under FSDP: all ranks call it)."""
    import torch
    from torch.distributed.tensor import DTensor

    flat = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten() for p in model.parameters()]
    return torch.cat(flat).tolist()


def _worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch
    import torch.distributed as dist
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counts: dict = {}
    _count_collectives(counts)
    _track_unsharded(counts.setdefault("unsharded", {}))
    held: list[int] = []
    _replay_context(args.mode, held)
    model = SentenceTransformer(args.model_dir, device="cpu")
    for name, p in model.named_parameters():  # unused under mean pooling: frozen, as cembed does
        p.requires_grad_("pooler" not in name)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    root = total - sum(p.numel() for layer in model[0].auto_model.encoder.layer for p in layer.parameters())
    if args.mode == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        # The reducer's own all-reduce runs in C++; its default hook goes through dist.all_reduce (counted).
        wrapped.register_comm_hook(dist.group.WORLD, allreduce_hook)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model[0].auto_model.encoder.layer:
            fully_shard(layer, reshard_after_forward=True)
        wrapped = fully_shard(model, reshard_after_forward=True)
        if args.mode == "fsdp-reshard-replay":
            for layer in model[0].auto_model.encoder.layer:
                layer.register_forward_hook(_reshard_in_backward)
    loss = CachedMultipleNegativesRankingLoss(
        model, mini_batch_size=args.rows // (args.n // 2), gather_across_devices=True
    )
    loss.model = wrapped  # as the trainer does (override_model_in_loss)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-4)
    words = "man woman dog cat train table street car room plate food bus".split()

    def features(step, column):
        texts = [
            f"{column} {words[(i + step) % 12]} on the {words[(3 * i + rank) % 12]} number {i}"
            for i in range(args.rows)
        ]
        return model.tokenize(texts)

    for step in range(args.steps):
        held.clear()
        batch = [features(step, "a"), features(step, "the")]
        counts["on"] = counts["unsharded"]["on"] = step == args.steps - 1  # the last step (optimizer state exists)
        value = loss(batch, torch.arange(args.rows))
        value.backward()
        grads_after = _grad_bytes(wrapped)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts["on"] = counts["unsharded"]["on"] = False
    weights = _weights(wrapped)
    opt_bytes = _local_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    result = {
        "mode": args.mode,
        "n": args.n,
        "params_total": total,
        "params_root": root,
        "params_trainable": trainable,
        "param_bytes": _local_bytes(wrapped.parameters()),
        "grad_bytes_held_max": max(held) if held else 0,
        "grad_bytes_after_backward": grads_after,
        "optimizer_bytes": opt_bytes,
        "minibatch_backwards": len(held),
        "max_gathered_param_bytes": counts["unsharded"].get("max", 0),
        "collectives": {k: v for k, v in counts.items() if k not in ("on", "unsharded")},
        "weights": weights,
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _analytic(mode: str, n: int, P: int, P_root: int, T: int, W: int = 2, b: int = 4) -> dict:
    """The docstring's formulas, in bytes per rank per step (``T``: trainable elements)."""
    if mode == "ddp":
        return dict(params=P * b, grads=T * b, adam=2 * T * b, all_reduce=T * b, reduce_scatter=0, all_gather=0)
    return dict(
        params=P * b // W,
        grads=T * b if mode == "fsdp-deferred" else T * b // W,
        adam=2 * T * b // W,
        all_reduce=0,
        reduce_scatter=(1 if mode == "fsdp-deferred" else n) * T * b,
        all_gather=2 * n * P * b if mode != "fsdp-reshard-replay" else 3 * n * (P - P_root) * b + 2 * n * P_root * b,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="rows per rank and step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--minibatches", type=int, nargs="+", default=[2, 8], help="per rank and step, both columns")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(REPO / "tests"))
    import torch.multiprocessing as mp
    from conftest import make_tiny_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = str(make_tiny_model(Path(tmp) / "model", hidden=args.hidden, layers=args.layers, positions=64))
        for n in args.minibatches:
            for mode in MODES:
                run = argparse.Namespace(**vars(args), mode=mode, n=n)
                out = Path(tmp) / f"{mode}-{n}.json"
                mp.spawn(_worker, args=(run, _free_port(), str(out)), nprocs=2, join=True)
                results.append(json.loads(out.read_text()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    kib = 1024
    print(
        f"\nBERT hidden {args.hidden}, {args.layers} layers: P = {results[0]['params_total']:,} parameters "
        f"({results[0]['params_root']:,} in the root unit); 2 gloo ranks, {args.rows} rows per rank; per rank, KiB; "
        "measured (formula)\n"
    )
    print(
        "| mode | n | params (sharded) | params gathered at once (max) | grads held (max between mini-batches) | "
        "grads after backward | AdamW state | all-gather calls / KiB | reduce-scatter calls / KiB "
        "| all-reduce calls / KiB | loss all_gather calls / KiB | max abs weight diff vs DDP |"
    )
    print("|" + "---|" * 12)
    ddp = {r["n"]: r["weights"] for r in results if r["mode"] == "ddp"}
    for r in results:
        a = _analytic(r["mode"], r["n"], r["params_total"], r["params_root"], r["params_trainable"])
        c = r["collectives"]

        def col(*names, formula=None):
            calls = sum(c.get(k, [0, 0])[0] for k in names)
            size = sum(c.get(k, [0, 0])[1] for k in names) / kib
            return f"{calls} / {size:,.0f}" + (f" ({formula / kib:,.0f})" if formula is not None else "")

        print(
            f"| {r['mode']} | {r['n']} | {r['param_bytes'] / kib:,.0f} ({a['params'] / kib:,.0f}) "
            f"| {r['max_gathered_param_bytes'] / kib:,.0f} "
            f"| {r['grad_bytes_held_max'] / kib:,.0f} ({a['grads'] / kib:,.0f}) "
            f"| {r['grad_bytes_after_backward'] / kib:,.0f} | {r['optimizer_bytes'] / kib:,.0f} ({a['adam'] / kib:,.0f}) "
            f"| {col('all_gather_single', 'all_gather_into_tensor', formula=a['all_gather'])} "
            f"| {col('reduce_scatter_single', 'reduce_scatter_tensor', formula=a['reduce_scatter'])} "
            f"| {col('all_reduce', formula=a['all_reduce'])} | {col('all_gather')} "
            f"| {max(abs(x - y) for x, y in zip(r['weights'], ddp[r['n']])):.1e} |"
        )


if __name__ == "__main__":
    main()
