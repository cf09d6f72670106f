"""scripts/mutation_report.py: the per-module counts and kill rate from mutmut's .meta files, and the
names of the mutants that lived (a survivor, one no test reached; not a timeout, not the unrun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("mutmut")
    return load_script(REPO / "scripts" / "mutation_report.py", "mutation_report")


# mutmut's exit codes: 1 killed, 0 survived, 33 no tests, 36 timeout, None not run yet.
META = {"exit_code_by_key": {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 1, "m.x_f__mutmut_3": 0, "m.x_g__mutmut_1": 33,
                             "m.x_g__mutmut_2": 36, "m.x_g__mutmut_3": None, "m.x_g__mutmut_4": 1}}  # fmt: skip


def test_counts_rate_and_survivors(report):
    counts = report.module_counts(META)
    assert counts == {"killed": 3, "survived": 1, "no tests": 1, "timeout": 1, "not checked": 1}
    assert report.kill_rate(counts) == pytest.approx(4 / 6)  # a timeout is detected; the unrun is left out
    assert report.survivors(META) == ["m.x_f__mutmut_3", "m.x_g__mutmut_1"]
    assert report.kill_rate(report.module_counts({"exit_code_by_key": {"m.x_f__mutmut_1": None}})) is None


def test_the_table_has_a_row_per_file_and_the_total(report, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py.meta").write_text(json.dumps(META))
    (tmp_path / "pkg" / "b.py.meta").write_text(json.dumps({"exit_code_by_key": {"b.x_h__mutmut_1": 1}}))
    lines = report.report(tmp_path).splitlines()
    assert lines[2] == "| pkg/a.py | 7 | 3 | 1 | 1 | 1 | 0 | 1 | 66.7 % |"
    assert lines[3] == "| pkg/b.py | 1 | 1 | 0 | 0 | 0 | 0 | 0 | 100.0 % |"
    assert lines[4] == "| **all** | 8 | 4 | 1 | 1 | 1 | 0 | 1 | 71.4 % |"
    assert lines[6:] == ["Not killed (2; `mutmut show NAME` for the diff):", "  m.x_f__mutmut_3", "  m.x_g__mutmut_1"]
