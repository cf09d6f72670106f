"""Checkpoints, resume, interruption and run failures: nothing is lost, nothing half-written is used.

- A checkpoint is written by the trainer into a staging folder, marked complete, then renamed to
  ``checkpoint-<step>``; a folder without the marker (a killed save, a copy in progress) is never
  resumed from.
- ``--resume`` picks the newest complete checkpoint; the trainer restores weights, optimizer, LR
  schedule, RNG states and skips the batches already trained in the epoch (the sampler's batches are
  a pure function of seed and epoch, so the order is the same).
- A stop signal (:data:`STOP_SIGNALS`: SIGINT, SIGTERM, SIGUSR1, SIGHUP) finishes the current optimizer
  step, saves a checkpoint and stops; during or after the last step the run is finished instead when
  that fits in ``train.stop_grace_seconds`` (:mod:`cembed.train.stopping`). A second signal abandons
  the run at once (:class:`~cembed.errors.RunAbandoned`), and so does a held one when another rank of
  the job has failed (the step cannot finish). Data-loader workers ignore the stop signals: a
  scheduler signals every process of the job, and the main process decides and ends them.
- A non-finite loss stops the run naming the step and the last good checkpoint (or, with
  ``train.nonfinite_loss: skip``, skips that step and counts it).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from transformers import TrainerCallback

from cembed.distributed.fsdp import SHARDED_MODEL
from cembed.distributed.peers import end_when_a_peer_fails
from cembed.errors import RunAbandoned, UserError
from cembed.files import display_path, write_json_atomic

MARKER = "cembed_checkpoint_complete.json"
STEP_LOSSES = "cembed_step_losses.json"
STAGING = ".staging"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def mark_complete(checkpoint_dir: str | Path, step: int, run: dict | None = None) -> None:
    """Write the completion marker (atomically) into a fully written checkpoint folder; ``run`` is
    what the run that wrote it was (``cembed.train.preflight.training_record``), compared on resume."""
    write_json_atomic(Path(checkpoint_dir) / MARKER, {"step": step, "time": time.time(), "run": run})


def recorded_run(checkpoint_dir: str | Path) -> dict | None:
    """The run record a checkpoint's marker holds, or None (an older checkpoint, an unreadable marker)."""
    try:
        return json.loads((Path(checkpoint_dir) / MARKER).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def write_step_losses(checkpoint_dir: str | Path, step_losses: list[tuple[int, float]]) -> None:
    """Keep every optimizer step's loss so far (``[(step, loss)]``, the global step's) in a checkpoint
    being written, so that a resumed run's ``run_summary.json`` has the steps before it too."""
    write_json_atomic(Path(checkpoint_dir) / STEP_LOSSES, [[step, loss] for step, loss in step_losses])


def read_step_losses(checkpoint_dir: str | Path) -> dict[int, float]:
    """``{step: loss}`` kept by :func:`write_step_losses`; empty for a checkpoint without them (an older
    cembed's) or an unreadable file."""
    try:
        return {int(step): float(loss) for step, loss in json.loads((Path(checkpoint_dir) / STEP_LOSSES).read_text())}
    except (OSError, ValueError, TypeError):
        return {}


def is_complete(checkpoint_dir: str | Path) -> bool:
    return (Path(checkpoint_dir) / MARKER).is_file()


def checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-<step>`` folders in ``output_dir``, oldest step first (complete or not)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_complete(output_dir: str | Path) -> Path | None:
    """The newest checkpoint that carries the completion marker, or ``None``."""
    complete = [p for p in checkpoints(output_dir) if is_complete(p)]
    return complete[-1] if complete else None


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete checkpoint folders without the marker and any staging leftovers; return them."""
    removed = [p for p in checkpoints(output_dir) if not is_complete(p)]
    staging = Path(output_dir) / STAGING
    for p in removed + ([staging] if staging.exists() else []):
        shutil.rmtree(p, ignore_errors=True)
    return removed


def remove_checkpoints(output_dir: str | Path) -> list[Path]:
    """Delete every ``checkpoint-<step>`` folder in ``output_dir`` (a fresh run with ``--overwrite``:
    a later ``--resume`` must not pick the replaced run's newest); return them."""
    removed = checkpoints(output_dir)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def resolve_resume(output_dir: str | Path, resume: bool, resume_from: str | None) -> str | None:
    """The checkpoint to resume from, or ``None`` for a fresh run.

    Raises:
        UserError: ``--resume`` with no complete checkpoint in ``output_dir``, or a
            ``--resume-from`` path that is not a complete checkpoint.
    """
    if resume_from:
        path = Path(resume_from)
        if not path.is_dir():
            raise UserError(f"--resume-from {path}: no such checkpoint folder")
        if not is_complete(path):
            raise UserError(f"--resume-from {path}: not a complete cembed checkpoint (no {MARKER})")
        return str(path)
    if not resume:
        return None
    found = latest_complete(output_dir)
    if found is None:
        raise UserError(f"--resume: no complete checkpoint in {display_path(output_dir)}; start without --resume")
    return str(found)


def later_checkpoints(output_dir: str | Path, checkpoint: str | Path) -> list[Path]:
    """The complete checkpoints of ``output_dir`` saved at a later step than ``checkpoint``, when
    ``checkpoint`` is one of that folder's (a ``--resume-from`` an earlier step of the run): a
    continuation that a run resumed from ``checkpoint`` replaces. Oldest step first; empty otherwise."""
    start = Path(checkpoint)
    if start.resolve().parent != Path(output_dir).resolve() or not _CHECKPOINT_RE.match(start.name):
        return []
    step = int(start.name.split("-")[1])
    return [p for p in checkpoints(output_dir) if int(p.name.split("-")[1]) > step and is_complete(p)]


def resume_on_restart(
    output_dir: str | Path, restarts: int, resume: bool, resume_from: str | None
) -> tuple[bool, str | None]:
    """``(resume, resume_from)`` for an attempt of a run: a restart (``restarts`` > 0, by torch's
    elastic agent after a failure) continues from the newest complete checkpoint in ``output_dir``
    as ``--resume`` does; the first attempt, or a restart before any checkpoint, as it was asked."""
    if restarts > 0 and latest_complete(output_dir) is not None:
        return True, None
    return resume, resume_from


def run_status(output_dir: str | Path) -> str | None:
    """The ``status`` of the run summary in ``output_dir`` (``completed``, ``interrupted``, ``failed``,
    ``abandoned``), or None without a readable one."""
    try:
        return json.loads((Path(output_dir) / "run_summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def completed_run(output_dir: str | Path, max_steps: int | None, num_train_epochs: float | None) -> bool:
    """Whether ``output_dir`` holds this run finished: its ``run_summary.json`` says ``completed``, its
    final model is saved (``modules.json``), and the summary's config asked for the same length
    (``train.max_steps``, ``train.num_train_epochs``). A requeued job's ``--resume`` of such a run has
    nothing left to do; a run asked to be longer is not this one (its resume is refused, naming why).
    False for a folder without a readable summary that records its config."""
    out = Path(output_dir)
    try:
        summary = json.loads((out / "run_summary.json").read_text())
        train = summary["config"]["train"]
        length = (train["max_steps"], train["num_train_epochs"])
        status = summary["status"]
    except (OSError, ValueError, TypeError, KeyError):
        return False
    return status == "completed" and (out / "modules.json").is_file() and length == (max_steps, num_train_epochs)


def check_output_dir(output_dir: str | Path, overwrite: bool, resuming: bool) -> None:
    """Refuse to train into a folder that holds a finished model, or a stopped run to resume, unless told to.

    Raises:
        UserError: ``output_dir`` holds a finished model (a completed ``run_summary.json`` or a saved
            SentenceTransformer), or a complete checkpoint of a run that did not finish (interrupted,
            failed, killed), and neither ``--overwrite`` nor ``--resume`` was given.
    """
    out = Path(output_dir)
    if overwrite or resuming or not out.is_dir():
        return
    finished = (out / "modules.json").exists() or run_status(out) == "completed"
    last = latest_complete(out)
    if finished:
        resumable = ", --resume to continue it" if last else ""
        raise UserError(
            f"train.output_dir {display_path(out)} holds a finished model; pass --overwrite to replace it{resumable}, "
            "or choose another output_dir"
        )
    if last is not None:
        # A fresh run here would write its checkpoints beside the stopped run's, and a later --resume
        # would pick the newest of either run.
        raise UserError(
            f"train.output_dir {display_path(out)} holds a stopped run's checkpoint ({last.name}): continue it with "
            "--resume, start again with --overwrite (its checkpoints are removed), or choose another output_dir"
        )


def checkpoint_progress(checkpoint: str | Path) -> tuple[int, int]:
    """``(step, max_steps)`` of a checkpoint: the optimizer step it was saved at and the steps its
    run planned (0 when its ``trainer_state.json`` does not say).

    Raises:
        UserError: no readable ``trainer_state.json`` in the folder.
    """
    state_file = Path(checkpoint) / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        raise UserError(f"{checkpoint}: no readable trainer_state.json; resume from another checkpoint") from None
    return int(state.get("global_step", 0)), int(state.get("max_steps", 0))


def check_resume_point(checkpoint: str, max_steps: int | None, finished: bool = False) -> None:
    """Refuse a resume that cannot continue the checkpoint's run as it was. A checkpoint of the last
    step (``step == train.max_steps``: a run stopped during its final save or evaluation) is resumed:
    nothing is trained, the run's end is done (final model, evaluation, summary).

    Args:
        finished: the checkpoint's run completed (its summary says so): its last step has nothing left.

    Raises:
        UserError: the checkpoint is past ``train.max_steps``, or at it in a finished run, or
            ``train.max_steps`` differs from the one the checkpoint's LR schedule was built for.
    """
    step, planned = checkpoint_progress(checkpoint)
    if max_steps is not None and (step > max_steps or (step == max_steps and finished)):
        where = f"past train.max_steps={max_steps}"
        if step == max_steps:
            where = f"already at train.max_steps={max_steps} and its run finished"
        raise UserError(
            f"{checkpoint} is at step {step}, {where}; nothing to resume "
            "(raise train.max_steps only for a fresh run with --overwrite)"
        )
    if max_steps is not None and planned and planned != max_steps:
        raise UserError(
            f"{checkpoint} belongs to a run of {planned} steps, but train.max_steps is {max_steps}; its LR "
            f"schedule cannot be stretched: resume with train.max_steps={planned}, or start fresh with --overwrite"
        )


def is_sharded_checkpoint(checkpoint: str | Path) -> bool:
    """True for a checkpoint of a sharded (FSDP) run: its model and optimizer are
    torch.distributed.checkpoint folders, not a full ``model.safetensors`` and ``optimizer.pt``. Either
    layout resumes in either kind of run (:mod:`cembed.distributed.fsdp` reads the other one)."""
    return (Path(checkpoint) / SHARDED_MODEL).is_dir()


def rng_state_file(world_size: int, rank: int) -> str:
    """The name of the file in which the trainer saves process ``rank``'s RNG states (one process:
    ``rng_state.pth``; several: ``rng_state_<rank>.pth``)."""
    return f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth"


def holds_rng_states(checkpoint: str | Path, world_size: int) -> bool:
    """Whether ``checkpoint`` holds the RNG states of exactly ``world_size`` processes. A checkpoint of
    another world size is re-seeded on every process (:func:`reseeded`), as the resume's changes say,
    also where some files would match (2 -> 3: processes 0 and 1 would find states that belonged to
    another split of the batch, process 2 none)."""
    saved = {p.name for p in Path(checkpoint).glob("rng_state*.pth")}
    return saved == {rng_state_file(world_size, rank) for rank in range(world_size)}


def reseeded(seed: int, step: int, rank: int) -> int:
    """The seed of process ``rank``'s RNG streams on a resume at ``step`` that has no RNG state for it
    (a checkpoint of another world size): ``seed + 1_000_003 x step + rank``, a function of the run's
    seed, the step and the rank, so that the resume is reproducible and each process draws its own
    dropout masks (distinct for every step and rank below 1,000,003)."""
    return seed + 1_000_003 * step + rank


# The signals that stop a run as SIGTERM does (finish the step, save, print the --resume command):
# SIGTERM (schedulers, Kubernetes), SIGINT (Ctrl-C), SIGUSR1 (Slurm's --signal=USR1@120, submitit's
# default, PyTorch Lightning's Slurm support: pytorch/pytorch#154849, facebookincubator/submitit#1701)
# and SIGHUP (a closed terminal or ssh session; torchrun forwards it). Without a handler SIGUSR1 and
# SIGHUP end the process at once, and every step since the last checkpoint is lost. (Windows has
# neither of the last two.)
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP") if hasattr(signal, name)
)


def _kept_ignored(sig: int) -> bool:
    """Whether ``sig`` stays ignored rather than stop the run: SIGHUP where the process was started
    ignoring it (``nohup``: the run is meant to outlive its terminal)."""
    return sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) is signal.SIG_IGN


# A launched worker that gets the same signal again this soon after the first takes it for the same
# one: a scheduler signals every process of the job, and the launcher forwards what it got as well.
REPEAT_WINDOW_S = 1.0


def _ignore_stop_signals(init: Callable[[int], None] | None, worker_id: int) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if init is not None:
        init(worker_id)


def worker_init(init: Callable[[int], None] | None = None) -> Callable[[int], None]:
    """A data loader's ``worker_init_fn`` that makes the worker ignore the :data:`STOP_SIGNALS`, then runs
    ``init`` (the loader's own, e.g. the trainer's ``seed_worker``).

    A scheduler (Slurm, Kubernetes) and a terminal's Ctrl-C signal every process of the job or group,
    workers included; a worker ended by it fails the step it feeds ("DataLoader worker ... is killed
    by signal"). The main process owns the decision (:class:`InterruptCallback`) and ends its workers
    when it stops (or they end with it: torch's workers watch their parent). Picklable, for any
    start method."""
    return functools.partial(_ignore_stop_signals, init)


def _launched() -> bool:
    """Whether this process is a worker of torch's elastic launcher (which forwards its signals)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


class InterruptCallback(TrainerCallback):
    """On a stop signal (:data:`STOP_SIGNALS`; SIGHUP not under ``nohup``): finish the current optimizer
    step, save a checkpoint, stop training.

    Install with :meth:`install` (main thread only) and undo with :meth:`uninstall`; keep it installed
    through the run's end (final save, evaluation, summary), where a first signal is recorded as
    ``late`` and the recipe finishes or stops the run (:mod:`cembed.train.stopping`). A second signal
    raises :class:`~cembed.errors.RunAbandoned` at once (the step, or the run's end, is not saved);
    in a launched worker the same signal again within :data:`REPEAT_WINDOW_S` is the same one (the
    scheduler's and the launcher's forward of it). Data-loader workers ignore the stop signals
    (:func:`worker_init`; a worker forked before that runs inherits this handler, which ignores them
    there too). In a multi-process job a held signal ends the process at once when another rank
    announces its failure (:func:`cembed.distributed.peers.end_when_a_peer_fails`): the launcher
    signals the other ranks after one failed, and a rank hung mid-step would otherwise live until its SIGKILL.

    Args:
        on_signal: called on the first signal with ``(signum, step)``, ``step`` the optimizer step
            being finished, None after the last step, so a person learns at once that the keystroke
            was seen (the step and the save may take minutes). It runs in a thread of its own, not in
            the signal handler: the handler may have interrupted the main thread in the middle of a
            write to the same stream.
    """

    def __init__(self, on_signal: Callable[[int, int | None], None] | None = None) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() of the first signal (or when a peer's was learned)
        self.late = False  # the first signal came after the last step: no step to finish
        self.step = 0
        self.max_steps = 0
        self.trained = False  # the last optimizer step has ended: a signal has no step left to wait for
        self.on_signal = on_signal
        self.notice: threading.Thread | None = None  # the thread that ran on_signal (tests join it)
        self.peer_watch: threading.Thread | None = None  # ends a signalled rank whose peer failed
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()  # the process whose signals these are (install sets it; forked workers differ)

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            return  # a data-loader worker forked from the process that installed the handler: ignored
        now = time.monotonic()
        if self.signum is not None:
            if _launched() and signum == self.signum and self.at is not None and now - self.at < REPEAT_WINDOW_S:
                return
            self.uninstall()
            # the step being trained, or the one whose checkpoint a first signal asked for; None: the run's end
            raise RunAbandoned(signum, None if self.late else (self.step if self.trained else self.step + 1))
        self.signum, self.at, self.late = signum, now, self.trained
        # The launcher's SIGTERM after another rank failed: this step waits on that rank and can
        # never end, so the process ends as soon as the failure is seen in the store.
        self.peer_watch = end_when_a_peer_fails(128 + signum)
        if self.on_signal is not None:
            step = None if self.trained else self.step + 1
            self.notice = threading.Thread(target=self.on_signal, args=(signum, step), daemon=True)
            self.notice.start()

    def install(self) -> None:
        self._pid = os.getpid()
        for sig in STOP_SIGNALS:
            if not _kept_ignored(sig):
                self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step  # a resumed run's first step is the checkpoint's + 1
        self.max_steps = state.max_steps
        self.trained = bool(self.max_steps and state.global_step >= self.max_steps)  # a resume of the last step

    def on_step_end(self, args, state, control, **kwargs):
        from cembed.distributed.collectives import max_over_ranks

        self.step = state.global_step
        # In a multi-process job all ranks stop at the same step and report the same signal, even
        # if it reached only some of them (a rank that stopped alone would leave the others waiting
        # in the next all-reduce).
        seen = max_over_ranks(self.signum or 0)
        if seen and self.signum is None:  # a peer was signalled (re-read: the handler may have run meanwhile)
            self.signum, self.at = seen, time.monotonic()
        if self.signum is not None:
            control.should_save = True
            control.should_training_stop = True
        # After the last step a first signal has no step to wait for: it is `late`, and the recipe
        # finishes the run or stops it within train.stop_grace_seconds.
        self.trained = bool(self.max_steps and state.global_step >= self.max_steps) or control.should_training_stop
        return control


class TimedSaveCallback(TrainerCallback):
    """Save a checkpoint at the end of the first optimizer step that ends ``minutes`` or more after
    the last save (or the start), beside the step-count saves (``train.save_every_minutes``); and at
    the last step, as ``train.save_steps`` does, so that a run stopped during its final save or
    evaluation is finished by ``--resume`` without training again.

    Each rank reads its own clock, so the decision is taken together (a max over the ranks: one
    small all-reduce per step); a rank that saved alone would leave the others in a collective.

    Args:
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = minutes * 60
        self.clock = clock
        self.last = clock()

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        from cembed.distributed.collectives import max_over_ranks

        if max_over_ranks(int(self.clock() - self.last >= self.seconds)):
            control.should_save = True
        if state is not None and state.max_steps and state.global_step >= state.max_steps:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self.last = self.clock()
