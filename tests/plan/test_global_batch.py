"""``batch.global_batch_size`` (issue 33 item 1): samples per optimizer step whatever the process
count; the per-device batch is derived (global / (world x accumulation)), the LR is scaled from the
global batch, and a world size that does not split it is refused naming the counts that do."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import config_from_dict
from cembed.errors import UserError
from cembed.plan.resolve import resolve_plan, valid_world_sizes


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _cfg(tmp_path, **batch):
    return config_from_dict(
        {"data": {"train": "x.jsonl"}, "model": {"device": "cpu"}, "batch": batch, "optim": {"learning_rate": 1e-4}},
        base=tmp_path,
    )


@pytest.mark.parametrize(
    "world, accumulation, per_device", [(1, 1, 96), (2, 1, 48), (3, 1, 32), (4, 2, 12), (8, 1, 12), (1, 4, 24)]
)
def test_the_same_global_batch_and_lr_on_any_world_size(tmp_path, world, accumulation, per_device):
    cfg = _cfg(tmp_path, global_batch_size=96, mini_batch_size=4, gradient_accumulation_steps=accumulation)
    plan = resolve_plan(cfg, world_size=world)
    assert (plan.per_device_train_batch_size, plan.samples_per_step, plan.global_batch_size) == (per_device, 96, 96)
    assert plan.learning_rate == pytest.approx(1e-4 * math.sqrt(96 / 32), rel=1e-12)  # the global batch's LR
    # the resolved config (run_summary.json, validate --verbose) carries the derived batch, not the default 64
    batch = plan.config_as_run(cfg)["batch"]
    assert (batch["per_device_train_batch_size"], batch["global_batch_size"]) == (per_device, 96)
    assert batch["mini_batch_size"] == 4


def test_per_device_config_is_unchanged_and_records_no_global(tmp_path):
    plan = resolve_plan(_cfg(tmp_path, per_device_train_batch_size=48, mini_batch_size=4), world_size=2)
    assert (plan.per_device_train_batch_size, plan.samples_per_step, plan.global_batch_size) == (48, 96, None)


def test_valid_world_sizes_are_the_divisors_that_leave_a_mini_batch():
    assert valid_world_sizes(96, 1) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    assert valid_world_sizes(96, 2) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert valid_world_sizes(96, 1, min_per_device=8) == [1, 2, 3, 4, 6, 8, 12]
    assert valid_world_sizes(96, 5) == []


@pytest.mark.parametrize("world", [5, 7])
def test_a_world_size_that_does_not_split_it_is_refused_naming_the_valid_counts(tmp_path, world):
    cfg = _cfg(tmp_path, global_batch_size=96, mini_batch_size=8)
    with pytest.raises(UserError) as err:
        resolve_plan(cfg, world_size=world)
    assert str(err.value) == (
        f"batch.global_batch_size=96 does not split over {world} process(es) x 1 accumulation step(s) into equal "
        "per-device batches; run on 1, 2, 3, 4, 6, 8, 12 processes or change it"
    )


def test_an_accumulation_that_does_not_divide_it_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"make it a multiple of batch.gradient_accumulation_steps \(5\)"):
        resolve_plan(_cfg(tmp_path, global_batch_size=96, mini_batch_size=4, gradient_accumulation_steps=5), 1)


def test_a_mini_batch_above_the_derived_per_device_batch_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"batch.mini_batch_size \(32\) is larger than the per-device batch 24 .*"
                       r"set it to at most 24, or run on 1, 2, 3 processes"):  # fmt: skip
        resolve_plan(_cfg(tmp_path, global_batch_size=96, mini_batch_size=32), world_size=4)


def test_both_batch_fields_set_is_refused_naming_both(tmp_path):
    with pytest.raises(
        UserError, match=r"batch: global_batch_size \(96\) and per_device_train_batch_size \(48\) are both set"
    ):
        _cfg(tmp_path, global_batch_size=96, per_device_train_batch_size=48)


def _write(tmp_path, tiny_model_dir, batch: dict):
    import yaml

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"anchor": f"query {i}", "positive": f"doc {i}"}) + "\n" for i in range(64)))
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": str(rows)},
                "batch": batch,
                "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
            }
        )
    )
    return config


def test_validate_shows_both_and_refuses_a_world_size_in_one_line(tmp_path, tiny_model_dir):
    config = _write(tmp_path, tiny_model_dir, {"global_batch_size": 16, "mini_batch_size": 4})
    ok = CliRunner().invoke(app, ["validate", str(config), "--nproc-per-node", "2"])
    assert ok.exit_code == 0, ok.output
    assert "effective batch (batch.global_batch_size): 8 per device x 2 x 1 accumulation = 16 samples" in ok.output
    shown = CliRunner().invoke(app, ["validate", str(config), "--nproc-per-node", "2", "--json"])
    batch = json.loads(shown.output)["config"]["batch"]
    assert (batch["per_device_train_batch_size"], batch["global_batch_size"]) == (8, 16)
    bad = CliRunner().invoke(app, ["validate", str(config), "--nproc-per-node", "3"])
    assert bad.exit_code != 0
    assert "batch.global_batch_size=16 does not split over 3 process(es)" in bad.output
    assert "run on 1, 2, 4 processes or change it" in bad.output
    assert "Traceback" not in bad.output


def test_train_refuses_the_world_size_before_launching(tmp_path, tiny_model_dir):
    config = _write(tmp_path, tiny_model_dir, {"global_batch_size": 16, "mini_batch_size": 4})
    result = CliRunner().invoke(app, ["train", str(config), "--nproc-per-node", "3"])
    assert result.exit_code != 0
    assert "batch.global_batch_size=16 does not split over 3 process(es)" in result.output
    assert "launching" not in result.output and not (tmp_path / "run").exists()


def test_estimate_shows_both(tmp_path, tiny_model_dir):
    config = _write(tmp_path, tiny_model_dir, {"global_batch_size": 16, "mini_batch_size": 4})
    out = tmp_path / "estimate.json"
    result = CliRunner().invoke(
        app, ["estimate", str(config), "--gpu", "A100", "--nproc-per-node", "2", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())["data"]
    assert (data["rows_per_step"]["value"], data["per_device_batch"]["value"]) == (16, 8)
    assert data["per_device_batch"]["source"] == "batch.global_batch_size / (2 devices x 1 accumulation)"
