"""``cembed estimate``: steps, tokens, FLOPs, wall time, GPU-hours, memory and disk of a run before it
starts. The arithmetic is :mod:`cembed.train.estimate`'s; this module gathers its inputs (the plan,
the pre-tokenized data's lengths, the model's shape, a device rate), prints and writes the JSON."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional

import typer

from cembed.cli.common import ConfigArg, OverridesArg, console, examples, load, world_size_from_flags
from cembed.errors import UserError

ESTIMATE_EXAMPLES = examples(
    "cembed estimate quickstart.yaml --calibrate 3",
    "cembed estimate quickstart.yaml --gpu H100-SXM --nproc-per-node 8 --mfu 0.35",
    "cembed estimate quickstart.yaml --gpu A100 --json estimate.json batch.per_device_train_batch_size=4096",
)

ASSUMED_MFU = 0.3  # a middle value for BERT-size encoders under the 4-pass cached count (assumed)


def estimate_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Devices per node of the run."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes of the run."),
    gpu: Optional[str] = typer.Option(
        None, "--gpu", help="Target GPU from the datasheet table (e.g. H100-SXM, A100); default: this machine."
    ),
    mfu: Optional[float] = typer.Option(
        None, "--mfu", help=f"Model FLOPs utilisation on the target (0-1; default {ASSUMED_MFU}, assumed)."
    ),
    calibrate: Optional[int] = typer.Option(
        None, "--calibrate", min=1, help="Run this many real training steps here and use the measured rate."
    ),
    json_path: Optional[Path] = typer.Option(
        None, "--json", help="Write the estimate here (default: <train.output_dir>/estimate.json)."
    ),
) -> None:
    """Predict a run's steps, tokens, FLOPs, wall time, GPU-hours, memory and checkpoint size.

    Each number says where it comes from: measured (on this machine), datasheet (NVIDIA's peaks),
    assumed (an MFU not given), or the numbers it is computed from. Works on a CPU for a GPU target."""
    cfg = load(config, overrides)  # a config mistake answers before torch is imported
    from cembed.train.estimate import gpu_peak

    if gpu is not None:
        gpu_peak(gpu, cfg.model.precision)  # an unknown name answers before the data is loaded
    report = build_estimate(cfg, world_size_from_flags(nproc_per_node, nnodes), gpu, mfu, calibrate)
    out = json_path or Path(cfg.train.output_dir) / "estimate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_estimate(report)
    console.print(f"written to {out}", highlight=False)


def build_estimate(cfg, world: int | None, gpu: str | None, mfu: float | None, calibrate: int | None) -> dict:
    """The estimate of ``cfg``'s run on ``world`` devices (None: $WORLD_SIZE or 1) of ``gpu`` (None:
    this machine) as a JSON-ready dict (see :func:`cembed.train.estimate.estimate_run`).

    Raises:
        UserError: no rate can be had (a CPU without --gpu or --calibrate), a bad --mfu, or what
            ``cembed validate`` refuses.
    """
    from transformers.utils import logging as transformers_logging

    from cembed.data.identity import TOKEN_SUFFIX
    from cembed.data.prompts import training_prompts
    from cembed.data.tokens.tokenize import tokenize_stage
    from cembed.model.kinds.lookup import kind_of
    from cembed.model.load import load_model, quiet_libraries, weight_dtypes
    from cembed.train import estimate as est
    from cembed.train.facts import run_facts
    from cembed.train.flops import model_shape
    from cembed.train.recipe import check_run_inputs

    transformers_logging.disable_progress_bar()
    quiet_libraries()  # as train and validate: no library logging on the terminal
    plan, data = check_run_inputs(cfg, world)
    model = load_model(cfg.model, "cpu", seed=cfg.train.seed)  # on CPU: a GPU target never loads CUDA
    # rows / batch, not the sampler's placement: the estimate counts what the rows allow
    facts = run_facts(cfg, plan, data, model=model, placement=False)
    steps, path = facts.steps, facts.loss
    prompts = training_prompts(data, model, cfg.data.prompts)  # the lengths training tokenizes, prompts included
    dataset, collator, info = tokenize_stage(
        model, data, True, cfg.data.cache_dir, prompts.columns, cfg.batch.pad_to_multiple_of, prompts.by_source,
        num_proc=cfg.data.num_proc,
    )  # fmt: skip
    if collator is None:
        raise UserError(f"model.name_or_path: estimate counts pre-tokenized lengths; {info['reason']}")
    id_columns = [c + TOKEN_SUFFIX for c in data.columns if c + TOKEN_SUFFIX in dataset.column_names]
    lengths = {
        c.removesuffix(TOKEN_SUFFIX): [len(x) if x is not None else None for x in dataset[c]] for c in id_columns
    }
    stats = est.token_stats(
        lengths, path.mini_batch_size, cfg.train.seed, plan.per_device_train_batch_size, path.sort_by_length,
        bool(path.packed), None if path.cached else collator.width,
    )  # fmt: skip
    n, layers, width = model_shape(model)
    devices = plan.world_size

    measured = calibrate_rate(cfg, calibrate) if calibrate else None
    rate, target = device_rate(cfg, plan, gpu, mfu, measured)
    kind = kind_of(model, default="dense")
    scoring, cache, scoring_memory = _loss_stage(cfg, plan, model, kind, stats, data.columns, path)
    run = est.estimate_run(
        stats, plan.samples_per_step, steps.per_epoch or 0, steps.total or 0, (n, layers, width, path.passes), rate,
        devices, scoring,
    )  # fmt: skip
    production = None
    if measured is not None:
        production = measured["data_wait_s_per_step"]
    where = "this machine" + (f" (the target is {gpu}: its CPUs may differ)" if gpu else "")
    probe = None
    summary_file = Path(cfg.train.output_dir) / "run_summary.json"
    if summary_file.is_file():
        probe = json.loads(summary_file.read_text()).get("mini_batch_probe")
    params = sum(p.numel() for p in model.parameters())
    precision = plan.precision if gpu is None else {"auto": "bf16"}.get(cfg.model.precision, cfg.model.precision)
    saved = weight_dtypes(model, cfg.model, precision).saved
    return {
        "target": {"device": target, "devices": devices, "precision": precision},
        "rate": {
            "flops_per_s_per_device": est.number(rate.flops_per_s, "FLOP/s", rate.source),
            "peak_flops": est.number(rate.peak_flops, "FLOP/s", rate.peak_source or "none"),
            "mfu": est.number(rate.mfu, "", rate.mfu_source or "none"),
        },
        "data": {
            "rows": est.number(stats.rows, "rows", "pre-tokenized data"),
            "rows_per_step": est.number(plan.samples_per_step, "rows", _rows_per_step_source(plan)),
            "per_device_batch": est.number(plan.per_device_train_batch_size, "rows", _per_device_source(plan)),
            "batches_per_epoch": est.number(facts.batches_per_epoch, "batches", "rows / global batch"),
            "mean_tokens_per_row": est.number(stats.mean_tokens, "tokens", "measured: pre-tokenized data"),
            "token_histogram": stats.histogram,
            "padded_share": est.number(stats.padded_share, "", f"computed on the configured path: {path.description}"),
        },
        **run,
        "memory_per_rank": est.probe_memory(probe, plan.mini_batch_size),
        "cache_per_rank": cache,
        **({"scoring_memory_per_rank": scoring_memory} if scoring_memory is not None else {}),
        "data_wait_risk": est.data_wait_risk(production, run["seconds_per_step"]["value"], where),
        "checkpoint_size": est.checkpoint_bytes(params, saved),
        "flop_model": {"N": n, "L": layers, "d": width, "passes": path.passes},
        "calibration": measured,
    }


def _loss_stage(cfg, plan, model, kind, stats, columns: list[str], path):
    """What the loss stage of a step adds, from the model kind and the loss: ``(scoring (FLOPs per
    step, source) or None, the cache per rank, the scoring memory bound per rank or None)``, each
    quantity an :func:`cembed.train.estimate.number`."""
    from cembed.plan.precision import torch_dtype
    from cembed.train import estimate as est
    from cembed.train.flops import SCORING_PASSES, scoring_flops

    rows = plan.per_device_train_batch_size
    means = [stats.mean_by_column.get(c, 0.0) for c in columns]
    layout = kind.token_layout(model, 0)
    query = float(layout.expansion.length) if layout is not None and layout.expansion is not None else means[0]
    gathered = plan.world_size if plan.gather_across_devices else 1
    per_device = scoring_flops(model, rows * query, gathered * rows * sum(means[1:]))  # the meter's formula
    scoring = None
    if per_device:
        scoring = (
            per_device * plan.world_size * plan.gradient_accumulation_steps,
            f"{plan.world_size} devices x {plan.gradient_accumulation_steps} accumulation x {per_device:.4g} "
            f"({SCORING_PASSES} passes: forward, the backward's recompute and its two products; a device's "
            f"{rows} queries x {query:.1f} tokens against {gathered} x {rows} rows x {sum(means[1:]):.1f} "
            "document tokens)",
        )
    element = torch_dtype(plan.precision).itemsize  # the cache is in the run's precision
    per_row = kind.cache_bytes_per_row(model, round(query), element)
    per_row += sum(kind.cache_bytes_per_row(model, round(m), element) for m in means[1:])
    cache = est.number(
        2 * rows * per_row,
        "bytes",
        f"{rows} rows x {per_row} bytes per row (every column's cached output at the mean length) x 2 (and gradients)",
    )
    bound = cfg.loss.scoring_memory(cfg.model.query_tokens(int(model.max_seq_length)), rows)
    scoring_memory = None if bound is None else est.number(bound[0], "bytes", f"bound: {bound[1]}, whatever the batch")
    return scoring, cache, scoring_memory


def _rows_per_step_source(plan) -> str:
    if plan.global_batch_size is not None:
        return "batch.global_batch_size"
    return "batch.per_device_train_batch_size x devices x accumulation"


def _per_device_source(plan) -> str:
    if plan.global_batch_size is not None:
        return (
            f"batch.global_batch_size / ({plan.world_size} devices x {plan.gradient_accumulation_steps} accumulation)"
        )
    return "batch.per_device_train_batch_size"


def device_rate(cfg, plan, gpu: str | None, mfu: float | None, measured: dict | None):
    """The FLOP/s of one device of the run and the target's name: ``--mfu`` x the peak (``--gpu``'s
    datasheet, ``train.peak_tflops`` or this GPU's), else the rate ``--calibrate`` measured here (when
    the target is this machine), else the peak x an assumed MFU.

    Raises:
        UserError: a CPU target without ``--calibrate``, or a bad ``--mfu``.
    """
    from cembed.train import estimate as est
    from cembed.train.flops import device_peak, matmul_precision

    if gpu is not None:
        peak, peak_source = est.gpu_peak(gpu, cfg.model.precision)
        peak_source = f"datasheet: {peak_source}"
        target = gpu
    elif cfg.train.peak_tflops is not None:
        peak, peak_source, target = cfg.train.peak_tflops * 1e12, "config: train.peak_tflops", "the configured device"
    elif plan.device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name()
        peak, peak_source = device_peak(name, matmul_precision(plan.precision, plan.device))
        peak_source, target = f"datasheet: {peak_source}", name
    else:
        peak, peak_source, target = None, "cpu: no datasheet peak", "this machine (cpu)"
    if mfu is not None and peak is not None:
        rate = est.peak_rate(peak, peak_source, mfu, "given: --mfu")
    elif measured is not None and gpu is None:  # the target is this machine: its measured rate
        share = measured["flops_per_s"] / peak if peak else None
        rate = est.Rate(measured["flops_per_s"], f"measured: {measured['rate_from']} of {measured['steps']} on this machine", peak,
                        peak_source if peak else None, share, "measured" if share else None)  # fmt: skip
    elif peak is not None:
        rate = est.peak_rate(peak, peak_source, ASSUMED_MFU, "assumed; pass --mfu or --calibrate on the target")
    else:
        raise UserError("--gpu: this machine has no datasheet peak; give --gpu NAME (and --mfu) or --calibrate STEPS")
    return rate, target


def calibrate_rate(cfg, steps: int) -> dict:
    """Run ``steps`` real training steps of ``cfg`` on this machine (the recipe's ``run_training``
    into a temporary folder, evaluation off, the meter closing an interval every step) and return
    the measured rate: ``{steps, flops_per_s, wall_time_s, data_wait_share, data_wait_s_per_step,
    rate_from}``. The rate is the median of the per-step FLOP/s after the first step (the first
    pays one-time costs: allocator, thread pools, lazy initialisation); with one step, that step's."""
    import statistics

    from cembed.train.recipe import check_run_inputs, run_training

    with tempfile.TemporaryDirectory(prefix="cembed-calibrate-") as tmp:
        train = cfg.train.model_copy(update={"max_steps": steps, "num_train_epochs": None, "output_dir": tmp,
                                              "logging_steps": 1, "save_steps": None, "push_to_hub": False,
                                              "report_to": ["none"]})  # fmt: skip
        short = cfg.model_copy(update={"train": train, "eval": None})
        plan, data = check_run_inputs(short)
        summary = run_training(short, plan, data)
    intervals = [i for i in summary["throughput_per_interval"] if i.get("flops_per_s")]
    later = intervals[1:] or intervals
    wall = summary["wall_time_s"]
    done = max(1, summary["steps_this_run"])
    flops_per_s = statistics.median(i["flops_per_s"] for i in later) if later else summary["throughput"]["flops_per_s"]
    wait = statistics.median(i.get("data_wait") or 0.0 for i in later) if later else 0.0
    return {
        "steps": done,
        "flops_per_s": flops_per_s,
        "rate_from": f"median of steps 2..{done}" if len(intervals) > 1 else "the one step",
        "wall_time_s": wall,
        "data_wait_share": wait,
        "data_wait_s_per_step": wait * wall / done,
    }


def _fmt(entry: dict) -> str:
    value, unit = entry["value"], entry["unit"]
    if isinstance(value, str) or value is None:
        return str(value)
    if unit == "s":
        return f"{value:,.1f} s ({value / 3600:.2f} h)" if value >= 3600 else f"{value:.3g} s"
    if unit == "bytes":
        from cembed.files import format_bytes

        return format_bytes(int(value))
    if unit in ("FLOP", "FLOP/s"):
        return f"{value:.3e} {unit}"
    if unit in ("tokens", "h", ""):
        return f"{value:,.4g} {unit}".strip()
    if isinstance(value, float):
        return f"{value:,.3f} {unit}".strip()
    return f"{value:,} {unit}".strip()


def print_estimate(report: dict) -> None:
    """One line per number with its source."""
    t = report["target"]
    console.print(f"[bold]estimate[/] for {t['devices']} x {t['device']} ({t['precision']})", highlight=False)
    rows = [("rate per device", report["rate"]["flops_per_s_per_device"])]
    data_keys = ("rows", "rows_per_step", "per_device_batch", "batches_per_epoch", "padded_share")
    rows += [(k.replace("_", " "), report["data"][k]) for k in data_keys]
    keys = ("steps_per_epoch", "steps", "tokens", "flops", "seconds_per_step", "epoch_seconds", "run_seconds",
            "gpu_hours", "memory_per_rank", "cache_per_rank", "scoring_memory_per_rank", "scoring_flops_per_step",
            "data_wait_risk", "checkpoint_size")  # fmt: skip
    rows += [(k.replace("_", " "), report[k]) for k in keys if k in report]
    for label, entry in rows:
        console.print(f"  {label:<18} {_fmt(entry):<28} [dim]{entry['source']}[/]", highlight=False)
