"""training_curves.png: a title, whole-number step ticks, a data-wait axis that fits the data."""

from __future__ import annotations

import pytest

from cembed.train.meter import plot_run


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_run draws, kept instead of closed."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


def test_plot_has_title_integer_steps_and_a_data_wait_axis_that_fits(tmp_path, drawn):
    history = [{"step": s, "tokens_per_s": 1000.0 + s, "data_wait": 0.0001} for s in (1, 2, 3)]
    losses = [(1, 2.0), (2, 1.5), (3, 1.2)]
    png = plot_run(losses, history, 16, tmp_path / "training_curves.png", losses, title="demo: all-MiniLM-L6-v2")
    assert png is not None and png.stat().st_size > 0
    (fig,) = drawn
    assert fig._suptitle is not None and fig._suptitle.get_text() == "demo: all-MiniLM-L6-v2"
    axes = fig.axes
    lo, hi = axes[-1].get_xlim()
    ticks = [t for t in axes[-1].get_xticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks  # not 1.25, 1.5, ...
    bottom, top = axes[2].get_ylim()
    assert (bottom, top) == (0, 1.0)  # 0.01 % drawn on 0-1 %, not on a 0-0.02 % axis


def test_data_wait_axis_grows_with_the_data(tmp_path, drawn):
    history = [{"step": s, "tokens_per_s": 1000.0, "data_wait": w} for s, w in ((1, 0.05), (2, 0.30))]
    plot_run([], history, 16, tmp_path / "p.png")
    (fig,) = drawn
    assert fig.axes[2].get_ylim() == (0, pytest.approx(36.0))  # 1.2 x the largest share (30 %)
    assert fig._suptitle is None  # no title given, none drawn
