"""Issue 14 item 3: model FLOPs, FLOP/s and MFU in the meter, checked against a hand computation
for the tiny model (1 BERT layer, hidden 32, 2 heads, intermediate 64)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import distinct_pairs
from sentence_transformers import SentenceTransformer
from typer.testing import CliRunner

from cembed.losses.counts import TokenCounts
from cembed.train.flops import FlopModel, build_flop_model, device_peak, encoder_shape, format_flops, matmul_precision
from cembed.train.meter import ThroughputMeter, plot_run

H, FF = 32, 64  # the tiny model's hidden and intermediate sizes
# Non-embedding parameters by hand: per layer Q, K, V, O (H x H + H each), two LayerNorms (2H each),
# the feed-forward in (H x FF + FF) and out (FF x H + H); then the embeddings' LayerNorm (2H) and the
# pooler (H x H + H). The word / position / token-type tables are the embeddings left out.
N_TINY = (4 * (H * H + H) + 2 * 2 * H + (H * FF + FF) + (FF * H + H)) + 2 * H + (H * H + H)


def test_tiny_model_shape_by_hand(tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    assert encoder_shape(model) == (N_TINY, 1, H)
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert N_TINY + embeddings == sum(p.numel() for p in model.parameters())  # nothing else left out


@pytest.mark.parametrize("cached, passes", [(True, 4), (False, 3)])
def test_flops_formula_by_hand(tiny_model_dir, cached, passes):
    """Two rows of 5 and 3 real tokens: forward 2N x 8 + 4 L d (25 + 9); cached x4 (8N/token), plain x3 (6N)."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    fm = build_flop_model(model, cached, "fp32", "cpu")
    assert (fm.non_embedding_params, fm.layers, fm.attention_width, fm.passes) == (N_TINY, 1, H, passes)
    assert fm.peak_flops is None  # CPU: FLOP/s only
    assert fm.flops(8, 34) == passes * (2 * N_TINY * 8 + 4 * 1 * H * 34)


def test_meter_flops_and_mfu_by_hand(monkeypatch):
    """Per interval: flops_per_s = passes (2 N real + 4 L d real_sq) / wall; MFU = that / peak; the
    totals over the run likewise, with the FLOP model's constants."""
    import cembed.train.meter as meter_mod

    clock = iter([100.0, 110.0, 130.0, 130.0])
    monkeypatch.setattr(meter_mod.time, "perf_counter", lambda: next(clock))
    fm = FlopModel(non_embedding_params=1000, layers=2, attention_width=16, passes=4, peak_flops=2e9, peak_source="x")
    counts = TokenCounts()
    m = ThroughputMeter(counts, fm)
    m.start()  # t=100
    counts.add(torch.tensor(1000), torch.tensor(1250), torch.tensor(20000))  # e.g. 50 rows of 20 tokens
    first = m.snapshot(step=5)  # t=110
    flops = 4 * (2 * 1000 * 1000 + 4 * 2 * 16 * 20000)  # 10_560_000 FLOPs in 10 s
    assert first["flops_per_s"] == flops / 10
    assert first["mfu"] == round(flops / 10 / 2e9, 6)
    counts.add(400, 400, 1600)
    second = m.snapshot(step=10)  # t=130
    flops2 = 4 * (2 * 1000 * 400 + 4 * 2 * 16 * 1600)
    assert second["flops_per_s"] == flops2 / 20 and second["mfu"] == round(flops2 / 20 / 2e9, 6)
    totals = m.totals()
    assert totals["flops_per_s"] == round((flops + flops2) / 30, 1)
    assert totals["mfu"] == round((flops + flops2) / 30 / 2e9, 6)
    assert totals["flop_model"]["non_embedding_params"] == 1000 and totals["flop_model"]["peak_flops"] == 2e9
    assert [h["mfu"] for h in m.history] == [first["mfu"], second["mfu"]]


def test_meter_mfu_over_ranks():
    """Two ranks: FLOP/s summed over the ranks, MFU over both devices' peaks."""
    fm = FlopModel(1000, 0, 0, 3, peak_flops=1e6)
    m = ThroughputMeter(TokenCounts(), fm, gather=lambda v: [[100, 100, 0, 1.0, 0, 0], [100, 100, 0, 2.0, 0, 0]])
    stats = m.snapshot(step=1)
    assert stats["flops_per_s"] == 3 * 2 * 1000 * 100 * (1 / 1 + 1 / 2)
    assert stats["mfu"] == round(stats["flops_per_s"] / 2e6, 6)


def test_meter_without_peak_reports_flops_only():
    m = ThroughputMeter(TokenCounts(real=10, processed=10), FlopModel(10, 0, 0, 3))
    stats = m.snapshot(step=1)
    assert stats["flops_per_s"] > 0 and stats["mfu"] is None


@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200 NVL", "tf32", 417.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L40", "bf16", 181.0),
        ("NVIDIA A10G", "bf16", 125.0),
        ("NVIDIA A10", "fp32", 31.2),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_device_peak_table(name, precision, tflops):
    peak, source = device_peak(name, precision)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))
    if tflops is None:
        assert "no bf16 peak" in source or "train.peak_tflops" in source


def test_peak_override_and_precision(tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    fm = build_flop_model(model, True, "fp32", "cpu", peak_tflops=2.5)
    assert fm.peak_flops == 2.5e12 and fm.peak_source == "train.peak_tflops"
    assert matmul_precision("fp32", "cpu") == "fp32" and matmul_precision("bf16", "cuda") == "bf16"


@pytest.mark.slow
def test_training_reports_flops_and_mfu(tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch):
    """A 2-step run on 32 pairs (every row once): run_summary.json's throughput has the FLOP model of
    the tiny model, FLOP/s = tokens/s x the FLOPs per real token of these rows (hand formula), MFU =
    FLOP/s / the train.peak_tflops peak; train.log's lines, the interval history and the plot too."""
    from cembed.config.file import load_config
    from cembed.train.recipe import check_run_inputs, run_training

    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    rows = distinct_pairs(32)
    out = tmp_path / "run"
    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": str(pairs_file(rows))},
                "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
                "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(out), "peak_tflops": 0.001},
            }
        )
    )
    plan, data = check_run_inputs(cfg)
    summary = run_training(cfg, plan, data)
    assert summary["samples_seen"] == 32
    t = summary["throughput"]
    assert t["flop_model"] | {"formula": None} == {
        "non_embedding_params": N_TINY,
        "layers": 1,
        "attention_width": H,
        "passes": 4,
        "peak_flops": 1e9,
        "peak_source": "train.peak_tflops",
        "scoring_flops_per_pair": 0.0,  # a dense model: no late-interaction scoring
        "formula": None,
    }
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    lengths = [
        int(n)
        for col in ("anchor", "positive")
        for n in model.tokenize([r[col] for r in rows])["attention_mask"].sum(1)
    ]
    real, real_sq = sum(lengths), sum(n * n for n in lengths)
    per_token = 4 * (2 * N_TINY * real + 4 * 1 * H * real_sq) / real
    # the same wall time divides both; tokens_per_s is rounded to 0.1
    assert abs(t["flops_per_s"] / per_token - t["tokens_per_s"]) <= 0.05 + 1e-6
    assert t["mfu"] == pytest.approx(t["flops_per_s"] / 1e9, abs=1e-6)
    assert len(summary["throughput_per_interval"]) == 2
    for h in summary["throughput_per_interval"]:
        assert h["flops_per_s"] > 0 and h["mfu"] == pytest.approx(h["flops_per_s"] / 1e9, abs=1e-6)
    log = (out / "train.log").read_text()
    assert "FLOP/s" in log and "MFU" in log
    assert json.loads((out / "run_summary.json").read_text())["throughput"]["mfu"] == t["mfu"]
    png = plot_run(summary["losses"], summary["throughput_per_interval"], 16, tmp_path / "p.png")
    assert png is not None and png.stat().st_size > 0


def test_cli_peak_tflops_must_be_positive(tiny_model_dir, write_config, pairs_file):
    from cembed.cli.app import app

    config = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(8)))},
        }
    )
    result = CliRunner().invoke(app, ["train", str(config), "--peak-tflops", "-5"])
    assert result.exit_code == 2
    assert "train.peak_tflops" in result.output


def test_format_flops():
    assert format_flops(989.4e12) == "989 TFLOP/s"
    assert format_flops(6.1767e6) == "6.18 MFLOP/s"
    assert format_flops(2.25e15) == "2.25 PFLOP/s"
