"""scripts/bench_scale.py's pure parts: the synthetic corpus has the shape the issue states (word
counts, ~5 % duplicate texts, seeded) and the fitted slope / extrapolation is the least-squares line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_script(REPO / "scripts" / "bench_scale.py", "bench_scale")


def _duplicate_share(texts: list[str]) -> float:
    return 1 - len(set(texts)) / len(texts)


def test_corpus_word_counts_and_duplicate_share(bench):
    queries, passages = bench.generate_pairs(20_000, seed=3)
    assert len(queries) == len(passages) == 20_000
    q_words = [len(t.split()) for t in queries]
    p_words = [len(t.split()) for t in passages]
    assert (min(q_words), max(q_words)) == (8, 15)
    assert (min(p_words), max(p_words)) == (40, 80)
    # 5 % copies of earlier rows (a copy of a copy still counts once); chance repeats are negligible
    assert 0.045 < _duplicate_share(queries) < 0.055
    assert 0.045 < _duplicate_share(passages) < 0.055


def test_corpus_is_seeded(bench):
    assert bench.generate_pairs(500, seed=1) == bench.generate_pairs(500, seed=1)
    assert bench.generate_pairs(500, seed=1) != bench.generate_pairs(500, seed=2)


def test_shards_hold_every_row_once(bench, tmp_path):
    train, size = bench.write_corpus(tmp_path, 1_000, seed=0, shards=4)
    assert train == str(tmp_path / "*.jsonl.gz")
    files = sorted(tmp_path.glob("*.jsonl.gz"))
    assert len(files) == 4 and size == sum(f.stat().st_size for f in files)
    rows = [json.loads(line) for f in files for line in gzip.open(f, "rt")]
    queries, passages = bench.generate_pairs(1_000, seed=0)
    assert [r["anchor"] for r in rows] == queries
    assert [r["positive"] for r in rows] == passages


def test_fit_line_slope_and_extrapolation(bench):
    # y = 2.5 bytes/row + 1000, with noise that cancels in least squares: (+1, -2, +1)
    rows = [100_000, 300_000, 1_000_000]
    values = [2.5 * n + 1000 + e for n, e in zip(rows, (1, -2, 1))]
    slope, intercept = bench.fit_line(rows, values)
    assert slope == pytest.approx(2.5, rel=1e-4)
    assert slope * 1e8 + intercept == pytest.approx(2.5e8, rel=1e-4)
