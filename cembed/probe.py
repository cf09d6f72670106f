"""``cembed probe-minibatch``: the largest ``mini_batch_size`` whose cached-loss training step fits.

With the cached loss (GradCache) ``mini_batch_size`` is the only setting that decides memory. The
probe measures it in the worst case instead of guessing:

* :func:`search_mini_batch` is the search, a pure function over a *trial* callable
  (``size -> TrialOutcome``) so it is testable with fakes: double from a small size until a trial
  fails, then bisect between the last success and the first failure. Every size it returns was run.
  A trial "fits" when it ran and its measured peak stays under ``(1 - margin)`` of the capacity.
* :func:`worst_case_step` is one trial's work: every column at ``max_seq_length`` tokens, AdamW states
  allocated, the cached embeddings (and their gradients) of the whole per-device batch, the loss over
  the full batch computed by the library's ``calculate_loss`` (chunked as in training), and mini-batches
  re-embedded with gradients and back-propagated, then an optimizer step.
* :class:`CudaTrial` runs it in this process (peak = ``max_memory_reserved`` + memory others hold);
  :class:`SubprocessTrial` runs it in a child process, measuring peak resident memory on CPU
  (against ``--max-memory``) or CUDA memory after a CUDA error poisoned this process.
* :func:`truncation_report`: the fraction of training rows per column longer than ``max_seq_length``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import resource
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from cembed.errors import UserError, first_line
from cembed.model import load_model, quiet_libraries, resolve_device

DEFAULT_MARGIN = 0.10
DEFAULT_CAP = 65536
KNEE_FRACTION = 0.95
START_SIZE = 8

# Messages of errors that mean "this size does not fit on the device" (and not a bug in cembed).
_DEVICE_FAILURE = re.compile(
    r"out of memory|CUDA|CUBLAS|cuDNN|CUDNN|invalid configuration argument|can't allocate memory|"
    r"HIP error|NCCL|illegal memory access",
)


# ----------------------------------------------------------------------------------------------
# The search (pure)


@dataclass
class TrialOutcome:
    """What one trial measured.

    Attributes:
        peak_bytes: peak memory of the trial in bytes (CUDA memory, or resident memory on CPU);
            ``None`` when it could not be measured.
        samples_per_s: estimated training rows per second of a full cached step at this size.
        error: why the trial did not complete (out of memory, killed over budget, ...); ``None`` if it ran.
    """

    peak_bytes: int | None = None
    samples_per_s: float | None = None
    error: str | None = None


@dataclass
class TrialRecord:
    """One tried size, in the order it was tried."""

    size: int
    fits: bool
    peak_bytes: int | None
    samples_per_s: float | None
    error: str | None = None


@dataclass
class ProbeResult:
    """The outcome of a search.

    Attributes:
        recommended: the ``mini_batch_size`` to use (a size that was run and fit).
        max_fit: the largest tried size that fit (>= ``recommended``).
        reason: one line saying why ``recommended`` was chosen.
        capacity_bytes, margin, limit_bytes: the memory the device has, the headroom fraction and
            ``(1 - margin) * capacity``, the most a fitting trial may use.
        cap: the largest size the search was allowed to try.
        trials: every tried size, in order.
    """

    recommended: int
    max_fit: int
    reason: str
    capacity_bytes: int
    margin: float
    limit_bytes: int
    cap: int
    trials: list[TrialRecord] = field(default_factory=list)
    device: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def is_device_failure(exc: BaseException) -> bool:
    """True when ``exc`` means "does not fit": a CUDA out-of-memory error, another CUDA failure
    (e.g. "invalid configuration argument" from a kernel launch too large), or a host allocation
    failure. Anything else is a bug and is re-raised by the search."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and bool(_DEVICE_FAILURE.search(str(exc)))


def _describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (160 characters at most), for the probe table."""
    return f"{type(exc).__name__}: {first_line(exc, 160)}"


def search_mini_batch(
    trial: Callable[[int], TrialOutcome],
    capacity_bytes: int,
    margin: float = DEFAULT_MARGIN,
    cap: int = DEFAULT_CAP,
    start: int = START_SIZE,
    knee_fraction: float | None = KNEE_FRACTION,
    on_trial: Callable[[TrialRecord], None] | None = None,
) -> ProbeResult:
    """Find the largest size in ``1..cap`` whose trial fits under ``(1 - margin) * capacity_bytes``.

    Doubles from ``min(start, cap)`` until a trial fails (or ``cap`` fits), then bisects between the
    last success and the first failure, so at most about ``2 * log2(cap)`` trials run and every
    returned size was run. A trial fails when it returns an outcome with ``error``, has no or too
    high a peak, or raises a device failure (:func:`is_device_failure`: CUDA out-of-memory and other
    CUDA errors). Among fitting sizes with a measured throughput, the smallest one reaching
    ``knee_fraction`` of the best samples/s is recommended (near the memory edge speed stops
    improving); ``knee_fraction=None`` always recommends the largest fitting size.

    Args:
        trial: ``size -> TrialOutcome``; may raise device failures.
        capacity_bytes: memory of the device (or the CPU budget), bytes.
        margin: headroom fraction in ``[0, 1)``.
        cap: the largest size to try (>= 1).
        start: the first size tried.
        knee_fraction: throughput fraction for the knee rule, or None.
        on_trial: called with each record as soon as it is measured (progress output).

    Returns:
        A :class:`ProbeResult`.

    Raises:
        UserError: even size 1 does not fit.
        Exception: whatever non-device error ``trial`` raises (a bug, not "does not fit").
    """
    if not 0 <= margin < 1:
        raise UserError(f"--margin: must be in [0, 1), got {margin}")
    if cap < 1:
        raise UserError(f"--max: must be at least 1, got {cap}")
    limit = (1 - margin) * capacity_bytes
    records: list[TrialRecord] = []

    def attempt(size: int) -> bool:
        try:
            out = trial(size)
        except Exception as exc:  # noqa: BLE001 - classified just below
            if not is_device_failure(exc):
                raise
            out = TrialOutcome(error=_describe(exc))
        fits = out.error is None and out.peak_bytes is not None and out.peak_bytes <= limit
        rec = TrialRecord(size, fits, out.peak_bytes, out.samples_per_s, out.error)
        records.append(rec)
        if on_trial is not None:
            on_trial(rec)
        return fits

    lo, hi = 0, None  # largest size known to fit, smallest size known not to
    size = max(1, min(start, cap))
    while True:
        if attempt(size):
            lo = size
            if size >= cap:
                break
            size = min(2 * size, cap)
        else:
            hi = size
            break
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        last = records[-1]
        why = last.error or f"peak {format_bytes(last.peak_bytes)} over the limit {format_bytes(limit)}"
        raise UserError(
            f"batch.mini_batch_size: not even 1 row fits ({why}); lower model.max_seq_length, use "
            "model.precision bf16, or give more memory (--max-memory / --margin)"
        )
    recommended, reason = choose_recommendation(records, lo, knee_fraction)
    return ProbeResult(recommended, lo, reason, int(capacity_bytes), margin, int(limit), cap, records)


def choose_recommendation(records: list[TrialRecord], max_fit: int, knee_fraction: float | None) -> tuple[int, str]:
    """The knee rule: the smallest fitting size with samples/s >= ``knee_fraction`` x the best
    measured, if it is smaller than ``max_fit``; otherwise ``max_fit``. Returns ``(size, reason)``."""
    default = (max_fit, f"largest size that fits with headroom (largest tried: {max(r.size for r in records)})")
    rated = [r for r in records if r.fits and r.samples_per_s]
    if knee_fraction is None or not rated:
        return default
    best = max(rated, key=lambda r: r.samples_per_s)
    knee = min((r for r in rated if r.samples_per_s >= knee_fraction * best.samples_per_s), key=lambda r: r.size)
    if knee.size >= max_fit:
        return default
    pct = 100 * knee.samples_per_s / best.samples_per_s
    return knee.size, (
        f"throughput knee: {knee.size} reaches {pct:.0f}% of the best measured {best.samples_per_s:.1f} samples/s "
        f"(at {best.size}); larger fitting sizes (up to {max_fit}) are not >{100 * (1 - knee_fraction):.0f}% faster "
        "and use more memory"
    )


def agree_across_ranks(size: int) -> int:
    """All ranks use the minimum: ``all_reduce(MIN)`` of ``size`` when a torch.distributed process
    group is initialized, else ``size`` unchanged."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return size
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([size], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ----------------------------------------------------------------------------------------------
# Units


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str, flag: str = "--max-memory") -> int:
    """``"8GiB"``, ``"512MiB"``, ``"8GB"``, ``"8G"`` (=GB), ``"123"`` (bytes) -> bytes.

    Raises:
        UserError: not a positive size, naming ``flag``.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{flag}: cannot read {text!r} as a memory size; write e.g. 8GiB, 512MiB or 16GB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: int | float | None) -> str:
    """Bytes -> ``"1.23 GiB"`` / ``"456.0 MiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    if n >= 1024**3:
        return f"{n / 1024**3:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB"


# ----------------------------------------------------------------------------------------------
# One worst-case cached-loss step


def worst_case_step(
    model, loss_cfg, n_columns: int, batch_size: int, mini_batch_size: int, precision: str, repeats: int = 2
) -> float:
    """Run the memory worst case of one ``cached_mnrl`` training step at ``mini_batch_size``.

    What is alive at the peak is what training holds: AdamW states (allocated by a real step), the
    tokenized features of the whole batch (``n_columns`` x ``batch_size`` x ``max_seq_length``, every
    text at full length), the cached embeddings of the whole batch and their gradients (from the
    library's ``calculate_loss(..., with_backward=True)``, chunked by ``mini_batch_size`` as in
    training), one mini-batch re-embedded with gradients and back-propagated into the parameters'
    gradients, and the optimizer step. The no-grad embedding pass is run for one mini-batch only (its
    activations are freed mini-batch by mini-batch, so it never exceeds the with-grad pass) and its
    output is replicated to fill the batch.

    Args:
        model: a SentenceTransformer on the target device (its ``max_seq_length`` is the length used).
        loss_cfg: the ``loss`` config section (scale, symmetric).
        n_columns: texts per row (anchor, positive, negatives), >= 2.
        batch_size: ``per_device_train_batch_size``, rows.
        mini_batch_size: rows embedded at once.
        precision: fp32 | bf16 | fp16 (autocast, as the trainer runs it).
        repeats: no-grad and with-grad mini-batch passes run; the fastest of each is timed (>= 1).

    Returns:
        Estimated rows per second of a full cached step: ``n_columns`` no-grad and with-grad
        embeddings per row plus the loss stage.
    """
    import contextlib

    import torch

    from cembed.losses import build_loss

    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)
    for p in params:  # a zero step allocates the AdamW states exactly as the first real step does
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    length = model.max_seq_length
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    one = preprocess(["a " * (4 * length + 8)])  # truncated to max_seq_length tokens
    features = [
        {
            k: v.expand(batch_size, *v.shape[1:]).contiguous().to(device) if torch.is_tensor(v) else v
            for k, v in one.items()
        }
        for _ in range(n_columns)
    ]
    loss = build_loss(model, loss_cfg, mini_batch_size)
    mini = min(mini_batch_size, batch_size)
    repeats = max(1, repeats)
    with autocast():
        t_nograd = math.inf  # the fastest of `repeats` runs (the first one warms up)
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            emb, _ = loss.embed_minibatch(features[0], 0, mini, with_grad=False, copy_random_state=False)
            sync()
            t_nograd = min(t_nograd, time.perf_counter() - t0)
        emb = emb.detach()
        reps = [
            [emb[: min(b + mini, batch_size) - b].clone().requires_grad_() for b in range(0, batch_size, mini)]
            for _ in range(n_columns)
        ]
        del emb
        sync()
        t0 = time.perf_counter()
        loss.calculate_loss(reps, None, with_backward=True)
        sync()
        t_loss = time.perf_counter() - t0
        t_grad = math.inf
        for i in range(repeats):
            col = i % n_columns
            sync()
            t0 = time.perf_counter()
            reps_mb, _ = loss.embed_minibatch(features[col], 0, mini, with_grad=True, copy_random_state=False)
            surrogate = torch.dot(reps_mb.flatten().float(), reps[col][0].grad.flatten().float())
            surrogate.backward()
            sync()
            t_grad = min(t_grad, time.perf_counter() - t0)
            del reps_mb, surrogate
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    del reps, features, optimizer, loss
    per_row = n_columns * (t_nograd + t_grad) / mini + t_loss / batch_size
    return float(1.0 / per_row) if per_row > 0 else float("nan")


@dataclass
class TrialSpec:
    """Everything a trial needs, picklable for a child process."""

    model: dict  # ModelConfig fields (name_or_path, max_seq_length, precision, ...)
    loss: dict  # LossConfig fields
    n_columns: int
    batch_size: int
    device: str  # "cpu" | "cuda"
    repeats: int = 2


def _load(spec: TrialSpec):
    from cembed.config import ModelConfig

    return load_model(ModelConfig(**spec.model), spec.device)


def _proc_rss(pid: int | str = "self", key: str = "VmRSS") -> int:
    """Resident memory of ``pid`` in bytes from /proc (``VmRSS`` now or ``VmHWM`` peak); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _trial_child(spec: TrialSpec, size: int, conn) -> None:
    """Child-process body: load the model, run :func:`worst_case_step`, send a result dict."""
    try:
        # Forked from a server that imported the libraries: pages it touched are shared and not yet
        # counted in this process. Count them: peak = own growth + the server's resident memory.
        offset = max(0, _proc_rss(os.getppid()) - _proc_rss())
        quiet_libraries()
        import torch

        model = _load(spec)
        from cembed.config import LossConfig

        sps = worst_case_step(
            model,
            LossConfig(**spec.loss),
            spec.n_columns,
            spec.batch_size,
            size,
            spec.model.get("precision", "fp32"),
            spec.repeats,
        )
        if spec.device == "cuda":
            peak = torch.cuda.max_memory_reserved() + _cuda_other_bytes()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + offset
        conn.send({"peak": int(peak), "sps": sps})
    except UserError as err:
        conn.send({"user_error": str(err)})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which classifies it
        conn.send({"error": _describe(exc), "device_failure": is_device_failure(exc)})
    finally:
        conn.close()


_CUDA_OTHER = 0


def _cuda_other_bytes() -> int:
    """Device memory in use but not reserved by this process's PyTorch allocator (CUDA context,
    other processes), measured when first called."""
    global _CUDA_OTHER
    if not _CUDA_OTHER:
        import torch

        free, total = torch.cuda.mem_get_info()
        _CUDA_OTHER = max(0, total - free - torch.cuda.memory_reserved())
    return _CUDA_OTHER


@contextlib.contextmanager
def _main_not_reimported():
    """Keep multiprocessing from re-running the caller's ``__main__`` script in the child (a script
    without a ``__main__`` guard, or stdin, would break it); the child only needs ``cembed.probe``.
    multiprocessing skips the re-import when the main module's spec is named ``__main__``."""
    import sys
    import types

    main = sys.modules["__main__"]
    missing = object()
    saved = main.__dict__.get("__spec__", missing)
    main.__spec__ = types.SimpleNamespace(name="__main__")
    try:
        yield
    finally:
        if saved is missing:
            del main.__spec__
        else:
            main.__spec__ = saved


class SubprocessTrial:
    """Run each trial in a fresh child process.

    On CPU the child is forked from a server process that has already imported torch and
    sentence-transformers (so a trial costs seconds, not an import); its peak resident memory is the
    measured peak, and a watchdog kills it once its resident memory passes ``kill_above_bytes``
    (``--max-memory``), so a too-large size never takes the machine down. On CUDA (used after an
    error poisoned this process's CUDA context) the child is spawned fresh.
    """

    _server_started = False

    def __init__(self, spec: TrialSpec, kill_above_bytes: int | None = None, timeout_s: float = 1800.0) -> None:
        import multiprocessing as mp

        self.spec = spec
        self.kill_above = kill_above_bytes
        self.timeout_s = timeout_s
        if spec.device == "cpu":
            self.ctx = mp.get_context("forkserver")
            self.ctx.set_forkserver_preload(["torch", "sentence_transformers", "cembed.probe", "cembed.model"])
        else:
            self.ctx = mp.get_context("spawn")

    def __call__(self, size: int) -> TrialOutcome:
        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_trial_child, args=(self.spec, size, send), daemon=True)
        with _main_not_reimported():
            proc.start()
        send.close()
        msg, seen, started = None, 0, time.monotonic()
        try:
            while True:
                if recv.poll(0.02):
                    try:
                        msg = recv.recv()
                    except EOFError:
                        msg = None
                    break
                if not proc.is_alive():
                    break
                rss = _proc_rss(proc.pid)
                seen = max(seen, rss)
                if self.kill_above and rss > self.kill_above:
                    proc.kill()
                    proc.join()
                    return TrialOutcome(peak_bytes=rss, error=f"over budget: killed at {format_bytes(rss)} resident")
                if time.monotonic() - started > self.timeout_s:
                    proc.kill()
                    proc.join()
                    return TrialOutcome(error=f"timed out after {self.timeout_s:.0f}s")
        finally:
            recv.close()
        proc.join(timeout=60)
        if msg is None:
            return TrialOutcome(peak_bytes=seen or None, error=f"trial process died (exit code {proc.exitcode})")
        if "user_error" in msg:
            raise UserError(msg["user_error"])
        if "error" in msg:
            if not msg["device_failure"]:
                raise RuntimeError(f"probe trial at mini_batch_size={size} failed: {msg['error']}")
            return TrialOutcome(error=msg["error"])
        return TrialOutcome(peak_bytes=msg["peak"], samples_per_s=msg["sps"])


class CudaTrial:
    """Run trials in this process on CUDA, with a clean allocator state for each.

    The peak is ``torch.cuda.max_memory_reserved()`` (what the caching allocator actually holds,
    which is what runs out) plus the device memory the CUDA context and other processes use.
    Out-of-memory and other CUDA errors propagate to :func:`search_mini_batch` (which counts them as
    "does not fit") after the memory is released; when such an error leaves the CUDA context unusable,
    the remaining trials run in fresh child processes (:class:`SubprocessTrial`).
    """

    def __init__(self, spec: TrialSpec, model=None) -> None:
        self.spec = spec
        self.model = model
        self.fallback: SubprocessTrial | None = None

    def __call__(self, size: int) -> TrialOutcome:
        import torch

        from cembed.config import LossConfig

        if self.fallback is not None:
            return self.fallback(size)
        if self.model is None:
            self.model = _load(self.spec)
        _cuda_other_bytes()
        self._clean()
        try:
            sps = worst_case_step(
                self.model,
                LossConfig(**self.spec.loss),
                self.spec.n_columns,
                self.spec.batch_size,
                size,
                self.spec.model.get("precision", "fp32"),
                self.spec.repeats,
            )
            peak = torch.cuda.max_memory_reserved() + _cuda_other_bytes()
            return TrialOutcome(peak_bytes=int(peak), samples_per_s=sps)
        except Exception as exc:
            if not is_device_failure(exc):
                raise
            self.model.zero_grad(set_to_none=True)
            self._clean()
            if not cuda_healthy():
                self.model = None
                self.fallback = SubprocessTrial(self.spec)
            raise

    @staticmethod
    def _clean() -> None:
        import torch

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def close(self) -> None:
        """Release the probe's model and cached memory (before training loads its own)."""
        self.model = None
        self._clean()


def cuda_healthy() -> bool:
    """Whether a tiny CUDA op still works in this process (a sticky CUDA error poisons the context)."""
    import torch

    try:
        torch.ones(1, device="cuda").add_(1).sum().item()
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def cpu_capacity() -> int:
    """Physical memory of this machine, bytes (the default CPU budget)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_probe(
    model_cfg,
    loss_cfg,
    batch_size: int,
    n_columns: int = 2,
    device: str = "auto",
    max_size: int = DEFAULT_CAP,
    margin: float = DEFAULT_MARGIN,
    max_memory: int | None = None,
    knee_fraction: float | None = KNEE_FRACTION,
    on_trial: Callable[[TrialRecord], None] | None = None,
) -> ProbeResult:
    """Probe ``mini_batch_size`` for ``model_cfg`` on ``device`` (auto | cpu | cuda).

    Args:
        model_cfg: a ModelConfig (name_or_path, max_seq_length, precision).
        loss_cfg: a LossConfig; only ``cached_mnrl`` uses a mini-batch size.
        batch_size: ``per_device_train_batch_size`` (rows); the search cap is ``min(max_size, batch_size)``.
        n_columns: texts per row.
        device: where training would run.
        max_size: ``--max``.
        margin: headroom fraction.
        max_memory: budget in bytes; default: the CUDA device's total memory, or this machine's
            physical memory on CPU.
        knee_fraction: see :func:`search_mini_batch`.

    Returns:
        The :class:`ProbeResult`, with ``recommended`` agreed across ranks (minimum).

    Raises:
        UserError: a plain (uncached) loss, fp16 on CPU, a model that cannot load, nothing fits.
    """
    if loss_cfg.name != "cached_mnrl":
        raise UserError("loss.name: probe-minibatch measures the cached loss; with 'mnrl' mini_batch_size is unused")
    if max_size < 1:
        raise UserError(f"--max: must be at least 1, got {max_size}")
    dev = resolve_device(device)
    if model_cfg.precision == "fp16" and dev == "cpu":
        raise UserError("model.precision: fp16 needs a CUDA device; use fp32 or bf16 on CPU")
    spec = TrialSpec(
        model=model_cfg.model_dump(), loss=loss_cfg.model_dump(), n_columns=n_columns, batch_size=batch_size, device=dev
    )
    cap = min(max_size, batch_size)
    notes = []
    if dev == "cuda":
        import torch

        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        capacity = min(total, max_memory) if max_memory else total
        trial = CudaTrial(spec)
    else:
        capacity = max_memory or cpu_capacity()
        if not max_memory:
            notes.append(f"no --max-memory: budget is this machine's physical memory ({format_bytes(capacity)})")
        trial = SubprocessTrial(spec, kill_above_bytes=capacity)
    try:
        result = search_mini_batch(trial, capacity, margin, cap, knee_fraction=knee_fraction, on_trial=on_trial)
    finally:
        if isinstance(trial, CudaTrial):
            trial.close()
    agreed = agree_across_ranks(result.recommended)
    if agreed != result.recommended:
        notes.append(f"this rank fits {result.recommended}; all ranks use the minimum, {agreed}")
        result.recommended = agreed
    result.device = dev
    result.notes = notes
    return result


def summary_record(result: ProbeResult) -> dict:
    """The ``mini_batch_probe`` entry of ``run_summary.json``."""
    d = result.to_dict()
    d["override"] = f"batch.mini_batch_size={result.recommended}"
    return d


def resolve_auto(
    plan, model_cfg, loss_cfg, n_columns: int, max_memory: str | None = None, margin: float = DEFAULT_MARGIN
):
    """Fill ``plan.mini_batch_size`` when the config says ``batch.mini_batch_size: auto``.

    Probes on ``plan.device`` for ``plan.per_device_train_batch_size`` rows of ``n_columns`` texts
    and returns ``(plan with the recommended size and its run-summary record, ProbeResult)``. A plan
    whose size is already set comes back unchanged with ``None``; so does a loss without mini-batches
    (its size becomes the batch size, with a warning).

    Raises:
        UserError: see :func:`run_probe`; also an unparsable ``max_memory``.
    """
    if plan.mini_batch_size is not None:
        return plan, None
    if loss_cfg.name != "cached_mnrl":
        return replace(
            plan,
            mini_batch_size=plan.per_device_train_batch_size,
            warnings=plan.warnings + (f"batch.mini_batch_size: auto has no effect with loss {loss_cfg.name}",),
        ), None
    budget = parse_bytes(max_memory) if max_memory else None
    result = run_probe(
        model_cfg, loss_cfg, plan.per_device_train_batch_size, n_columns, plan.device, margin=margin, max_memory=budget
    )
    return replace(plan, mini_batch_size=result.recommended, mini_batch_probe=summary_record(result)), result
