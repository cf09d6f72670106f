"""Publishing: train.push_to_hub / hub_model_id / hub_private_repo reach the trainer's arguments
(offline), and the model card in output_dir keeps cembed's training facts."""

from __future__ import annotations

import pytest
from conftest import distinct_pairs

from cembed.config.file import config_from_dict
from cembed.errors import UserError
from cembed.plan.resolve import resolve_plan
from cembed.train.args import build_training_args


def _cfg(tmp_path, **train):
    data = {
        "data": {"train": "pairs.jsonl"},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "model": {"device": "cpu"},
        "train": {"max_steps": 2, "output_dir": str(tmp_path / "run"), **train},
    }
    return config_from_dict(data, base=tmp_path)


def test_hub_fields_reach_the_training_arguments(tmp_path):
    cfg = _cfg(tmp_path, push_to_hub=True, hub_model_id="someone/minilm-coco", hub_private_repo=True)
    args = build_training_args(cfg, resolve_plan(cfg))
    assert args.push_to_hub is True and args.hub_model_id == "someone/minilm-coco" and args.hub_private_repo is True
    args = build_training_args(_cfg(tmp_path), resolve_plan(_cfg(tmp_path)))
    assert args.push_to_hub is False and args.hub_model_id is None and args.hub_private_repo is None


def test_push_to_hub_needs_hub_model_id(tmp_path):
    with pytest.raises(UserError, match=r"train: push_to_hub: true needs train\.hub_model_id"):
        _cfg(tmp_path, push_to_hub=True)


def test_model_card_keeps_cembed_facts(tmp_path, tiny_model_dir, pairs_file):
    from cembed.train.recipe import check_run_inputs, run_training

    data = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {"train": str(pairs_file(distinct_pairs(40))), "pretokenize": False},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-4, "base_batch_size": 2},
        "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(tmp_path / "run")},
    }
    cfg = config_from_dict(data, base=tmp_path)
    plan, prepared = check_run_inputs(cfg)
    summary = run_training(cfg, plan, prepared)
    assert summary["status"] == "completed"
    card = (tmp_path / "run" / "README.md").read_text()
    assert "- `cembed_effective_batch_size`: 8 (8 per device x 1 processes x 1 accumulation)" in card
    assert "- `cembed_mini_batch_size`: 4" in card
    assert "- `cembed_learning_rate`: 2.000e-04 = 0.0001 x sqrt(8/2) (lr_scaling: sqrt)" in card
    assert "- `cembed_training_rows`: 40" in card and "- `cembed_steps`: 2" in card


def test_failed_push_is_one_clear_error(tmp_path):
    from types import SimpleNamespace

    from cembed.train.publish import push_final_model

    class Trainer:
        args = SimpleNamespace(push_to_hub=True, output_dir="runs/x", hub_model_id="someone/m")
        state = SimpleNamespace(global_step=3)

        def push_to_hub(self, **kwargs):
            raise OSError("401 Client Error: Unauthorized")

    with pytest.raises(
        UserError,
        match=r"train.push_to_hub: the model is saved in runs/x, but uploading it to "
        r"someone/m failed: 401 Client Error",
    ):
        push_final_model(Trainer())
