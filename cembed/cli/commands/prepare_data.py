"""``cembed prepare-data``: tokenize a config's training source once into a prepared source (a folder of
token-id Arrow files and a manifest, :mod:`cembed.data.tokens.format`) that every run and node memory-maps
(``data.train: {kind: prepared, path: DIR}``). Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from cembed.cli.common import ConfigArg, OverridesArg, console, examples, flag, load

PREPARE_DATA_EXAMPLES = examples(
    "cembed prepare-data config.yaml --output prepared/",
    "cembed prepare-data config.yaml --output /shared/prepared --part 0/4",
    "cembed prepare-data config.yaml -o /shared/prepared --part auto   # under torchrun",
)


def prepare_data_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    output: Path = typer.Option(..., "--output", "-o", help="The folder to write (new or empty)."),
    part: Optional[str] = typer.Option(
        None,
        "--part",
        help="K/N: this node prepares the K-th of N row ranges into the shared folder; auto: from torchrun.",
    ),
    overwrite: bool = flag(False, "--overwrite/--no-overwrite", help="Replace what --output holds (one node only)."),
) -> None:
    """Tokenize a config's training source once into a prepared source (token ids, no text) to train from."""
    from cembed.data.prepare_folder import prepare_folder
    from cembed.data.tokens.writer import parse_part

    cfg = load(config, overrides)
    k_n = parse_part(part)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if part == "auto" and local_rank != 0:  # torchrun with several processes per node: one prepares
        console.print(f"local rank {local_rank}: node {k_n[0]}'s part is prepared by its local rank 0", highlight=False)
        return
    from cembed.cli.display.run import TokenizeBar

    bar = TokenizeBar(console) if console.is_terminal else None
    try:
        result = prepare_folder(cfg, output, k_n, overwrite, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.stop()
    print_prepare_result(console, result)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def print_prepare_result(console: Console, r) -> None:
    """``cembed prepare-data``'s result (:class:`cembed.data.tokens.writer.PrepareResult`)."""
    rate = f"{r.rows / r.seconds:,.0f} rows/s" if r.seconds > 0 else "-"
    who = f"part {r.part}/{r.of}: " if r.of > 1 else ""
    console.print(
        f"{who}tokenized {r.rows:,} rows into {_count(len(r.files), 'file')} ({_mb(r.bytes)}) in {r.seconds:.1f} s "
        f"({rate}, {_count(r.num_proc, 'process')})",
        highlight=False,
    )
    if not r.complete:  # this run is done; the other nodes' runs complete the folder
        many = len(r.waiting) > 1
        others = f"part{'s' if many else ''} {', '.join(map(str, r.waiting))} of {r.of} {'are' if many else 'is'}"
        runs = ", ".join(f"--part {k}/{r.of}" for k in r.waiting)
        console.print(
            f"part {r.part}/{r.of} is prepared; the folder is complete once {others} too "
            f"(cembed prepare-data CONFIG -o {r.folder} {runs}): the last part to finish writes the manifest",
            highlight=False,
            markup=False,
        )
        return
    console.print(
        f"prepared {r.folder}: {r.total_rows:,} rows, {_count(r.total_files, 'part')}, {_mb(r.disk_bytes)} on disk "
        f"({r.bytes_per_row:,.1f} B/row); token ids alone: {_mb(r.total_token_bytes)} "
        f"(4 B/token + 4 B/row per column); disk / ids = {r.ratio:.3f}",
        highlight=False,
    )
    console.print(
        f"fingerprint {r.fingerprint}; train from it with data.train: {{kind: prepared, path: {r.folder}}}",
        highlight=False,
        markup=False,
    )
