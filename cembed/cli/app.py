"""The ``cembed`` command line: a thin layer over functions in the other modules.

User mistakes (:class:`cembed.errors.UserError`) print one or two lines in red and exit with code 2.
"""

from __future__ import annotations

import functools
import os
import sys

# Library progress bars (weights loading, shard writing) would interleave with cembed's own rich
# progress; tqdm reads this at import time, so it is set before anything imports tqdm.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from cembed.cli.mining import mine_negatives_cmd
from cembed.errors import RunInterrupted, UserError, WorkerFailed

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fine-tune sentence-embedding models with contrastive losses at batch sizes far beyond GPU memory.",
)
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


ConfigArg = Annotated[Path, typer.Argument(help="YAML config file.")]
OverridesArg = Annotated[Optional[List[str]], typer.Argument(help="section.field=value overrides.")]


def user_errors(fn):
    """Turn a UserError into a short red message and exit code 2 (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            where = (
                escape(f"[rank {os.environ['RANK']}] ")
                if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
                else ""
            )
            err_console.print(
                f"{where}[bold red]error:[/] {escape(str(err))}", highlight=False, markup=True, soft_wrap=True
            )
            raise typer.Exit(err.exit_code) from None

    return wrapper


@app.command("suggest-lr")
@user_errors
def suggest_lr_cmd(
    base_lr: float = typer.Option(..., "--base-lr", help="Learning rate tuned at --base-bs, e.g. 2e-5."),
    base_bs: int = typer.Option(..., "--base-bs", help="Batch size the base LR was tuned at, e.g. 32."),
    bs: int = typer.Option(..., "--bs", help="Samples per optimizer step now (batch x GPUs x accumulation)."),
    rule: str = typer.Option("sqrt", "--rule", help="sqrt (default) or linear."),
) -> None:
    """Suggest a learning rate for a new batch size (sqrt rule by default) and a bracket to try."""
    from cembed.cli.report import print_suggestion
    from cembed.plan.lr import suggest_lr

    print_suggestion(console, suggest_lr(base_lr, base_bs, bs, rule), base_lr, base_bs, bs)  # type: ignore[arg-type]


def _load(config: Path, overrides: list[str] | None):
    from cembed.config.file import load_config

    return load_config(config, overrides or [])


NPROC_HELP = "Processes (GPUs) per node; >1 launches them through torch.distributed.run (torchrun)."
NNODES_HELP = "Machines taking part; run the same command on each with its own --node-rank."


def _world_size(nproc_per_node: int | None, nnodes: int) -> int | None:
    """World size asked for on the command line, or None (then $WORLD_SIZE or 1)."""
    if nproc_per_node is None and nnodes == 1:
        return None
    if (nproc_per_node or 1) < 1 or nnodes < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node} / --nnodes {nnodes}: both must be at least 1")
    return (nproc_per_node or 1) * nnodes


@app.command("validate")
@user_errors
def validate_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Check for this many processes per node."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Check for this many nodes."),
) -> None:
    """Check config, data files and columns without training (no GPU needed).

    A hub dataset that cannot be reached (offline) is reported as a warning; the rest is checked."""
    from cembed.cli.report import print_truncation, print_validation
    from cembed.data.placement import unplaceable_warnings
    from cembed.train.recipe import check_run_inputs

    cfg = _load(config, overrides)
    plan, data = check_run_inputs(cfg, _world_size(nproc_per_node, nnodes), allow_unloaded=True)
    found = (*getattr(data, "warnings", ()), *unplaceable_warnings(plan, data, cfg.batch.drop_last, cfg.train.seed))
    truncation = _truncation(cfg.model, data, cfg.data.prompts, cfg.batch.unpad, plan.precision)
    pooling = None if isinstance(truncation, Exception) else truncation.pooling
    print_validation(console, cfg, plan, data, pooling, found)
    print_truncation(console, truncation)
    console.print("[green]config OK[/]")


def _truncation(model_cfg, data, prompts_cfg=None, unpad="auto", precision=None):
    """A ``ModelTruncation``, or the UserError of a model that cannot be loaded: validate and
    probe-minibatch must not need the model, so that only skips the report. A model cembed refuses
    (ModelRefused: remote code without the option, a kind it cannot train) fails the command.
    ``precision``: the run's resolved precision (the dtypes' autocast)."""
    from cembed.data.prepare import model_truncation_report
    from cembed.errors import ModelRefused

    try:
        return model_truncation_report(model_cfg, data, prompts_cfg=prompts_cfg, unpad=unpad, precision=precision)
    except ModelRefused:
        raise
    except UserError as err:
        return err


@app.command("init")
@user_errors
def init_cmd(
    out: Path = typer.Argument(..., help="The config file to write (never overwritten)."),
    data: Optional[Path] = typer.Option(
        None, "--data", help="Training data: .jsonl[.gz], .json, .csv, .tsv or .parquet."
    ),
    model: str = typer.Option("all-MiniLM-L6-v2", "--model", help="Model folder or hub id to fine-tune."),
    example: Optional[str] = typer.Option(None, "--example", help="Write a packaged example instead: quickstart."),
) -> None:
    """Write a commented starter config for a model and a data file (proposes the column roles and a
    per_device_train_batch_size the no-duplicates sampler can fill), or a packaged --example."""
    from cembed.cli.report import print_starter
    from cembed.data.starter import make_starter, write_new_file, write_starter

    if example is not None:
        from cembed.samples import example_config

        write_new_file(out, example_config(example))
        console.print(f"wrote {out} (example {example}); next: cembed train {out}", highlight=False)
        return
    if data is None:
        raise UserError("cembed init: give --data FILE (or --example quickstart)")
    starter = make_starter(out, model, data)
    write_starter(starter)
    print_starter(console, starter)


@app.command("inspect-data")
@user_errors
def inspect_data_cmd(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Report duplicates in the training data and how the no-duplicates sampler will batch it."""
    from cembed.cli.report import print_data_report
    from cembed.data.placement import inspect_data
    from cembed.data.prepare import prepare_data
    from cembed.plan.resolve import resolve_plan

    cfg = _load(config, overrides)
    plan = resolve_plan(cfg)
    data = prepare_data(cfg.data)
    batch, drop_last = plan.per_device_train_batch_size * plan.world_size, cfg.batch.drop_last or plan.world_size > 1
    print_data_report(console, inspect_data(data, batch, drop_last, cfg.train.seed, cfg.model, cfg.data.cache_dir))


@app.command("train")
@user_errors
def train_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint in output_dir."),
    resume_from: Optional[str] = typer.Option(None, "--resume-from", help="Continue from this checkpoint folder."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished model in output_dir."),
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
) -> None:
    """Fine-tune a model as the config says; writes the model and run_summary.json to train.output_dir."""
    if peak_tflops is not None:
        overrides = [*(overrides or []), f"train.peak_tflops={peak_tflops}"]
    from cembed.cli.report import make_console, print_done, print_eval_change
    from cembed.data.placement import unplaceable_warnings
    from cembed.distributed.group import dist_info, is_worker, leave_process_group
    from cembed.distributed.launch import record_worker_error
    from cembed.train.recipe import check_run_inputs, run_training

    world = _world_size(nproc_per_node, nnodes)
    if is_worker() and world is not None:
        raise UserError(
            "--nproc-per-node/--nnodes: this process was already started by a launcher (torchrun); drop them"
        )
    # Flags every worker process must see as well.
    worker_flags = (
        (["--resume"] if resume else [])
        + (["--resume-from", resume_from] if resume_from else [])
        + (["--overwrite"] if overwrite else [])
        + (["--max-memory", max_memory] if max_memory else [])
    )
    if world is not None and world > 1:
        cfg = _load(config, overrides)
        _launch_training(
            cfg, config, (overrides or []) + worker_flags, world, nproc_per_node or 1, nnodes, node_rank, rdzv_endpoint
        )
        return
    out = console if dist_info().is_main else make_console(quiet=True)  # only rank 0 prints
    cfg = None
    try:
        cfg = _load(config, overrides)
        plan, data = check_run_inputs(cfg)
        unplaced = unplaceable_warnings(plan, data, cfg.batch.drop_last, cfg.train.seed)
        summary = run_training(
            cfg,
            plan,
            data,
            out,
            resume=resume,
            resume_from=resume_from,
            overwrite=overwrite,
            max_memory=max_memory,
            warnings=unplaced,
        )
    except RunInterrupted as stop:
        leave_process_group()  # every rank stopped at the same step (InterruptCallback)
        if dist_info().is_main:
            extra = " ".join(overrides or [])
            err_console.print(
                f"[yellow]{stop}[/]: checkpoint saved to {stop.checkpoint}\n"
                f"resume with: cembed train {config}{' ' + extra if extra else ''} --resume",
                highlight=False,
            )
        raise typer.Exit(stop.exit_code) from None
    except Exception as err:
        record_worker_error(err)  # in a launched worker: the launcher shows this rank's error
        if isinstance(err, UserError):
            raise
        _unexpected(err, cfg.train.output_dir if cfg is not None else None)
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
) -> None:
    """Check config and data here (a user mistake exits 2 before any process starts), then run
    ``python -m cembed train config overrides`` in ``nproc_per_node`` processes via torch.distributed.run."""
    from cembed.cli.report import print_plan
    from cembed.distributed.launch import launch, launcher_args
    from cembed.train.recipe import check_run_inputs

    launcher_args("cembed", [], nproc_per_node, nnodes, node_rank, rdzv_endpoint)  # flag checks only
    plan, data = check_run_inputs(cfg, world)
    print_plan(console, plan, data.warnings)
    console.print(
        f"launching {nproc_per_node} process(es) on node {node_rank} of {nnodes} via torch.distributed.run",
        highlight=False,
    )
    try:
        launch(["train", str(config.resolve()), *overrides], nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    except WorkerFailed as err:
        err_console.print(
            f"[bold red]error:[/] rank {err.rank} failed (exit code {err.exitcode}): {escape(err.message)}; "
            "the other processes were stopped",
            highlight=False,
            markup=True,
            soft_wrap=True,
        )
        raise typer.Exit(2 if err.exitcode == 2 else 1) from None


@app.command("probe-minibatch")
@user_errors
def probe_minibatch_cmd(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (optional: or give --model etc.)."),
    overrides: OverridesArg = None,
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or name (overrides model.name_or_path)."),
    max_seq_length: Optional[int] = typer.Option(
        None, "--max-seq-length", help="Tokens per text (every text is probed at this length)."
    ),
    precision: Optional[str] = typer.Option(None, "--precision", help="auto | fp32 | bf16 | fp16."),
    device: Optional[str] = typer.Option(None, "--device", help="auto | cpu | cuda: where training would run."),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", help="per_device_train_batch_size (default: the config's)."
    ),
    max_size: int = typer.Option(65536, "--max", help="Largest mini_batch_size to try."),
    margin: float = typer.Option(
        0.10, "--margin", help="Headroom: a size fits if its peak stays under (1 - margin) x memory."
    ),
    max_memory: Optional[str] = typer.Option(
        None, "--max-memory", help="Memory budget, e.g. 8GiB (CPU default: physical memory)."
    ),
    write: bool = typer.Option(
        False, "--write", help="Store batch.mini_batch_size and batch.mini_batch_num_tokens in the config file."
    ),
) -> None:
    """Measure the largest mini_batch_size and token budget whose cached-loss step fits (worst case)."""
    from cembed.cli.report import print_probe, print_truncation
    from cembed.config.file import model_config_from_flags, set_yaml_value
    from cembed.config.schema import CachedMNRLLossConfig, CembedConfig
    from cembed.files import parse_bytes
    from cembed.plan.resolve import resolve_model
    from cembed.probe.auto import run_probe

    if write and config is None:
        raise UserError("--write: needs a config file to write batch.mini_batch_size into")
    cfg: CembedConfig | None = _load(config, overrides) if config is not None else None
    model_cfg = model_config_from_flags(cfg.model if cfg else None, model, max_seq_length, precision, device)
    resolved = resolve_model(model_cfg)  # device and precision auto -> what training would use here
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size: must be at least 1, got {batch_size}")
    batch = batch_size or (cfg.batch.per_device_train_batch_size if cfg else 64)
    n_columns = 2 + len(cfg.data.sources()[0].columns.negatives) if cfg else 2
    budget = parse_bytes(max_memory) if max_memory else None
    if cfg is not None:
        from cembed.data.prepare import prepare_data

        truncation = _truncation(
            model_cfg, prepare_data(cfg.data), cfg.data.prompts, cfg.batch.unpad, resolved.precision
        )
        print_truncation(console, truncation)
    console.print(
        f"probing {model_cfg.name_or_path} (max_seq_length {model_cfg.max_seq_length or 'model default'}, "
        f"{resolved.precision}) with per-device batch {batch}, {n_columns} texts per row, up to {min(max_size, batch)}",
        highlight=False,
    )
    result = run_probe(
        model_cfg,
        cfg.loss if cfg else CachedMNRLLossConfig(),
        batch,
        n_columns,
        model_cfg.device,
        precision=resolved.precision,
        max_size=max_size,
        margin=margin,
        max_memory=budget,
        strategy=cfg.distributed.strategy if cfg else "ddp",
        on_trial=lambda r: console.print(
            f"  tried {f'{r.num_tokens} tokens' if r.num_tokens else r.size}: {'fits' if r.fits else 'does not fit'}",
            highlight=False,
        ),
    )
    print_probe(console, result)
    if write:
        for key, value in (
            ("mini_batch_size", result.recommended),
            ("mini_batch_num_tokens", result.recommended_num_tokens),
        ):
            if value is not None:
                set_yaml_value(config, ("batch", key), value)
                console.print(f"wrote batch.{key}: {value} to {config}", highlight=False)


@app.command("eval")
@user_errors
def eval_cmd(
    model: str = typer.Option(
        ..., "--model", "-m", help="Saved model folder, a run's output_dir, or all-MiniLM-L6-v2."
    ),
    retrieval: Optional[List[Path]] = typer.Option(
        None,
        "--retrieval",
        "-r",
        help="BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/) or cembed:coco-captions-heldout. Repeatable.",
    ),
    sts: Optional[List[Path]] = typer.Option(
        None, "--sts", help="STS file (STS Benchmark TSV, sentence1/sentence2/score TSV or JSONL). Repeatable."
    ),
    split: str = typer.Option("test", "--split", help="qrels split of the retrieval sets: qrels/<split>.tsv."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write every metric to this JSON file."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Encoding batch size."),
    max_seq_length: Optional[int] = typer.Option(
        None, "--max-seq-length", min=1, help="Override the model's max_seq_length."
    ),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    cache_dir: Optional[Path] = typer.Option(
        None,
        "--cache-dir",
        help="Cache root: corpus embeddings in <root>/embeddings (default $CEMBED_CACHE_DIR or ~/.cache/cembed).",
    ),
    no_cache: bool = typer.Option(
        False, "--no-cache", help="Encode the corpus even when cached, and do not write the cache."
    ),
    dims: Optional[str] = typer.Option(None, "--dims", help="Also score truncated embeddings, e.g. 384,128,64."),
) -> None:
    """Score a model on retrieval (NDCG@10, MRR@10, MAP@100, Recall@10/100) and STS (cosine Spearman) sets."""
    from cembed.cli.report import encode_progress, print_dims_report, print_eval_report
    from cembed.eval.score import score_model
    from cembed.samples import resolve_sample

    # cembed:<name>: packaged data
    sets = ([resolve_sample(str(p)) or p for p in retrieval or []], [resolve_sample(str(p)) or p for p in sts or []])
    cache = None if no_cache else cache_dir
    if dims is not None:
        from cembed.eval.score import parse_dims, score_dims

        args = (split, batch_size, max_seq_length, device, cache, no_cache, json_out)
        return print_dims_report(console, score_dims(model, *sets, parse_dims(dims), *args))
    args = (split, json_out, batch_size, max_seq_length, device, cache, no_cache)
    print_eval_report(console, score_model(model, *sets, *args, progress=encode_progress(console)))


app.command("mine-negatives")(user_errors(mine_negatives_cmd))


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
