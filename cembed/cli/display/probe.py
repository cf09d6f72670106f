"""The mini-batch probe's result (a :class:`cembed.probe.search.ProbeResult`): the trials' table, the
notes and the recommendation, as ``cembed probe-minibatch`` prints it and ``cembed train`` after
probing ``mini_batch_size: auto``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from cembed.cli.common import note

if TYPE_CHECKING:
    from cembed.probe.search import ProbeResult


def probe_table(result: ProbeResult) -> Table:
    """Size (rows, or a token budget and the rows it cut), peak memory, % of the limit, samples/s,
    fits (in trial order); ``*`` marks the pick."""
    from cembed.files import format_bytes

    table = Table(
        "mini-batch",
        "peak memory",
        "of limit",
        "samples/s",
        "fits",
        title=(
            f"probe on {result.device or '?'}: limit {format_bytes(result.limit_bytes)} = "
            f"(1 - {result.margin:g}) x {format_bytes(result.capacity_bytes)}"
        ),
    )
    for r in result.trials:
        pct = f"{100 * r.peak_bytes / result.limit_bytes:.0f}%" if r.peak_bytes and result.limit_bytes else "-"
        peak = format_bytes(r.peak_bytes) if r.peak_bytes else "-"
        if r.error and r.error.startswith("over budget") and r.peak_bytes:
            peak = ">" + peak
        sps = f"{r.samples_per_s:.1f}" if r.samples_per_s else "-"
        fits = "[green]yes[/]" if r.fits else f"[red]no[/] ({r.error or 'over the limit'})"
        mark = " *" if r.size == result.recommended else ""
        size = f"{r.num_tokens} tokens ({r.size} rows)" if r.num_tokens else f"{r.size} rows"
        table.add_row(f"{size}{mark}", peak, pct, sps, fits)
    return table


def print_probe(console: Console, result: ProbeResult) -> None:
    """The probe table, notes, the recommendation with its reason and the override line (also what
    ``cembed train`` prints after probing ``mini_batch_size: auto``)."""
    from cembed.files import format_bytes
    from cembed.probe.auto import override_line

    console.print(probe_table(result))
    for text in result.notes:
        note(console, text)
    if len(result.ranks) > 1:  # each rank's own answer and peak (the job uses the minimum)
        peaks = ", ".join(
            f"rank {r['rank']} {r['recommended']} at {format_bytes(r['peak_bytes'])}" for r in result.ranks
        )
        note(console, f"per rank (size found, peak): {peaks}; limit {format_bytes(result.limit_bytes)}")
    if result.world_size > 1:
        note(console, f"the loss stage was measured over the gathered candidates of {result.world_size} ranks")
    console.print(f"recommended mini_batch_size: [bold]{result.recommended}[/] ({result.reason})", highlight=False)
    if result.recommended_num_tokens is not None:
        console.print(
            f"recommended mini_batch_num_tokens: [bold]{result.recommended_num_tokens}[/] (= {result.recommended} rows "
            f"x {result.tokens_per_row} tokens; largest that fits: {result.max_fit_num_tokens} = {result.max_fit} x "
            f"{result.tokens_per_row}); shorter rows then share a mini-batch in larger numbers",
            highlight=False,
        )
    console.print(f"override: {override_line(result)}", highlight=False)
