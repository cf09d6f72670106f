"""``cembed train``: its options, the checks before a run (:func:`cembed.train.recipe.check_run_inputs`,
:func:`cembed.train.facts.run_facts`), the launch of several processes, and what a stopped or
failed run says. What a run prints while and after it trains is :mod:`cembed.cli.display.run`.
Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from cembed.cli.common import (
    ConfigArg,
    OverridesArg,
    console,
    err_console,
    examples,
    flag,
    load,
    make_console,
    print_plan,
    world_size_from_flags,
)
from cembed.cli.display.run import (
    RichRunDisplay,
    abandoned_message,
    interrupted_before_training,
    print_done,
    print_eval_change,
)
from cembed.errors import RunAbandoned, RunInterrupted, UserError, WorkerFailed
from cembed.files import display_path

NPROC_HELP = "Processes (GPUs) per node; >1 launches them through torch.distributed.run (torchrun)."
NNODES_HELP = "Machines taking part; run the same command on each with its own --node-rank."
RESTARTS_HELP = (
    "Restart all processes up to this many times when one fails (torchrun's elastic agent); each restart "
    "resumes from the newest complete checkpoint. A user error (exit code 2: config or data) is not restarted."
)

TRAIN_EXAMPLES = examples(
    "cembed train quickstart.yaml",
    "cembed train quickstart.yaml batch.per_device_train_batch_size=256 optim.learning_rate=1e-4",
    "cembed train quickstart.yaml --resume",
    "cembed train quickstart.yaml --nproc-per-node 4",
    "cembed train quickstart.yaml --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400",
)


def train_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    resume: bool = flag(
        False, "--resume/--no-resume", help="Continue from the newest complete checkpoint in output_dir."
    ),
    resume_from: Optional[str] = typer.Option(None, "--resume-from", help="Continue from this checkpoint folder."),
    overwrite: bool = flag(
        False,
        "--overwrite/--no-overwrite",
        help="Replace a finished model or a stopped run in output_dir (with --resume-from: the later checkpoints).",
    ),
    max_memory: Optional[str] = typer.Option(
        None, "--max-memory", help="Memory budget for mini_batch_size: auto, e.g. 8GiB."
    ),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help=NPROC_HELP),
    nnodes: int = typer.Option(1, "--nnodes", help=NNODES_HELP),
    node_rank: int = typer.Option(0, "--node-rank", help="This machine's index, 0 .. nnodes-1 (multi-node)."),
    rdzv_endpoint: Optional[str] = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of node 0, reachable from every node (multi-node)."
    ),
    peak_tflops: Optional[float] = typer.Option(
        None, "--peak-tflops", help="The GPU's dense peak TFLOP/s for MFU (same as train.peak_tflops=...)."
    ),
    max_restarts: int = typer.Option(0, "--max-restarts", help=RESTARTS_HELP),
) -> None:
    """Fine-tune a model as the config says; writes the model and run_summary.json to train.output_dir."""
    if peak_tflops is not None:
        overrides = [*(overrides or []), f"train.peak_tflops={peak_tflops}"]
    from cembed.distributed.launch import record_worker_error

    world = world_size_from_flags(nproc_per_node, nnodes)
    try:  # a config mistake answers before torch is imported (seconds)
        cfg = load(config, overrides)
    except UserError as err:
        if record_worker_error(err):  # in a worker of cembed's launcher, which shows this rank's error
            raise typer.Exit(err.exit_code) from None
        raise
    from cembed.distributed.group import is_worker

    if is_worker() and world is not None:
        raise UserError(
            "--nproc-per-node/--nnodes: this process was already started by a launcher (torchrun); drop them"
        )
    if resume and not (resume_from or overwrite) and _already_complete(cfg):
        return  # a requeued job's --resume of a run that finished: nothing to do, nothing rewritten
    # Flags every worker process must see as well.
    worker_flags = (
        (["--resume"] if resume else [])
        + (["--resume-from", resume_from] if resume_from else [])
        + (["--overwrite"] if overwrite else [])
        + (["--max-memory", max_memory] if max_memory else [])
    )
    if (world is not None and world > 1) or max_restarts:  # restarts come from the launcher, even for 1 process
        _launch_training(
            cfg,
            config,
            (overrides or []) + worker_flags,
            world or 1,
            nproc_per_node or 1,
            nnodes,
            node_rank,
            rdzv_endpoint,
            max_restarts,
            overrides or [],
        )
        return
    _train_here(cfg, config, overrides, resume, resume_from, overwrite, max_memory)


def _already_complete(cfg) -> bool:
    """Whether ``train.output_dir`` holds this run finished (:func:`cembed.train.checkpoint.completed_run`);
    then one line says so (on rank 0 under ``torchrun`` by hand) and the command exits 0. A Slurm
    requeue runs the same ``--resume`` command again after the run finished in an earlier slot."""
    from cembed.distributed.group import dist_info
    from cembed.train.checkpoint import completed_run

    t = cfg.train
    if not completed_run(t.output_dir, t.max_steps, t.num_train_epochs):
        return False
    if dist_info().is_main:
        console.print(
            f"run already complete: {display_path(t.output_dir)} holds its final model and run_summary.json "
            "(status completed); nothing to resume",
            highlight=False,
        )
    return True


def _train_here(
    cfg,
    config: Path,
    overrides: list[str] | None,
    resume: bool,
    resume_from: str | None,
    overwrite: bool,
    max_memory: str | None,
) -> None:
    """Train in this process (one process, or one launched worker): the run, then what a stopped,
    abandoned or failed run says (exit 128 + signal, 2 or 1) or the done lines."""
    from cembed.distributed.group import dist_info, leave_process_group
    from cembed.distributed.launch import launched_by_cembed, record_worker_error
    from cembed.distributed.peers import announce_failure
    from cembed.train.facts import run_facts
    from cembed.train.recipe import check_run_inputs, run_training

    # (A restart by the launcher, after a failure, continues from the newest complete checkpoint:
    # run_training decides it with the other ranks.)
    out = console if dist_info().is_main else make_console(quiet=True)  # only rank 0 prints
    display = RichRunDisplay(out)
    try:
        plan, data = check_run_inputs(cfg)
        facts = run_facts(cfg, plan, data)  # the rows the no-duplicates sampler cannot place
        summary = run_training(
            cfg,
            plan,
            data,
            display,
            resume=resume,
            resume_from=resume_from,
            overwrite=overwrite,
            max_memory=max_memory,
            warnings=facts.warnings,
        )
    except RunInterrupted as stop:
        leave_process_group()  # every rank stopped at the same step (InterruptCallback)
        if dist_info().is_main:
            extra = " ".join(overrides or [])
            # after the last step the checkpoint holds every step: --resume does the rest of the run's end
            saved = (
                f"{display_path(stop.checkpoint)} holds every step; --resume saves the final model, evaluates "
                "and writes the summary"
                if stop.stage
                else f"checkpoint saved to {display_path(stop.checkpoint)}"
            )
            err_console.print(
                f"[yellow]{stop}[/]: {saved}\nresume with: cembed train {config}{' ' + extra if extra else ''} --resume",
                highlight=False,
            )
        raise typer.Exit(stop.exit_code) from None
    except RunAbandoned as stop:  # a second signal: nothing more is saved (train.log and the summary say so)
        display.close()
        if dist_info().is_main and not launched_by_cembed():  # (cembed's launcher says it for all ranks)
            name = signal.Signals(stop.signum).name
            err_console.print(
                abandoned_message(name, stop.what, cfg.train.output_dir, config, overrides), highlight=False
            )
        raise typer.Exit(stop.exit_code) from None
    except KeyboardInterrupt:  # Ctrl-C before training started: no handler saves anything yet
        display.close()
        if dist_info().is_main:
            err_console.print(interrupted_before_training(cfg.train.output_dir, config, overrides), highlight=False)
        raise typer.Exit(130) from None
    except Exception as err:
        shown = record_worker_error(err)  # in a launched worker: the launcher shows this rank's error
        announce_failure()  # a peer held by the launcher's SIGTERM mid-step ends at once (InterruptCallback)
        if isinstance(err, UserError):
            if shown:
                raise typer.Exit(err.exit_code) from None
            raise
        _unexpected(err, cfg.train.output_dir)
    leave_process_group()
    print_done(out, summary)
    print_eval_change(out, summary)


def _unexpected(err: Exception, output_dir: str | None) -> None:
    """An exception that escaped every stage (e.g. while loading data): one line, the traceback in a
    file (``output_dir`` when it exists, else the temp folder), exit code 1."""
    import tempfile

    from cembed.errors import first_line
    from cembed.train.summary import save_traceback

    folder = output_dir if output_dir and Path(output_dir).is_dir() else tempfile.mkdtemp(prefix="cembed-error-")
    tb = save_traceback(err, folder)
    err_console.print(
        f"[bold red]error:[/] unexpected {type(err).__name__}: {escape(first_line(err, 200))} (traceback in {tb})",
        highlight=False,
        markup=True,
        soft_wrap=True,
    )
    raise typer.Exit(1) from None


def _launch_training(
    cfg,
    config: Path,
    overrides: list[str],
    world: int,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    max_restarts: int = 0,
    shown_overrides: list[str] | None = None,
) -> None:
    """Check the config here (a config mistake exits 2 before any process starts), then run
    ``python -m cembed train config overrides`` in ``nproc_per_node`` processes via torch.distributed.run.
    The data is loaded and checked by the workers only (this process holds no table, so a node's
    memory is its ranks'): a data mistake comes back as rank 0's one-line error, exit code 2.
    SIGTERM/SIGINT to this process reaches every worker, which saves and stops: exit 128 + signal,
    naming the checkpoint to resume from; the workers get ``train.stop_grace_seconds`` before they
    are killed. With ``max_restarts`` a failed worker restarts them all, each restart resuming from
    the newest complete checkpoint, except after a user error (exit code 2), which no restart changes."""
    from cembed.distributed.launch import RestartPolicy, launch, launcher_args
    from cembed.errors import LauncherSignalled
    from cembed.train.checkpoint import latest_complete
    from cembed.train.recipe import check_run_config

    launcher_args("cembed", [], nproc_per_node, nnodes, node_rank, rdzv_endpoint, max_restarts)  # flag checks only
    plan = check_run_config(cfg, world)
    print_plan(console, plan)
    console.print(
        f"launching {nproc_per_node} process(es) on node {node_rank} of {nnodes} via torch.distributed.run",
        highlight=False,
    )
    output_dir = cfg.train.output_dir
    policy = RestartPolicy(
        max_restarts,
        resume_point=lambda: getattr(latest_complete(output_dir), "name", None),
        announce=lambda line: err_console.print(f"[yellow]{escape(line)}[/]", highlight=False),
    )
    extra = " ".join(shown_overrides or [])
    resume = f"resume with: cembed train {config}{' ' + extra if extra else ''} --resume"
    started = time.time()
    try:
        launch(
            ["train", str(config.resolve()), *overrides],
            nproc_per_node,
            nnodes,
            node_rank,
            rdzv_endpoint,
            max_restarts=max_restarts,
            policy=policy,
            shutdown_timeout_s=math.ceil(cfg.train.stop_grace_seconds),
        )
    except LauncherSignalled as stop:
        name = signal.Signals(stop.signum).name
        summary = _summary_since(output_dir, started)
        if stop.abandoned:  # what rank 0 recorded as abandoned (a step, or a part of the run's end)
            what = summary.get("abandoned") if summary.get("status") == "abandoned" else None
            err_console.print(abandoned_message(name, what, output_dir, config, shown_overrides), highlight=False)
            raise typer.Exit(stop.exit_code) from None
        if summary.get("status") == "completed":  # the signal came after the last step, and the run was finished
            err_console.print(
                f"{name}: the run was finished within train.stop_grace_seconds "
                f"({cfg.train.stop_grace_seconds:g} s); model and run_summary.json in {display_path(output_dir)}",
                highlight=False,
            )
            raise typer.Exit(0) from None
        found = latest_complete(output_dir)
        saved = f"newest checkpoint {display_path(found)}" if found else "no checkpoint was saved"
        err_console.print(f"[yellow]{stop}[/]: {saved}\n{resume}", highlight=False)
        raise typer.Exit(stop.exit_code) from None
    except WorkerFailed as err:
        # exit code 2: a user mistake (the data's, found by the workers); 3: the run failed (RunFailed).
        # Both are cembed's own one-line messages: shown as one process shows them, without the class name.
        message = err.message.removeprefix("UserError: ") if err.exitcode == 2 else err.message
        message = message.removeprefix("RunFailed: ") if err.exitcode == 3 else message
        attempts = (
            "; not restarted: a user error fails every attempt alike"
            if err.not_restarted
            else (f"; after {err.restarts} restart(s)" if err.restarts else "")
        )
        err_console.print(
            f"[bold red]error:[/] rank {err.rank} failed (exit code {err.exitcode}): {escape(message)}; "
            f"the other processes were stopped{attempts}",
            highlight=False,
            markup=True,
            soft_wrap=True,
        )
        raise typer.Exit(2 if err.exitcode == 2 else 1) from None


def _summary_since(output_dir: str, started: float) -> dict:
    """The ``run_summary.json`` rank 0 wrote after ``started`` (``time.time()``: this launch), else {}."""
    import json

    summary = Path(output_dir) / "run_summary.json"
    try:
        if summary.stat().st_mtime < started:
            return {}
        return json.loads(summary.read_text())
    except (OSError, ValueError):
        return {}
