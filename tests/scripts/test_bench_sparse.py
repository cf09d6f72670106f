"""scripts/bench_sparse.py's extrapolation: the largest batch a fitted step memory keeps within a budget,
and the runs it skips."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_script(REPO / "scripts" / "bench_sparse.py", "bench_sparse")


def test_largest_batch_solves_the_fitted_quadratic(bench):
    # peak(B) = 100 MB + 1 MB * B + 4 B * B^2: at B = 10,000 that is 100e6 + 10e9 + 400e6 bytes.
    def peak(b):
        return 100e6 + 1e6 * b + 4 * b * b

    batches = [1024, 4096, 16384]
    budget = peak(10_000)
    assert bench.largest_batch(batches, [peak(b) for b in batches], 2, budget) == pytest.approx(10_000, abs=1)
    # Fitted as a line instead (cembed's model), the same points give another answer.
    assert abs(bench.largest_batch(batches, [peak(b) for b in batches], 1, budget) - 10_000) > 100


def test_a_negative_curvature_falls_back_to_a_line(bench):
    points = [1024, 4096, 16384]
    concave = [1e9 + 1e5 * b - 1 * b * b for b in points]  # a noisy flat fit must not bend down
    coef = bench.fit(points, concave, 2)
    assert coef[0] == 0.0 and coef[1] > 0
    assert bench.largest_batch([1024], [1e9], 1, 8e9) is None  # one point: nothing to extrapolate


def test_predicted_bytes_of_a_line(bench):
    assert bench.predicted_bytes([1, 3], [10.0, 30.0], 1, 100) == pytest.approx(1000.0)
