"""``cembed validate``: check the config, the data, the plan and the model without training, and
print the summary (:mod:`cembed.cli.display.validate`) or its JSON. Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

import contextlib
import json
from typing import Optional

import typer

from cembed.cli.common import ConfigArg, OverridesArg, console, examples, flag, load, world_size_from_flags
from cembed.cli.display.truncation import truncation_table
from cembed.cli.display.validate import print_first_row, print_validation, validation_report

VALIDATE_EXAMPLES = examples(
    "cembed validate quickstart.yaml",
    "cembed validate quickstart.yaml batch.per_device_train_batch_size=256 --verbose",
    "cembed validate quickstart.yaml --nproc-per-node 4",
    "cembed validate quickstart.yaml --json | jq .steps",
)


def validate_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Check for this many processes per node."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Check for this many nodes."),
    verbose: bool = flag(
        False,
        "--verbose/--no-verbose",
        "-v",
        help="After the summary, also print the full resolved config and the tables.",
    ),
    as_json: bool = flag(
        False,
        "--json/--no-json",
        help="Print only one JSON object: the summary's facts, the plan and the resolved config.",
    ),
) -> None:
    """Check config, data files and columns without training (no GPU needed); print a short summary.

    Refuses what train refuses: a model that cannot be loaded, a batch the sampler never fills.
    A hub dataset that cannot be reached (offline) is reported as a warning; the rest is checked."""
    from cembed.plugins import stdout_to_stderr

    # --json: what plugins and libraries print while the inputs are checked (a plugin's loader, a C
    # extension) goes to stderr, so stdout holds the JSON alone.
    with stdout_to_stderr() if as_json else contextlib.nullcontext():
        cfg, data, truncation, report = _checked(config, overrides, world_size_from_flags(nproc_per_node, nnodes))
    if as_json:  # stdout holds the JSON alone, for `| jq`
        typer.echo(json.dumps(report, indent=2))
        return
    print_validation(console, report)
    if verbose:
        console.print("[bold]resolved config[/]")
        console.print_json(json.dumps(report["config"]))
        if hasattr(data, "dataset"):
            print_first_row(console, data)
        if not isinstance(truncation, Exception) and truncation.columns:
            console.print(truncation_table(truncation.max_seq_length, truncation.columns))
    more = "" if verbose else " (full resolved config: --verbose; machine-readable: --json)"
    console.print(f"[green]config OK[/]{more}", highlight=False)


def _checked(config, overrides, world_size):
    """Load and check everything ``validate`` reports on: ``(config, data, truncation, report)``.

    Raises:
        UserError: whatever ``cembed train`` would refuse before training.
    """
    cfg = load(config, overrides)  # a config mistake answers before the data libraries are imported
    from transformers.utils import logging as transformers_logging

    from cembed.data.truncation import model_truncation_report
    from cembed.model.load import load_model, quiet_libraries
    from cembed.train.facts import run_facts
    from cembed.train.recipe import check_run_inputs

    # The summary is validate's output: transformers' "Loading weights" bars (on or off depending on
    # which library was imported first) would open it with noise.
    transformers_logging.disable_progress_bar()
    plan, data = check_run_inputs(cfg, world_size, allow_unloaded=True)
    # Loaded once, for the report and the sampler's hashes; train loads it first too, so a model it
    # cannot load is refused here with train's own error.
    quiet_libraries()
    model = load_model(cfg.model, "cpu")
    truncation = model_truncation_report(
        cfg.model, data, prompts_cfg=cfg.data.prompts, unpad=cfg.batch.unpad, precision=plan.precision, model=model
    )
    streamed = getattr(data, "streamed", None) is not None
    if streamed and not isinstance(truncation, Exception) and truncation.prompts is not None:
        from cembed.data.batching.stream import check_stream_prompts

        check_stream_prompts(truncation.prompts, data.columns, data.sources[0].key)  # what train refuses
    # With the model, duplicates and batchability are judged as the training sampler will judge them
    # (token ids when training pre-tokenizes), so what validate passes, train does not refuse.
    facts = run_facts(cfg, plan, data, model=model, attention=getattr(truncation, "attention", None))
    found = (*getattr(data, "warnings", ()), *facts.warnings)
    report = validation_report(cfg, plan, data, facts, truncation, found)
    return cfg, data, truncation, report
