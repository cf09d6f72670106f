"""Every exception cembed raises on purpose, and the one helper that shortens a foreign one.

- :class:`UserError`: anything the user can fix (a config value, a data file, a CLI argument). Its
  message is one or two lines naming the file, line or field and how to fix it; the CLI prints it
  and exits with code 2, never with a traceback.
- :class:`ModelRefused`: a model that needs remote code without the option, or one cembed cannot train; exit 2.
- :class:`HubUnavailable`: a :class:`UserError` for a hub dataset the hub cannot serve (offline,
  unreachable); ``validate`` warns and goes on, ``train`` stops.
- :class:`RunFailed`: training stopped on a problem in the run itself (a non-finite loss); exit 3.
- :class:`RunInterrupted`: a stop signal (SIGINT, SIGTERM, SIGUSR1, SIGHUP) stopped training after a checkpoint;
  exit 128 + signal.
- :class:`RunAbandoned`: a second stop signal stopped the run at once, nothing more saved; exit 128 + signal.
- :class:`LauncherSignalled`: the launcher of several processes got a stop signal; exit 128 + signal.
- :class:`WorkerFailed`: a launched worker process failed and the launcher stopped the others.
"""

from __future__ import annotations

import signal


class UserError(Exception):
    """A mistake in user input. ``str(err)`` is the full message shown to the user."""

    exit_code = 2


class ModelRefused(UserError):
    """A model cembed will not load as configured: it needs its own code without
    ``model.trust_remote_code``, it is a kind cembed cannot train, or ``data.prompts`` names a prompt
    it does not have. Unlike a model that cannot be
    reached (which only skips ``validate``'s truncation report), this fails ``validate`` too."""


class HubUnavailable(UserError):
    """A hub dataset that cannot be loaded because the hub is offline or unreachable (not because
    the id, subset or split is wrong). ``reason`` says which, e.g. ``offline: HF_DATASETS_OFFLINE=1``;
    ``cembed validate`` reports it as a warning and checks everything else."""

    def __init__(self, message: str, dataset_id: str, reason: str) -> None:
        super().__init__(message)
        self.dataset_id, self.reason = dataset_id, reason


class RunFailed(UserError):
    """Training stopped on a problem in the run (non-finite loss); exit code 3.

    A subclass of :class:`UserError` so that the CLI prints it as one line, not a traceback."""

    exit_code = 3


class RunInterrupted(Exception):
    """Training stopped on a stop signal (SIGINT, SIGTERM, SIGUSR1, SIGHUP) after saving a checkpoint.

    Attributes:
        stage: None for a stop after a step; after the last step, the part of the run's end that was
            not done (``"final save"``, ``"evaluation"``): a resume from ``checkpoint`` finishes it.
    """

    def __init__(self, signum: int, step: int, checkpoint: str | None, stage: str | None = None) -> None:
        self.signum, self.step, self.checkpoint, self.stage = signum, step, checkpoint, stage
        where = f"after the last step ({step}), before the {stage}" if stage else f"at step {step}"
        super().__init__(f"interrupted by {signal.Signals(signum).name} {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # shell convention: 130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1


class RunAbandoned(KeyboardInterrupt):
    """A second stop signal while the run finished its step, or its end after the last step: it stops
    at once and saves nothing more. A KeyboardInterrupt, so that no library's ``except Exception``
    takes it for an error of its own.

    Attributes:
        signum: the second signal.
        step: the optimizer step abandoned: being trained, or trained and its checkpoint being saved
            (not saved either way); None for a first signal after the last step.
        stage: the part of the run's end abandoned (``"evaluation"``; set by the recipe), if it had begun.
    """

    def __init__(self, signum: int, step: int | None = None, stage: str | None = None) -> None:
        self.signum, self.step, self.stage = signum, step, stage
        super().__init__(f"second {signal.Signals(signum).name}")

    @property
    def what(self) -> str:
        """What was abandoned: ``the evaluation`` (a part of the run's end), ``step 4`` (its training or
        its checkpoint), else ``the end of training``."""
        if self.stage:
            return f"the {self.stage}"
        return f"step {self.step}" if self.step is not None else "the end of training"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class LauncherSignalled(Exception):
    """The process that launched the workers got a stop signal (SIGTERM, SIGINT, SIGUSR1, SIGHUP) and forwarded
    it: each worker finished its step and saved a checkpoint. Exit 128 + signal, as a single process.

    Attributes:
        abandoned: a second signal came while the workers were finishing: they stopped at once,
            without saving that step.
    """

    def __init__(self, signum: int, abandoned: bool = False) -> None:
        self.signum = signum
        self.abandoned = abandoned
        name = signal.Signals(signum).name
        super().__init__(
            f"interrupted again by {name}: step abandoned, not saved" if abandoned else f"interrupted by {name}"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class WorkerFailed(Exception):
    """A worker process failed; the launcher has stopped the others.

    Attributes:
        rank: global rank of the first worker that failed.
        exitcode: its exit code (negative: killed by that signal).
        message: its recorded error (``Type: message``), or a pointer to its output above.
        restarts: how often the job was restarted before this failure (``--max-restarts``).
        not_restarted: restarts were left, but this failure was not restarted (a user error).
    """

    def __init__(self, rank: int, exitcode: int, message: str, restarts: int = 0, not_restarted: bool = False) -> None:
        self.rank, self.exitcode, self.message = rank, exitcode, message
        self.restarts, self.not_restarted = restarts, not_restarted
        super().__init__(f"rank {rank} failed with exit code {exitcode}: {message}")


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of ``str(exc)`` cut to ``limit`` characters, or the exception's
    class name when it has no message: how a library's error is quoted inside a one-line message."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return text[:limit] or exc.__class__.__name__
