"""How a run ends when a stop signal (SIGTERM, SIGINT, SIGUSR1, SIGHUP) comes during or after its last optimizer step.

Before the last step a signal finishes the step, saves a checkpoint and stops
(:class:`cembed.train.checkpoint.InterruptCallback`). At the end there is no step left to stop
after, but the end itself (the final model's save, the evaluation, the summary) may take minutes, and
a scheduler kills the job some time after its signal (Slurm's ``--signal=TERM@120``: 120 s before the
slot ends). ``train.stop_grace_seconds`` is that time. The run is finished when what remains fits in
it, judged by the measured time of the last checkpoint save and of the last evaluation; otherwise it
stops where ``--resume`` finishes it: from the last step's checkpoint (a run that saves checkpoints
keeps one of its last step; the signal's own save makes one) nothing is trained again.

:class:`RunEnd` checks at the start of each part of the end (:data:`STAGES`). From the signal on,
``run_summary.json`` says the run was interrupted and during which part, so the folder of a process
killed during its end says so too; a finished run's summary replaces it (with ``stop_signal``).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cembed.errors import RunInterrupted
from cembed.files import append_log, write_json_atomic

FINAL_SAVE, EVALUATION = "final save", "evaluation"
STAGES = (FINAL_SAVE, EVALUATION)  # the parts of a run's end that a signal may stop before, in order


def fits_in_grace(elapsed_s: float, needed_s: float, grace_s: float) -> bool:
    """Whether work of ``needed_s`` seconds, started ``elapsed_s`` seconds after the signal, ends
    within ``grace_s`` seconds of it."""
    return elapsed_s + needed_s <= grace_s


def end_estimate(save_s: float | None, eval_s: float | None, evaluates: bool) -> tuple[float, float]:
    """``(final save and evaluation, evaluation alone)`` in seconds, from the last checkpoint save's
    time (an upper bound of the final model's: it also holds the optimizer) and the last evaluation's
    (0 for a part never measured, or no evaluation: the folder stays finishable if the guess is short)."""
    evaluation = (eval_s or 0.0) if evaluates else 0.0
    return (save_s or 0.0) + evaluation, evaluation


class RunEnd:
    """The end of one run (rank 0 writes; every rank may hold one): the part being done, the summary
    to write if a signal stops it, and the stop decision at each part.

    Args:
        interrupt: the run's :class:`cembed.train.checkpoint.InterruptCallback` (its ``signum``, ``at``).
        grace_s: ``train.stop_grace_seconds``.
        summary_path, log_path: the run's ``run_summary.json`` and ``train.log``.
        is_main: whether this process writes them.
        clock: seconds, monotonic, the clock of ``interrupt.at`` (tests pass a fake one).
    """

    def __init__(
        self,
        interrupt,
        grace_s: float,
        summary_path: Path,
        log_path: Path,
        is_main: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interrupt, self.grace_s, self.clock = interrupt, grace_s, clock
        self.summary_path, self.log_path, self.is_main = summary_path, log_path, is_main
        self.base: dict | None = None
        self.step = 0
        self.checkpoint: str | None = None  # the last step's complete checkpoint (None: the run keeps none)
        self.stage: str | None = None
        self.during: str | None = None  # where the signal found the run
        self._done = False
        self._lock = threading.Lock()

    def signalled(self, signum: int, step: int | None) -> None:
        """The first signal came (called from the notice thread): ``step`` the step being finished,
        None after the last step. During the run's end the summary says so at once."""
        with self._lock:
            self.during = f"step {step}" if step is not None else (self.stage or "the end of training")
        if self.stage is not None:
            self.record()

    def begin(self, base: dict, step: int, checkpoint: str | None) -> None:
        """Training ended at ``step``; ``base`` is the summary's common part and ``checkpoint`` the
        complete checkpoint of that step, if any."""
        self.base, self.step, self.checkpoint = base, step, checkpoint

    def stops(self, needed_s: float) -> bool:
        """Whether a signal came and the rest of the run (``needed_s`` seconds) does not fit in what
        remains of the grace, while a checkpoint of the last step lets ``--resume`` finish it (without
        one, stopping would only lose the trained steps: the run goes on)."""
        if self.interrupt.signum is None or self.checkpoint is None:
            return False
        at = self.interrupt.at if self.interrupt.at is not None else self.clock()
        return not fits_in_grace(self.clock() - at, needed_s, self.grace_s)

    def enter(self, stage: str, needed_s: float) -> None:
        """Start ``stage`` (one of :data:`STAGES`), which with the rest of the end needs ``needed_s``.

        Raises:
            RunInterrupted: a signal came and ``needed_s`` does not fit in the grace left; the
                summary says so (interrupted, before ``stage``, the checkpoint to resume).
        """
        with self._lock:
            self.stage = stage
        if self.interrupt.signum is None:
            return
        if self.stops(needed_s):
            raise self.stopped(stage)
        self.record()

    def stopped(self, stage: str) -> RunInterrupted:
        """The interruption before ``stage`` (written to the summary and the log by rank 0)."""
        err = RunInterrupted(self.interrupt.signum, self.step, self.checkpoint, stage)
        with self._lock:
            self.stage = stage
        self.record(f"{err}; checkpoint {self.checkpoint}")
        with self._lock:
            self._done = True
        return err

    def record(self, line: str | None = None) -> None:
        """Write the interrupted summary (rank 0): the step, the part of the end not done, the checkpoint."""
        with self._lock:
            if self._done or not self.is_main or self.base is None or self.interrupt.signum is None:
                return
            name = signal.Signals(self.interrupt.signum).name
            stopped = {
                "status": "interrupted",
                "signal": name,
                "steps": self.step,
                "stopped_during": self.stage,
                "checkpoint": self.checkpoint,
            }
            write_json_atomic(self.summary_path, {**self.base, **stopped})
            append_log(
                self.log_path,
                line or f"{name} after the last step ({self.step}): finishing the run, now the {self.stage}",
            )

    def finish(self) -> dict:
        """The run ended: no more interim summaries. Returns the summary's ``stop_signal`` entry
        (a signal came and the run was finished anyway), empty without a signal."""
        with self._lock:
            self._done = True
            if self.interrupt.signum is None:
                return {}
            return {
                "stop_signal": {
                    "signal": signal.Signals(self.interrupt.signum).name,
                    "during": self.during or f"step {self.step}",
                    "finished_within_s": self.grace_s,
                }
            }
