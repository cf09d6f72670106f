"""LR scaling: the documented values, the CLI, and the LR the trainer receives."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import config_from_dict
from cembed.errors import UserError
from cembed.plan.lr import scale_lr, suggest_lr
from cembed.plan.resolve import resolve_plan


def test_sqrt_and_linear_values():
    assert scale_lr(2e-5, 32, 65536, "sqrt") == pytest.approx(2e-5 * math.sqrt(2048))
    assert f"{scale_lr(2e-5, 32, 65536, 'sqrt'):.3e}" == "9.051e-04"
    assert f"{scale_lr(2e-5, 32, 65536, 'linear'):.3e}" == "4.096e-02"
    assert scale_lr(2e-5, 32, 65536, "none") == 2e-5
    s = suggest_lr(2e-5, 32, 65536)
    assert s.bracket == pytest.approx((s.suggested / 2, s.suggested * 2))


@pytest.mark.parametrize("args", [(0, 32, 64), (1e-5, 0, 64), (1e-5, 32, -1), (float("nan"), 32, 64)])
def test_non_positive_inputs_rejected(args):
    with pytest.raises(UserError, match="must be a positive number"):
        scale_lr(*args)


def test_cli_suggest_lr():
    r = CliRunner().invoke(app, ["suggest-lr", "--base-lr", "2e-5", "--base-bs", "32", "--bs", "65536"])
    assert r.exit_code == 0, r.output
    assert "suggested learning_rate: 9.051e-04 (sqrt rule)" in r.output
    assert "linear rule: 4.096e-02" in r.output
    assert "4.525e-04 .. 1.810e-03" in r.output
    r = CliRunner().invoke(
        app, ["suggest-lr", "--base-lr", "2e-5", "--base-bs", "32", "--bs", "65536", "--rule", "linear"]
    )
    assert "suggested learning_rate: 4.096e-02 (linear rule)" in r.output
    r = CliRunner().invoke(app, ["suggest-lr", "--base-lr", "-1", "--base-bs", "32", "--bs", "64"])
    assert r.exit_code == 2
    assert "--base-lr" in r.output and "Traceback" not in r.output


def test_trainer_receives_scaled_lr(tmp_path):
    from cembed.train.args import build_training_args

    cfg = config_from_dict(
        {
            "data": {"train": "x.jsonl"},
            "batch": {"per_device_train_batch_size": 512, "mini_batch_size": 8, "gradient_accumulation_steps": 2},
            "optim": {"learning_rate": 2e-5, "base_batch_size": 32},
            "model": {"device": "cpu"},
        },
        base=tmp_path,
    )
    plan = resolve_plan(cfg, world_size=2)
    assert plan.samples_per_step == 512 * 2 * 2
    expected = scale_lr(2e-5, 32, 2048, "sqrt")
    assert plan.learning_rate == pytest.approx(expected)
    args = build_training_args(cfg, plan)
    assert args.learning_rate == pytest.approx(expected)
    assert any("adds no in-batch negatives" in w for w in plan.warnings)
