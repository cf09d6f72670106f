"""Multi-process (multi-GPU, multi-node) training on torch.distributed.

cembed does not run its own process engine: ``cembed train --nproc-per-node N`` hands the command to
torch's elastic launcher (``torch.distributed.run``, the code behind ``torchrun``), which starts N
workers per node running ``python -m cembed train ...`` with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Each worker joins the process group (NCCL on
CUDA, gloo on CPU) and trains through the sentence-transformers trainer, which wraps the model in
``DistributedDataParallel`` via accelerate.

What this module adds around that:

- :func:`launch`: build the launcher's arguments (``--nnodes``, ``--node-rank``,
  ``--rdzv-endpoint`` passed through) and turn a failed worker into :class:`WorkerFailed` naming the
  rank and its error. The launcher stops the other workers as soon as one fails.
- :func:`init_distributed`: join the group early (with ``distributed.timeout_minutes`` as the
  collectives' timeout) and pick this rank's device, so that the pre-tokenization cache can be
  written by one process per node (:func:`local_main_first`).
- :func:`main_first`: single-rank work (the first pre-tokenization, "before training" evaluation)
  while the other ranks wait on the process group's store, not in a collective, so its length is
  bounded by no collective timeout.
- :func:`freeze_unused_parameters`: parameters that never receive a gradient (the BERT pooler under
  mean pooling) are found with one small forward/backward before training and frozen, so DDP runs
  without unused-parameter detection (no per-forward graph walk, and an error rather than silence if
  a parameter is ever skipped).
- :func:`record_worker_error`: write a worker's exception where the launcher reads it, so the
  launching process can show the failing rank's message.

Exactness: sentence-transformers' gathered MNRL gives each rank the mean loss over *its own* anchors
(scored against all ranks' candidates), and the all-gather's backward sums the gradients that every
rank's loss sends to each embedding, so each rank's parameter gradient is ``world_size x`` its share
of the full-batch gradient; DDP's average over ranks then yields exactly the gradient of the
full-batch loss (the mean of the per-rank losses). ``tests/test_distributed.py`` checks loss and
updated weights against one process on the whole batch.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cembed.errors import UserError, WorkerFailed


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job, from the launcher's environment (1 process when unset)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints progress and writes outputs."""
        return self.rank == 0


def dist_info() -> DistInfo:
    """Read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (set by torchrun;
    ``LOCAL_WORLD_SIZE`` defaults to ``WORLD_SIZE``, which only holds on one node: init_distributed
    checks ``LOCAL_RANK`` against the visible GPUs when it is missing)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return DistInfo(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )


def is_worker() -> bool:
    """True inside a process started by the launcher for a job of more than one process."""
    return dist_info().world_size > 1 and "RANK" in os.environ


def backend_for(device: str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def init_distributed(device: str, timeout_minutes: float = 60.0) -> str:
    """Join the launcher's process group (``env://``) and return this rank's device.

    Args:
        device: the plan's device, ``cpu`` or ``cuda``.
        timeout_minutes: how long a collective waits for the other ranks before the job fails
            (``distributed.timeout_minutes``; NCCL's own default is 10 minutes).

    Returns:
        ``cuda:<LOCAL_RANK>`` for CUDA (also made the current device), else ``device`` unchanged.
        Without a multi-process environment nothing is initialized and ``device`` is returned.

    Raises:
        UserError: more processes on this node than visible GPUs, or CUDA without LOCAL_RANK.
    """
    import torch.distributed as dist

    info = dist_info()
    if info.world_size == 1:
        return device
    if device.startswith("cuda"):
        if "LOCAL_RANK" not in os.environ:
            raise UserError(
                f"WORLD_SIZE={info.world_size} but LOCAL_RANK is not set, so every process would use GPU 0: start "
                "the job with `cembed train --nproc-per-node N` (or torchrun), or have the launcher set LOCAL_RANK "
                "(the process's index on its node) and LOCAL_WORLD_SIZE (processes on the node)"
            )
        visible = torch.cuda.device_count()
        if "LOCAL_WORLD_SIZE" in os.environ and info.local_world_size > visible:
            raise UserError(
                f"--nproc-per-node {info.local_world_size}: only {visible} CUDA device(s) are visible on this node; "
                f"start at most {visible} processes per node"
            )
        if info.local_rank >= visible:  # launchers that do not set LOCAL_WORLD_SIZE (e.g. srun)
            raise UserError(
                f"LOCAL_RANK {info.local_rank}: only {visible} CUDA device(s) are visible on this node; "
                f"start at most {visible} processes per node"
            )
        torch.cuda.set_device(info.local_rank)
        device = f"cuda:{info.local_rank}"
    if not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group(backend=backend_for(device), timeout=timedelta(minutes=timeout_minutes))
    return device


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over all ranks (a one-element max all-reduce); ``value`` itself without
    an initialized multi-process group. Every rank must call it at the same point.

    Used for decisions that all ranks must take together, e.g. stopping on a signal that reached
    only some of them: a rank that stops alone leaves the others waiting in the next all-reduce.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather_over_ranks(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (one all-gather of float64), in rank order; ``[values]`` without an
    initialized multi-process group. Every rank must call it at the same point with as many values."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [list(values)]
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def require_same_on_all_ranks(facts: dict[str, object]) -> None:
    """Refuse, on every rank at once, a job whose ranks differ in any of ``facts``.

    For everything that decides how many collectives a step issues (mini-batch size, token budget,
    columns, rows per rank, accumulation, rows in the data): ranks that differ would pair up
    mismatched collectives, which hangs until the process-group timeout or silently sums partial
    gradients. One all-reduce of a fingerprint per fact finds a difference; only then are the values
    gathered to name them. Every rank must call it at the same point; a no-op without an initialized
    multi-process group.

    Args:
        facts: name -> a JSON-serializable value (compared by its JSON text).

    Raises:
        UserError: on every rank, naming each differing fact with each rank's value.
    """
    import json
    import zlib

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    names = list(facts)
    codes = [zlib.crc32(json.dumps(facts[n], sort_keys=True, default=str).encode()) for n in names]
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(codes + [-c for c in codes], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    highest, lowest = t[: len(names)].tolist(), [-v for v in t[len(names) :].tolist()]
    differ = [n for n, hi, lo in zip(names, highest, lowest) if hi != lo]
    if not differ:
        return
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, {n: facts[n] for n in differ})
    detail = "; ".join(f"{n}: " + ", ".join(f"rank {r} {v[n]!r}" for r, v in enumerate(values)) for n in differ)
    raise UserError(
        f"the ranks of this job disagree on what each training step does ({detail}); every rank must "
        "run the same config on the same data (same files, same overrides), or their collectives would "
        "not pair up"
    )


def leave_process_group() -> None:
    """Shut this process's group down (``torch.distributed.destroy_process_group``) before it exits.

    Call once per process, on every rank, after its last collective, and only when no rank failed
    (NCCL's teardown is collective: a failed rank waiting in it would hang instead of exiting). No
    barrier is needed: after training, nothing uses the group, and NCCL's teardown itself waits for
    the other ranks, e.g. for rank 0 to finish saving and evaluating. Why at all: left to interpreter
    exit, a gloo/NCCL thread that still needs the GIL while Python finalizes aborts the process
    ("terminate called without an active exception", SIGABRT), which the launcher reports as a
    failed rank although training succeeded. A no-op without an initialized group.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_MAIN_FIRST_WAIT_S = 7 * 24 * 3600.0  # a failed first rank ends the job through the launcher
_main_first_calls = 0


@contextmanager
def main_first(local: bool = False, run_on_others: bool = True):
    """Run the body on rank 0 (``local``: on each node's local rank 0) first; the other ranks wait,
    then run it too (``run_on_others``) or skip it (the context yields whether this rank runs it).

    The others wait on the process group's key-value store (``store.wait``), not in a collective: a
    long first run (the first pre-tokenization of a large set, "before training" evaluation) is not
    cut off by the group's collective timeout, and the waiting ranks hold no NCCL collective. The
    first rank releases them even when its body raises. Every rank must enter it at the same point
    (the key counts the calls). A no-op (yields True) without an initialized multi-process group.
    """
    global _main_first_calls
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield True
        return
    from datetime import timedelta

    info = dist_info()
    _main_first_calls += 1
    first = info.local_rank == 0 if local else info.rank == 0
    # The node: torchrun's GROUP_RANK, else the rank's block of local_world_size (launchers number ranks node by node).
    node = os.environ.get("GROUP_RANK", str(info.rank // max(1, info.local_world_size))) if local else "0"
    key = f"cembed/main_first/{_main_first_calls}/{node}"
    store = dist.distributed_c10d._get_default_store()
    if first:
        try:
            yield True
        finally:
            store.set(key, "done")
        return
    store.wait([key], timedelta(seconds=_MAIN_FIRST_WAIT_S))
    yield run_on_others


@contextmanager
def local_main_first():
    """Run the body on each node's local rank 0 first, then on the node's other ranks (which wait
    on the store, not in a collective: :func:`main_first`).

    For work that fills an on-disk cache (pre-tokenization): the first process writes it, the
    others load it. A no-op without an initialized multi-process group.
    """
    with main_first(local=True):
        yield


def unused_parameters(model, texts: list[str] | dict[str, list[str]], tasks: dict[str, str] | None = None) -> list[str]:
    """Names of the trainable parameters of ``model`` that receive no gradient when it embeds ``texts``.

    One forward per column and one backward of their sum (a row or two per column suffice: which
    parameters are reached does not depend on the text, but it can depend on the column, e.g. a
    Router sending queries and documents through different modules). The RNG state (dropout) and
    existing ``.grad`` values are restored afterwards.

    Args:
        model: a SentenceTransformer (not DDP-wrapped).
        texts: sample texts of every column (column -> texts, e.g. ``dataset[:1]``), or one list.
        tasks: column -> the task (Router route) the column is embedded with, when it has one.

    Returns:
        Parameter names as in ``model.named_parameters()``; empty when every parameter is used.
    """
    from sentence_transformers.util import batch_to_device

    columns = texts if isinstance(texts, dict) else {"texts": list(texts)}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in params]
    for _, p in params:
        p.grad = None
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            total = 0
            for column, column_texts in columns.items():
                task = (tasks or {}).get(column)
                kwargs = {"task": task} if task else {}
                features = batch_to_device(model.preprocess(list(column_texts), **kwargs), model.device)
                total = total + model(features)["sentence_embedding"].float().sum()
            total.backward()
        unused = [n for n, p in params if p.grad is None]
    finally:
        for (_, p), grad in zip(params, saved):
            p.grad = grad
    return unused


def freeze_unused_parameters(model, texts: list[str] | dict[str, list[str]]) -> list[str]:
    """Freeze (``requires_grad=False``) the parameters :func:`unused_parameters` finds, and return
    their names. Frozen parameters keep their values, which is what training would have done to
    them anyway (no gradient, so neither an update nor, in AdamW, weight decay)."""
    names = unused_parameters(model, texts)
    wanted = set(names)
    for name, param in model.named_parameters():
        if name in wanted:
            param.requires_grad_(False)
    return names


def record_worker_error(err: BaseException) -> None:
    """Write ``err`` to the error file the launcher reads (``$TORCHELASTIC_ERROR_FILE``), so the
    launching process can name the failing rank and show its message. A no-op outside a launcher."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    handler.record_exception(err)


def launcher_args(
    module: str,
    module_args: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """The ``torchrun`` command line (without the program name) that runs ``python -m module module_args``
    in ``nproc_per_node`` processes on each of ``nnodes`` nodes.

    Raises:
        UserError: a count below 1, a node rank outside ``[0, nnodes)``, or several nodes without
            ``--rdzv-endpoint`` (every node must know where rank 0's node listens).
    """
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node}: give at least 1 process per node")
    if nnodes < 1:
        raise UserError(f"--nnodes {nnodes}: give at least 1 node")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank}: must be between 0 and --nnodes - 1 ({nnodes - 1})")
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError(
            f"--nnodes {nnodes}: also give --rdzv-endpoint HOST:PORT, the address of node 0 that every node can reach"
        )
    argv = ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if rdzv_endpoint:
        argv += ["--rdzv-endpoint", rdzv_endpoint]
    return argv + ["--module", module, *module_args]


def launch(
    module_args: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    module: str = "cembed",
) -> None:
    """Run ``python -m <module> <module_args>`` in ``nproc_per_node`` worker processes through torch's
    elastic launcher, exactly as ``torchrun <launcher_args(...)>`` would, and wait for all of them.

    Single node without ``rdzv_endpoint``: the launcher picks a free local port. Several nodes: run
    the same command on every node with its own ``node_rank`` and node 0's ``rdzv_endpoint``.

    Raises:
        UserError: see :func:`launcher_args`.
        WorkerFailed: a worker exited non-zero; the launcher has already stopped the others.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = launcher_args(module, module_args, nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    args = get_args_parser().parse_args(argv)
    # A worker killed by a fatal signal (SIGSEGV, SIGABRT from native code) prints every thread's
    # Python stack first, so the launcher's "rank N failed" comes with where it happened.
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
            message = message.get("message", "")
        if not isinstance(message, str) or "elastic/errors.html" in message or not message.strip():
            message = "see its output above"
        raise WorkerFailed(rank, failure.exitcode, message.strip()) from None
