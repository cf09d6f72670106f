"""Probe trials: one worst-case cached-loss training step at a given ``mini_batch_size``, and the
runners that execute it and measure its peak memory (used by :mod:`cembed.probe`'s search).

* :func:`worst_case_step` is one trial's work: every column at ``max_seq_length`` tokens, AdamW states
  allocated, the cached embeddings (and their gradients) of the whole per-device batch, the loss over
  the full batch computed by the library's ``calculate_loss`` (chunked as in training), and mini-batches
  re-embedded with gradients and back-propagated, then an optimizer step.
* :class:`CudaTrial` runs it in this process (peak = ``max_memory_reserved`` + memory others hold);
  :class:`SubprocessTrial` runs it in a child process, measuring peak resident memory on CPU
  (against ``--max-memory``) or CUDA memory after a CUDA error poisoned this process.
* :class:`TrialOutcome` is what a trial returns; :func:`is_device_failure` tells "does not fit"
  errors from bugs.

This module must not import :mod:`cembed.probe` (the import graph stays one-way).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import resource
import time
from dataclasses import dataclass, replace

from cembed.errors import UserError, first_line
from cembed.model import load_model, quiet_libraries
from cembed.outputs import format_bytes

# Messages of errors that mean "this size does not fit on the device" (and not a bug in cembed).
_DEVICE_FAILURE = re.compile(
    r"out of memory|CUDA|CUBLAS|cuDNN|CUDNN|invalid configuration argument|can't allocate memory|"
    r"HIP error|NCCL|illegal memory access",
)


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


def worst_case_step(
    model,
    loss_cfg,
    n_columns: int,
    batch_size: int,
    mini_batch_size: int,
    precision: str,
    repeats: int = 2,
    world_size: int = 1,
    sort_by_length: bool = True,
) -> float:
    """Run the memory worst case of one cached-loss training step at ``mini_batch_size``.

    What is alive at the peak is what training holds: AdamW states (allocated by a real step), the
    tokenized features of the whole batch (``n_columns`` x ``batch_size`` x ``max_seq_length``, every
    text at full length), the cached embeddings of the whole batch and their gradients (from the
    library's ``calculate_loss(..., with_backward=True)``, chunked by ``mini_batch_size`` as in
    training), one mini-batch re-embedded with gradients and back-propagated into the parameters'
    gradients, and the optimizer step. The no-grad embedding pass is run for one mini-batch only (its
    activations are freed mini-batch by mini-batch, so it never exceeds the with-grad pass) and its
    output is replicated to fill the batch.

    The loss stage is the one training runs, whatever loss the config builds (a guide model loaded and
    its embeddings alive; a Matryoshka wrapper's loss per dimension): outside autocast (the trainer
    autocasts only the model's forward: fp32 scores), over ``world_size`` x ``batch_size`` gathered
    candidates per column (simulated with local copies: no collective), and, with ``sort_by_length``,
    with the sorted features and the restored-order leaves of ``LengthSortedMixin`` alive.

    Args:
        model: a SentenceTransformer on the target device (its ``max_seq_length`` is the length used).
        loss_cfg: the ``loss`` config section, of a loss that ``uses_gradient_cache`` (the module
            :func:`cembed.losses.build_loss` builds from it provides ``embed_minibatch`` and
            ``calculate_loss``).
        n_columns: texts per row (anchor, positive, negatives), >= 2.
        batch_size: ``per_device_train_batch_size``, rows.
        mini_batch_size: rows embedded at once.
        precision: fp32 | bf16 | fp16 (autocast, as the trainer runs it).
        repeats: no-grad and with-grad mini-batch passes run; the fastest of each is timed (>= 1).
        world_size: ranks whose candidates each rank's loss scores (1 without gathering).
        sort_by_length: the loss sorts each column by length (a sorted copy of the features).

    Returns:
        Estimated rows per second of a full cached step: ``n_columns`` no-grad and with-grad
        embeddings per row plus the loss stage.
    """
    import torch

    from cembed.losses import build_loss, simulated_gather

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
    loss = build_loss(model, loss_cfg, mini_batch_size, world_size > 1, sort_by_length=sort_by_length).module
    loss = loss if hasattr(loss, "embed_minibatch") else loss.loss  # MatryoshkaLoss decorates its cached loss
    sorted_copies = None
    if getattr(loss, "sort_by_length", False):  # training holds the features and their sorted copy
        from cembed.losses import _take_rows

        order = torch.arange(batch_size - 1, -1, -1, device=device)
        sorted_copies = [_take_rows(f, order) for f in features]
        loss._inverse = [order] * n_columns  # the loss stage builds its restored-order leaves
    mini = min(mini_batch_size, batch_size)
    repeats = max(1, repeats)
    with autocast():
        t_nograd = math.inf  # the fastest of `repeats` runs (the first one warms up)
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            emb, *extras, _ = loss.embed_minibatch(features[0], 0, mini, with_grad=False, copy_random_state=False)
            sync()
            t_nograd = min(t_nograd, time.perf_counter() - t0)
    sizes = [min(b + mini, batch_size) - b for b in range(0, batch_size, mini)]  # fp32, as accelerate returns them
    reps, *extras = [  # and a guide's embeddings (outputs before the RNG state), per column
        [[e.detach().float()[:n].clone() for n in sizes] for _ in range(n_columns)] for e in (emb, *extras)
    ]
    [r.requires_grad_() for col in reps for r in col]
    del emb
    sync()
    t0 = time.perf_counter()
    with simulated_gather(loss, world_size):  # outside autocast, as in training
        loss.calculate_loss(reps, *(extras or [None]), with_backward=True)
    sync()
    t_loss = time.perf_counter() - t0
    t_grad = math.inf
    for i in range(repeats):
        col = i % n_columns
        sync()
        t0 = time.perf_counter()
        with autocast():
            reps_mb = loss.embed_minibatch(features[col], 0, mini, with_grad=True, copy_random_state=False)[0]
        surrogate = torch.dot(reps_mb.flatten().float(), reps[col][0].grad.flatten().float())
        surrogate.backward()
        sync()
        t_grad = min(t_grad, time.perf_counter() - t0)
        del reps_mb, surrogate
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    del reps, features, sorted_copies, optimizer, loss
    per_row = n_columns * (t_nograd + t_grad) / mini + t_loss / batch_size
    return float(1.0 / per_row) if per_row > 0 else float("nan")


@dataclass
class TrialSpec:
    """Everything a trial needs, picklable for a child process."""

    model: dict  # ModelConfig fields (name_or_path, max_seq_length, precision, ...)
    loss: dict  # LossConfig fields
    n_columns: int
    batch_size: int
    device: str  # "cpu" | "cuda" | "cuda:<index>" (a child process after a CUDA error)
    repeats: int = 2
    world_size: int = 1  # ranks whose gathered candidates each rank's loss scores (1: no gathering)
    sort_by_length: bool = True


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

        if spec.device.startswith("cuda:"):
            torch.cuda.set_device(int(spec.device.split(":")[1]))  # the parent's GPU, not GPU 0
        model = _load(spec)
        from cembed.config import loss_config

        sps = worst_case_step(
            model,
            loss_config(**spec.loss),
            spec.n_columns,
            spec.batch_size,
            size,
            spec.model.get("precision", "fp32"),
            spec.repeats,
            spec.world_size,
            spec.sort_by_length,
        )
        if spec.device.startswith("cuda"):
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
    without a ``__main__`` guard, or stdin, would break it); the child only needs ``cembed.probe_trials``.
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
            self.ctx.set_forkserver_preload(["torch", "sentence_transformers", "cembed.probe_trials", "cembed.model"])
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
    "does not fit") after the memory is released. The device's health is checked *before* any
    cleanup call: after a sticky error (illegal address, device-side assert) every CUDA call raises,
    so the cleanup is skipped, the remaining trials run in fresh child processes on the same GPU
    (:class:`SubprocessTrial`, ``cuda:<index>``) and :attr:`poisoned` is set (this process can no
    longer use the GPU; training in it would fail). :meth:`close` never raises.
    """

    def __init__(self, spec: TrialSpec, model=None) -> None:
        import torch

        self.spec = spec
        self.model = model
        self.fallback: SubprocessTrial | None = None
        self.poisoned = False
        self.device_index = torch.cuda.current_device()  # the rank's GPU (set by init_distributed)

    def __call__(self, size: int) -> TrialOutcome:
        import torch

        from cembed.config import loss_config

        if self.fallback is not None:
            return self.fallback(size)
        if self.model is None:
            self.model = _load(self.spec)
        _cuda_other_bytes()
        self._clean()
        try:
            sps = worst_case_step(
                self.model,
                loss_config(**self.spec.loss),
                self.spec.n_columns,
                self.spec.batch_size,
                size,
                self.spec.model.get("precision", "fp32"),
                self.spec.repeats,
                self.spec.world_size,
                self.spec.sort_by_length,
            )
            peak = torch.cuda.max_memory_reserved() + _cuda_other_bytes()
            return TrialOutcome(peak_bytes=int(peak), samples_per_s=sps)
        except Exception as exc:
            if not is_device_failure(exc):
                raise
            if cuda_healthy():
                self.model.zero_grad(set_to_none=True)
                self._clean()
            else:
                self.poisoned = True
                self.model = None
                self.fallback = SubprocessTrial(replace(self.spec, device=f"cuda:{self.device_index}"))
            raise

    @staticmethod
    def _clean() -> None:
        import torch

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def close(self) -> None:
        """Release the probe's model and cached memory (before training loads its own). Never
        raises: on a poisoned context the memory cannot be released and is left as it is."""
        self.model = None
        if self.poisoned:
            return
        try:
            self._clean()
        except Exception:  # noqa: BLE001 - a cleanup failure must not hide the probe's answer
            self.poisoned = not cuda_healthy()


def cuda_healthy() -> bool:
    """Whether a tiny CUDA op still works in this process (a sticky CUDA error poisons the context)."""
    import torch

    try:
        torch.ones(1, device="cuda").add_(1).sum().item()
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False
