"""scripts/bench_colbert.py at toy sizes (``--quick``): both sections run, the stock and cembed steps
compute the same loss, and the padded share is counted as each path runs its mini-batches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script

REPO = Path(__file__).resolve().parents[2]


def test_positions_count_what_each_path_runs():
    bench = load_script(REPO / "scripts" / "bench_colbert.py", "bench_colbert")
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    features = [{"attention_mask": mask}]
    assert bench.positions(features, "cembed", 2) == (8, 8)  # packed: no padding
    assert bench.positions(features, "stock", 2) == (8, 2 * 3 + 1 * 4)  # each mini-batch to its longest row


@pytest.mark.slow
def test_quick_run_prints_both_sections_and_the_losses_agree():
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_colbert.py"), "--quick", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "losses agree" in r.stdout
    assert "| cembed |" in r.stdout and "| 256 |" in r.stdout
