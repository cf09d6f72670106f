"""``cembed estimate`` (issue 26 item 1): its arithmetic against hand counts on a tiny model and data
(steps, tokens, FLOPs, time = FLOPs / (peak x MFU)), the unknown-GPU refusal and the CLI's JSON."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.errors import UserError
from cembed.train import estimate as est

A100_BF16 = 312.0e12  # NVIDIA's A100 datasheet, bf16 dense


def test_run_arithmetic_matches_a_hand_count():
    # Two columns over two rows: anchor 2 and 4 tokens, positive 3 and 5.
    stats = est.token_stats({"anchor": [2, 4], "positive": [3, 5]}, mini_batch=2)
    assert stats.mean_tokens == 7  # (2 + 4) / 2 + (3 + 5) / 2
    assert stats.mean_tokens_sq == 27  # (4 + 16) / 2 + (9 + 25) / 2
    # Padded per mini-batch of 2: anchor 2 x 4 = 8 positions for 6 tokens, positive 10 for 8.
    assert stats.padded_share == pytest.approx(1 - 14 / 18)
    assert stats.histogram == {"anchor": {2: 1, 4: 1}, "positive": {4: 1, 8: 1}}
    rate = est.peak_rate(100.0, "peak", 0.5, "given")
    run = est.estimate_run(stats, 2, 5, 12, (100, 2, 4, 4), rate, devices=2)
    assert run["steps_per_epoch"]["value"] == 5 and run["steps"]["value"] == 12
    assert run["tokens_per_step"]["value"] == 14  # 2 rows x 7
    assert run["tokens"]["value"] == 168
    # 4 passes x (2 N sum(l) + 4 L d sum(l^2)) = 4 x (2*100*14 + 4*2*4*54) = 4 x (2800 + 1728)
    assert run["flops_per_step"]["value"] == 18112
    assert run["flops"]["value"] == 18112 * 12
    assert run["seconds_per_step"]["value"] == pytest.approx(18112 / (100 * 0.5 * 2))
    assert run["epoch_seconds"]["value"] == pytest.approx(5 * 18112 / 100)
    assert run["run_seconds"]["value"] == pytest.approx(12 * 18112 / 100)
    assert run["gpu_hours"]["value"] == pytest.approx(12 * 18112 / 100 * 2 / 3600)
    assert all("source" in v and v["source"] for v in run.values())


def test_padded_share_follows_the_configured_path():
    # A per-device batch of 4 sorted by length, mini-batches of 2: [1, 2] pads to 4 positions, [3, 4] to 8.
    lengths = {"anchor": [4, 1, 3, 2]}
    assert est.token_stats(lengths, 2, batch=4, sort_by_length=True).padded_share == pytest.approx(1 - 10 / 12)
    assert est.token_stats(lengths, 2, batch=4, sort_by_length=True, packed=True).padded_share == 0
    # One mini-batch of the whole batch: every row pads to 4.
    assert est.token_stats(lengths, 4).padded_share == pytest.approx(1 - 10 / 16)


def test_gpu_names_and_unknown_gpu():
    assert est.gpu_peak("H100-SXM", "auto") == (989.4e12, "H100 SXM bf16 dense peak (NVIDIA datasheet)")
    assert est.gpu_peak("a100", "fp32")[0] == 156.0e12  # TF32 matmuls on CUDA
    assert est.gpu_peak("V100", "auto")[0] == 125.0e12  # no bf16: the fp16 tensor peak
    with pytest.raises(UserError) as err:
        est.gpu_peak("X99", "auto")
    message = str(err.value)
    assert "\n" not in message and message.startswith("--gpu: unknown GPU 'X99'; known: GB200, B200")
    assert "H100 SXM" in message and "T4" in message


def test_mfu_must_be_a_share():
    with pytest.raises(UserError, match="--mfu"):
        est.peak_rate(1.0, "peak", 1.5, "given")


def test_probe_memory_data_wait_and_checkpoint():
    trials = [{"size": 8, "peak_bytes": 100}, {"size": 32, "peak_bytes": 400}, {"size": 64, "peak_bytes": None}]
    assert est.probe_memory({"trials": trials}, 16)["value"] == 400  # the next tried size bounds 16
    assert est.probe_memory({"trials": trials}, 64)["value"] == "run probe-minibatch"
    assert est.probe_memory(None, 16)["value"] == "run probe-minibatch"
    assert est.data_wait_risk(None, 1.0)["value"] == "not measured"
    risk = est.data_wait_risk(0.3, 1.0)
    assert risk["value"] == "some" and risk["share_of_step"] == pytest.approx(0.3)
    assert est.checkpoint_bytes(1000, "bfloat16")["value"] == 2000


def _rows():
    # 16 distinct rows of the tiny tokenizer's whole words: [CLS] + words + [SEP]. Anchors: 8 of one
    # word (3 tokens), 8 of three words (5 tokens); positives: two words (4 tokens).
    words = "man woman people dog cat train table street".split()
    rows = [{"anchor": w, "positive": f"{w} red"} for w in words]
    rows += [{"anchor": f"{w} on top", "positive": f"{w} blue"} for w in words]
    return rows


def _tiny_config(write_config, pairs_file, tiny_model_dir, tmp_path, **train):
    """The tiny model on :func:`_rows` at batch 8, mini-batch 4; ``train`` sets the run's length."""
    return write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(_rows())), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "optim": {"learning_rate": 2e-5},
            "train": {"output_dir": str(tmp_path / "run"), **train},
        }
    )


def test_cli_json_against_a_hand_count(write_config, pairs_file, tiny_model_dir, tmp_path):
    cfg = _tiny_config(write_config, pairs_file, tiny_model_dir, tmp_path, num_train_epochs=1)
    out = tmp_path / "estimate.json"
    r = CliRunner().invoke(app, ["estimate", str(cfg), "--gpu", "A100", "--mfu", "0.5", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    # Tiny BERT: hidden 32, 1 layer, FFN 64. N (no nn.Embedding): layer 4*(32*32+32) + 64 + (32*64+64) +
    # (64*32+32) + 64 = 8544, pooler 32*32+32 = 1056, embedding LayerNorm 64.
    assert report["flop_model"] == {"N": 9664, "L": 1, "d": 32, "passes": 4}
    assert report["steps_per_epoch"]["value"] == 2 and report["steps"]["value"] == 2  # 16 rows / 8
    assert report["data"]["mean_tokens_per_row"]["value"] == 8  # (3 + 5) / 2 + 4
    assert report["tokens"]["value"] == 2 * 8 * 8
    flops_step = 4 * (2 * 9664 * 64 + 4 * 1 * 32 * 8 * 33)  # sum(l^2) per row: (9 + 25) / 2 + 16 = 33
    assert report["flops_per_step"]["value"] == flops_step
    assert report["run_seconds"]["value"] == pytest.approx(2 * flops_step / (A100_BF16 * 0.5))
    assert report["rate"]["mfu"] == {"value": 0.5, "unit": "", "source": "given: --mfu"}
    assert report["rate"]["peak_flops"]["source"].startswith("datasheet: A100 bf16")
    assert report["memory_per_rank"]["value"] == "run probe-minibatch"
    assert report["data_wait_risk"]["value"] == "not measured"
    params = report["checkpoint_size"]["value"] // 4
    assert params > 9664 and "float32" in report["checkpoint_size"]["source"]
    for key in ("steps", "tokens", "flops", "epoch_seconds", "run_seconds", "gpu_hours", "checkpoint_size"):
        assert report[key]["source"], key
    assert "run seconds" in r.output and "datasheet" in r.output


def test_cli_unknown_gpu_lists_the_known_ones(write_config, tmp_path):
    cfg = write_config({"model": {"name_or_path": "x"}, "data": {"train": "x.jsonl"}, "train": {"max_steps": 1}})
    r = CliRunner().invoke(app, ["estimate", str(cfg), "--gpu", "X99"])
    assert r.exit_code == 2
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown GPU 'X99'" in lines[0] and "H100 SXM" in lines[0], r.output


@pytest.mark.slow
def test_cli_calibrate_measures_this_machine(write_config, pairs_file, tiny_model_dir, tmp_path):
    cfg = _tiny_config(write_config, pairs_file, tiny_model_dir, tmp_path, max_steps=40)
    out = tmp_path / "estimate.json"
    r = CliRunner().invoke(app, ["estimate", str(cfg), "--calibrate", "2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    calibration = report["calibration"]
    assert calibration["steps"] == 2 and calibration["rate_from"] == "median of steps 2..2"
    rate = report["rate"]["flops_per_s_per_device"]
    assert rate["value"] == calibration["flops_per_s"] > 0
    assert rate["source"] == "measured: median of steps 2..2 of 2 on this machine"
    assert report["steps"]["value"] == 40  # the configured run, not the calibration's 2 steps
    assert report["run_seconds"]["value"] == pytest.approx(40 * report["flops_per_step"]["value"] / rate["value"])
    assert report["data_wait_risk"]["value"] in ("low", "some", "high")
    assert not (tmp_path / "run" / "run_summary.json").exists()  # calibration trains in a temporary folder


@pytest.mark.parametrize(
    ("loss", "batch", "share"),
    [
        # Two devices of one row each: every forward is one row, padded to itself, whatever the
        # order. Padding across the global batch of 2 would give anchors 3 and 5 -> 10 positions.
        ("cached_mnrl", {"per_device_train_batch_size": 1, "mini_batch_size": 1}, 0.0),
        ("mnrl", {"per_device_train_batch_size": 1, "mini_batch_size": 1}, 0.0),
        # A plain loss runs on the collator's width: the longest row (3 or 5 anchor tokens, 4 positive)
        # rounded up to 8 for every per-device batch of 4: 8 real tokens per row in 16 positions.
        ("mnrl", {"per_device_train_batch_size": 4, "mini_batch_size": 4, "pad_to_multiple_of": 8}, 0.5),
        # The cached loss trims each mini-batch to its longest row (sentence-transformers'
        # _create_minibatch), undoing the rounding: mini-batches of one row pad nothing.
        ("cached_mnrl", {"per_device_train_batch_size": 4, "mini_batch_size": 1, "pad_to_multiple_of": 8}, 0.0),
    ],
)
def test_cli_padded_share_is_counted_per_device_batch(
    write_config, pairs_file, tiny_model_dir, tmp_path, loss, batch, share
):
    """Issue 32 item 5c: the padded share is what each device's forwards pad to (2 devices, hand counts)."""
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(_rows())), "cache_dir": str(tmp_path / "cache")},
            "loss": {"name": loss},
            "batch": batch,
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2},
        }
    )
    out = tmp_path / "estimate.json"
    args = ["estimate", str(cfg), "--gpu", "A100", "--nproc-per-node", "2", "--json", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    padded = json.loads(out.read_text())["data"]["padded_share"]["value"]
    assert padded == pytest.approx(share)


# --- each reported number whole (value, unit, source: what `cembed estimate` shows), the edges of
# the arithmetic (written against `make mutate`'s survivors).


def test_each_run_number_says_its_unit_and_where_it_comes_from():
    stats = est.token_stats({"anchor": [2, 4], "positive": [3, 5]}, mini_batch=2)
    run = est.estimate_run(stats, 2, 5, 12, (100, 2, 4, 4), est.peak_rate(100.0, "peak", 0.5, "given"), devices=2)
    data = "2 rows x mean real tokens per row over 2 rows of the pre-tokenized data"
    assert {k: (v["unit"], v["source"]) for k, v in run.items()} == {
        "steps_per_epoch": ("steps", "config and rows the sampler places"),
        "steps": ("steps", "train.max_steps or epochs x steps per epoch"),
        "tokens_per_step": ("tokens", data),
        "tokens": ("tokens", "tokens per step x steps"),
        "flops_per_step": ("FLOP", "4 x (2 N sum(l) + 4 L d sum(l^2)), N=100 L=2 d=4"),
        "flops": ("FLOP", "FLOPs per step x steps"),
        "seconds_per_step": ("s", "FLOPs per step / (peak x MFU 0.5 (given) x 2 devices)"),
        "epoch_seconds": ("s", "seconds per step x steps per epoch"),
        "run_seconds": ("s", "seconds per step x steps"),
        "gpu_hours": ("h", "run seconds x devices / 3600"),
    }


def test_a_peak_rate_and_the_mfu_bounds():
    assert est.peak_rate(100.0, "peak", 0.5, "given") == est.Rate(
        50.0, "peak x MFU 0.5 (given)", 100.0, "peak", 0.5, "given"
    )
    assert est.peak_rate(100.0, "peak", 1, "given").flops_per_s == 100.0  # the whole peak is a share
    for mfu in (0, 1.5):
        with pytest.raises(UserError) as refused:
            est.peak_rate(100.0, "peak", mfu, "given")
        assert (
            str(refused.value) == f"--mfu: {mfu:g} is not a share of the peak; give a value in (0, 1], e.g. --mfu 0.35"
        )


def test_known_gpus_and_a_precision_a_part_lacks():
    names = est.known_gpus()
    assert names[:2] == ["GB200", "B200"] and "H100 SXM" in names and not any("(" in n for n in names)
    assert est.gpu_peak("h100_sxm", "auto") == est.gpu_peak("H100 SXM", "auto")
    # "-" and "_" read as spaces where the part's name has a space in it (its pattern needs one)
    assert est.gpu_peak("rtx-6000_ada", "bf16") == (364.2e12, "RTX 6000 Ada bf16 dense peak (NVIDIA datasheet)")
    assert est.gpu_peak("GeForce--RTX_4090", "fp32")[0] == 82.6e12
    with pytest.raises(UserError) as refused:
        est.gpu_peak("V100", "bf16")
    message = str(refused.value)
    assert message.startswith("--gpu: ") and message.endswith("; pick another model.precision") and "V100" in message


def test_token_stats_edges():
    assert est.token_stats({}, 2) == est.TokenStats(0, 0.0, 0.0, {}, 0.0)
    assert est.token_stats({"anchor": []}, 2) == est.TokenStats(0, 0.0, 0.0, {"anchor": {}}, 0.0)
    stats = est.token_stats({"anchor": [1, 3, 4, 4, None]}, 1)
    assert stats.rows == 5 and stats.histogram == {"anchor": {1: 1, 4: 3}}  # 1 token: the bucket of 1
    assert stats.padded_share == 0  # mini-batches of one row pad nothing
    assert est.token_stats({"anchor": [1, 3]}, 2, batch=1).padded_share == 0  # nor per-device batches of one
    assert est.token_stats({"anchor": [1, 3]}, 1, batch=2).padded_share == 0  # a batch of 2 in mini-batches of 1


def test_token_stats_defaults_seed_0_and_no_sorting():
    lengths = {"anchor": [1, 8, 2, 7, 3, 6, 4, 5] * 4}
    share = est.token_stats(lengths, 2, batch=8).padded_share
    assert share == est.token_stats(lengths, 2, batch=8, seed=0, sort_by_length=False).padded_share
    assert share != est.token_stats(lengths, 2, batch=8, seed=1).padded_share
    assert share != est.token_stats(lengths, 2, batch=8, sort_by_length=True).padded_share


def test_probe_memory_takes_the_smallest_tried_size_at_or_above():
    trials = [{"size": 32, "peak_bytes": 400}, {"size": 16, "peak_bytes": 300}, {"size": 8, "peak_bytes": 100}]
    assert est.probe_memory({"trials": trials}, 16) == {
        "value": 300,
        "unit": "bytes",
        "source": "measured: probe's worst case at mini_batch_size 16",
    }
    assert est.probe_memory({"trials": trials}, 17)["value"] == 400
    assert est.probe_memory({"trials": trials}, None) == {
        "value": "run probe-minibatch",
        "unit": "",
        "source": "no probe trial at this mini-batch size",
    }


def test_data_wait_risk_levels_and_record():
    assert est.data_wait_risk(0.3, 1.0, "rank 0") == {
        "value": "some",
        "batch_production_s": 0.3,
        "share_of_step": 0.3,
        "unit": "",
        "source": "measured batch production per step on rank 0 / predicted seconds per step",
    }
    assert est.data_wait_risk(0.3, 1.0)["source"].endswith("on this machine / predicted seconds per step")
    levels = {share: est.data_wait_risk(share, 1.0)["value"] for share in (0.05, 0.1, 0.49, 0.5, 2.0)}
    assert levels == {0.05: "low", 0.1: "some", 0.49: "some", 0.5: "high", 2.0: "high"}
    assert est.data_wait_risk(0.3, 2.0)["share_of_step"] == pytest.approx(0.15)  # production / step
    stalled = est.data_wait_risk(0.1, 0.0)
    assert stalled["value"] == "high" and stalled["share_of_step"] == float("inf")
    assert est.data_wait_risk(None, 1.0) == {
        "value": "not measured",
        "unit": "",
        "source": "run with --calibrate STEPS to measure batch production",
    }


@pytest.mark.parametrize(
    ("dtype", "size"), [("float32", 4), ("bfloat16", 2), ("float16", 2), ("float64", 8), ("int8", 4)]
)
def test_checkpoint_bytes_per_dtype(dtype, size):
    assert est.checkpoint_bytes(1000, dtype) == {
        "value": 1000 * size,
        "unit": "bytes",
        "source": f"1000 parameters x {size} bytes ({dtype}, the saved dtype)",
    }
