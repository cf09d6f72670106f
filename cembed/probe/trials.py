"""Probe trials: one worst-case cached-loss training step at a given ``mini_batch_size``, and the
runners that execute it and measure its peak memory (used by :mod:`cembed.probe.search`'s search, run by :mod:`cembed.probe.auto`).

* :func:`~cembed.probe.worst_case.worst_case_step` (in :mod:`cembed.probe.worst_case`) is one trial's work: every
  column at ``max_seq_length`` tokens, AdamW states allocated, the cached embeddings (and their
  gradients) of the whole per-device batch, the loss over the full batch computed by the library's
  ``calculate_loss`` (chunked as in training), and mini-batches re-embedded with gradients and
  back-propagated, then an optimizer step; at a row count or at a token budget.
* :class:`CudaTrial` runs it in this process (peak = ``max_memory_reserved`` + memory others hold);
  :class:`SubprocessTrial` runs it in a child process, measuring peak resident memory on CPU
  (against ``--max-memory``) or CUDA memory after a CUDA error poisoned this process.
* :class:`TrialOutcome` is what a trial returns; :func:`is_device_failure` tells "does not fit"
  errors from bugs.

This module must not import :mod:`cembed.probe.search` or :mod:`cembed.probe.auto` (the import graph
stays one-way).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import resource
import time
from dataclasses import dataclass, replace

from cembed.errors import UserError, first_line
from cembed.files import format_bytes
from cembed.model.load import load_model, quiet_libraries
from cembed.probe.worst_case import worst_case_step

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
        rows, tokens_per_row: the mini-batch's rows and every row's width (:class:`WorstCase`), if it ran.
    """

    peak_bytes: int | None = None
    samples_per_s: float | None = None
    error: str | None = None
    rows: int | None = None
    tokens_per_row: int | None = None


def is_device_failure(exc: BaseException) -> bool:
    """True when ``exc`` means "does not fit": a CUDA out-of-memory error, another CUDA failure
    (e.g. "invalid configuration argument" from a kernel launch too large), or a host allocation
    failure. Anything else is a bug and is re-raised by the search."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and bool(_DEVICE_FAILURE.search(str(exc)))


def describe_failure(exc: BaseException) -> str:
    """``Type: first line of the message`` (160 characters at most), for the probe table."""
    return f"{type(exc).__name__}: {first_line(exc, 160)}"


@dataclass
class TrialSpec:
    """Everything a trial needs, picklable for a child process."""

    model: dict  # ModelConfig fields (name_or_path, max_seq_length, ...): how the trial loads the model
    loss: dict  # LossConfig fields
    n_columns: int
    batch_size: int
    device: str  # "cpu" | "cuda" | "cuda:<index>" (a child process after a CUDA error)
    repeats: int = 2
    world_size: int = 1  # ranks whose gathered candidates each rank's loss scores (1: no gathering)
    sort_by_length: bool = True
    precision: str = "fp32"  # the run's resolved precision (fp32 | bf16 | fp16): the step's autocast


def _load(spec: TrialSpec):
    from cembed.config.model import model_config

    return load_model(model_config(**spec.model), spec.device)


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


def _trial_child(spec: TrialSpec, size: int, conn, num_tokens: int | None = None) -> None:
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
        from cembed.config.loss import loss_config

        ran = worst_case_step(
            model,
            loss_config(**spec.loss),
            spec.n_columns,
            spec.batch_size,
            size,
            spec.precision,
            spec.repeats,
            spec.world_size,
            spec.sort_by_length,
            num_tokens,
        )
        if spec.device.startswith("cuda"):
            peak = torch.cuda.max_memory_reserved() + _cuda_other_bytes()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + offset
        conn.send(
            {
                "peak": int(peak),
                "sps": ran.samples_per_s,
                "rows": ran.rows,
                "width": ran.tokens_per_row,
                "setup": ran.setup,
            }
        )
    except UserError as err:
        conn.send({"user_error": str(err)})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which classifies it
        conn.send({"error": describe_failure(exc), "device_failure": is_device_failure(exc)})
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
    without a ``__main__`` guard, or stdin, would break it); the child only needs ``cembed.probe.trials``.
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
        self.setup: dict | None = None  # the last trial's cembed.probe.setup.trial_setup
        self.kill_above = kill_above_bytes
        self.timeout_s = timeout_s
        if spec.device == "cpu":
            self.ctx = mp.get_context("forkserver")
            self.ctx.set_forkserver_preload(
                ["torch", "sentence_transformers", "cembed.probe.trials", "cembed.model.load"]
            )
        else:
            self.ctx = mp.get_context("spawn")

    def __call__(self, size: int, num_tokens: int | None = None) -> TrialOutcome:
        """Run one trial at ``size`` rows, or at the token budget ``num_tokens`` when given."""
        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_trial_child, args=(self.spec, size, send, num_tokens), daemon=True)
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
        self.setup = msg.get("setup") or self.setup
        return TrialOutcome(msg["peak"], msg["sps"], rows=msg["rows"], tokens_per_row=msg["width"])


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
        self.setup: dict | None = None  # the last trial's cembed.probe.setup.trial_setup
        self.poisoned = False
        self.device_index = torch.cuda.current_device()  # the rank's GPU (set by init_distributed)

    def __call__(self, size: int, num_tokens: int | None = None) -> TrialOutcome:
        """Run one trial at ``size`` rows, or at the token budget ``num_tokens`` when given."""
        import torch

        from cembed.config.loss import loss_config

        if self.fallback is not None:
            return self.fallback(size) if num_tokens is None else self.fallback(size, num_tokens)
        if self.model is None:
            self.model = _load(self.spec)
        _cuda_other_bytes()
        self._clean()
        try:
            ran = worst_case_step(
                self.model,
                loss_config(**self.spec.loss),
                self.spec.n_columns,
                self.spec.batch_size,
                size,
                self.spec.precision,
                self.spec.repeats,
                self.spec.world_size,
                self.spec.sort_by_length,
                num_tokens,
            )
            peak = torch.cuda.max_memory_reserved() + _cuda_other_bytes()
            self.setup = ran.setup
            return TrialOutcome(int(peak), ran.samples_per_s, rows=ran.rows, tokens_per_row=ran.tokens_per_row)
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
