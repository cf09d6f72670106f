"""``cembed probe-minibatch``: measure the largest ``mini_batch_size`` (and token budget) whose
cached-loss step fits (:func:`cembed.probe.auto.run_probe`), from a config or the model flags;
``--write`` stores it in the config. Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from cembed.cli.common import Device, OverridesArg, Precision, console, examples, flag, load
from cembed.cli.display.probe import print_probe
from cembed.cli.display.truncation import print_truncation
from cembed.errors import UserError

if TYPE_CHECKING:
    from cembed.config.schema import ModelConfig

PROBE_MINIBATCH_EXAMPLES = examples(
    "cembed probe-minibatch quickstart.yaml --write",
    "cembed probe-minibatch --model all-MiniLM-L6-v2 --max-seq-length 128 --device cpu --max-memory 3GiB",
    "cembed probe-minibatch --model all-MiniLM-L6-v2 --max-seq-length 256 --precision bf16 --device cuda --batch-size 65536",
)


def probe_minibatch_cmd(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (optional: or give --model etc.)."),
    overrides: OverridesArg = None,
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or name (overrides model.name_or_path)."),
    max_seq_length: Optional[int] = typer.Option(
        None, "--max-seq-length", help="Tokens per text (every text is probed at this length)."
    ),
    precision: Optional[Precision] = typer.Option(
        None, "--precision", help="Training precision (default: the config's)."
    ),
    device: Optional[Device] = typer.Option(None, "--device", help="Where training would run (default: the config's)."),
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
    write: bool = flag(
        False,
        "--write/--no-write",
        help="Store batch.mini_batch_size and batch.mini_batch_num_tokens in the config file.",
    ),
) -> None:
    """Measure the largest mini_batch_size and token budget whose cached-loss step fits (worst case)."""
    if write and config is None:
        raise UserError("--write: needs a config file to write batch.mini_batch_size into")
    cfg = load(config, overrides) if config is not None else None  # config mistakes answer first
    from cembed.config.file import set_yaml_value
    from cembed.config.loss import CachedMNRLLossConfig
    from cembed.files import parse_bytes
    from cembed.plan.resolve import resolve_model
    from cembed.probe.auto import run_probe

    model_cfg = model_config_from_flags(cfg.model if cfg else None, model, max_seq_length, precision, device)
    resolved = resolve_model(model_cfg)  # device and precision auto -> what training would use here
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size: must be at least 1, got {batch_size}")
    batch = batch_size or (cfg.batch.per_device_train_batch_size if cfg else 64)
    n_columns = cfg.data.max_columns() if cfg else 2  # the widest source: the worst case of a step
    budget = parse_bytes(max_memory) if max_memory else None
    if cfg is not None:
        from cembed.data.load import load_training_data

        truncation = _truncation(
            model_cfg, load_training_data(cfg.data), cfg.data.prompts, cfg.batch.unpad, resolved.precision
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


def model_config_from_flags(
    base: ModelConfig | None, model: str | None, max_seq_length: int | None, precision: str | None, device: str | None
) -> ModelConfig:
    """``base`` (or the defaults) with the command line's model flags applied (``probe-minibatch``);
    ``None`` leaves a field as it is.

    Raises:
        UserError: a flag value the config would reject, naming the flag.
    """
    from pydantic import ValidationError

    from cembed.config.model import model_config

    fields = base.model_dump() if base is not None else {}
    flags = {
        "name_or_path": ("--model", model),
        "max_seq_length": ("--max-seq-length", max_seq_length),
        "precision": ("--precision", precision),
        "device": ("--device", device),
    }
    for key, (_, value) in flags.items():
        if value is not None:
            fields[key] = value
    try:
        return model_config(**fields)
    except ValidationError as err:
        e = err.errors()[0]
        flag = flags.get(str(e["loc"][0]), (str(e["loc"][0]), None))[0]
        raise UserError(f"{flag}: {e['msg']} (got {e.get('input')!r})") from None


def _truncation(model_cfg, data, prompts_cfg=None, unpad="auto", precision=None):
    """A ``ModelTruncation``, or the UserError of a model that cannot be loaded (``validate`` raises
    it, as train would refuse the model; ``probe-minibatch`` skips the report). A model cembed refuses
    (ModelRefused: remote code without the option, a kind it cannot train) fails the command.
    ``precision``: the run's resolved precision (the dtypes' autocast)."""
    from cembed.data.truncation import model_truncation_report
    from cembed.errors import ModelRefused

    try:
        return model_truncation_report(model_cfg, data, prompts_cfg=prompts_cfg, unpad=unpad, precision=precision)
    except ModelRefused:
        raise
    except UserError as err:
        return err
