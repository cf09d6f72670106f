"""Per-module mutation results of the last `make mutate` (mutmut 3), as a markdown table, then every
surviving mutant by name (`mutmut show NAME` prints its diff).

mutmut keeps each mutated file's verdicts in ``mutants/<path>.py.meta`` (JSON, ``exit_code_by_key``:
mutant name -> the test run's exit code); its own ``mutmut results`` lists survivors but no counts.
The kill rate is detected / checked, detected being killed or timed out (a mutant that makes the tests
hang, e.g. a loop that never ends, is caught by the time limit); a mutant no test reached ("no tests")
counts as not killed, one not run yet ("not checked") is left out of the rate, in its own column.

Usage: python scripts/mutation_report.py [mutants folder]   (exit status 0; it reports, never fails)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code


def module_counts(meta: dict) -> Counter:
    """How many of one file's mutants ended in each mutmut status (killed, survived, no tests, ...)."""
    return Counter(status_by_exit_code[code] for code in meta["exit_code_by_key"].values())


def kill_rate(counts: Counter) -> float | None:
    """(killed + timeout) / checked, where checked is every mutant with a verdict; None before any has one."""
    checked = sum(n for status, n in counts.items() if status != "not checked")
    return (counts["killed"] + counts["timeout"]) / checked if checked else None


def survivors(meta: dict) -> list[str]:
    """The names of a file's mutants that were run and not detected (survived, no tests, suspicious, ...)."""
    return sorted(
        name
        for name, code in meta["exit_code_by_key"].items()
        if status_by_exit_code[code] not in ("killed", "timeout", "not checked")
    )


def rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f} %"


def report(mutants: Path) -> str:
    rows, names, total = [], [], Counter()
    for meta_path in sorted(mutants.rglob("*.py.meta")):
        meta = json.loads(meta_path.read_text())
        counts = module_counts(meta)
        total += counts
        module = str(meta_path.relative_to(mutants))[: -len(".meta")]
        rows.append((module, counts))
        names += survivors(meta)
    lines = [
        "| module | mutants | killed | timeout | survived | no tests | other | not run | kill rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for module, counts in rows + [("**all**", total)]:
        known = sum(counts[s] for s in ("killed", "timeout", "survived", "no tests", "not checked"))
        lines.append(
            f"| {module} | {sum(counts.values())} | {counts['killed']} | {counts['timeout']} | {counts['survived']} | "
            f"{counts['no tests']} | {sum(counts.values()) - known} | {counts['not checked']} | {rate_text(kill_rate(counts))} |"
        )
    lines += ["", f"Not killed ({len(names)}; `mutmut show NAME` for the diff):"] + [f"  {n}" for n in names]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1] if len(sys.argv) > 1 else "mutants")))
