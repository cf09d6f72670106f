"""cembed.train.args: the trainer's arguments derived from a config and its plan (sampler,
scheduler, LR, precision flags, length, saving, multi-process settings, eval overrides)."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest
import sentence_transformers
from sentence_transformers.base.sampler import BatchSamplers

from cembed.config.file import config_from_dict
from cembed.data.batching.full_table import NoDuplicatesSampler
from cembed.data.batching.mixture import SourceMix
from cembed.errors import UserError
from cembed.plan.resolve import resolve_plan
from cembed.train.args import build_training_args

pytestmark = pytest.mark.filterwarnings("ignore:The `warmup_ratio` argument is deprecated")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _cfg(tmp_path, **sections):
    train = {"output_dir": str(tmp_path / "out"), **sections.pop("train", {})}
    data = {"data": {"train": "x.jsonl"}, "model": {"device": "cpu"}, "train": train, **sections}
    return config_from_dict(data, base=tmp_path)


def _warmup(args) -> float:
    # transformers 5 turns warmup_ratio into a fractional warmup_steps; older ones keep warmup_ratio
    return args.warmup_ratio if args.warmup_ratio else args.warmup_steps


def test_defaults(tmp_path):
    cfg = _cfg(tmp_path)
    args = build_training_args(cfg, resolve_plan(cfg, world_size=1))
    assert args.output_dir == str(tmp_path / "out")
    assert args.batch_sampler is NoDuplicatesSampler
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (64, 1)
    assert args.learning_rate == pytest.approx(2e-5 * math.sqrt(64 / 32))  # the plan's scaled LR
    assert (args.lr_scheduler_type.value, args.lr_scheduler_kwargs) == ("linear", {})
    assert _warmup(args) == pytest.approx(0.1) and args.weight_decay == 0.01
    assert (args.bf16, args.fp16, args.use_cpu) == (False, False, True)
    assert (args.max_steps, args.num_train_epochs) == (-1, 1.0)
    assert (args.seed, args.data_seed, args.logging_steps, args.logging_first_step) == (42, 42, 10, True)
    assert args.save_strategy.value == "no"
    assert args.dataloader_drop_last is True and args.dataloader_num_workers == 0
    assert args.report_to in ("none", [], ["none"]) and args.disable_tqdm is True
    assert args.torch_compile is False and args.push_to_hub is False


def test_config_fields_reach_the_trainer(tmp_path):
    cfg = _cfg(
        tmp_path,
        batch={"per_device_train_batch_size": 16, "mini_batch_size": 4, "gradient_accumulation_steps": 2},
        optim={
            "learning_rate": 1e-4,
            "base_batch_size": 8,
            "lr_scheduler_type": "cosine_with_restarts",
            "lr_scheduler_kwargs": {"num_cycles": 3},
            "warmup_ratio": 0.25,
            "weight_decay": 0.0,
        },
        sampler={"no_duplicates": False},
        train={"max_steps": 7, "seed": 3, "save_steps": 5, "save_total_limit": 2, "logging_steps": 1},
    )
    args = build_training_args(cfg, resolve_plan(cfg, world_size=1))
    assert args.batch_sampler == BatchSamplers.BATCH_SAMPLER
    assert args.learning_rate == pytest.approx(1e-4 * 2)  # sqrt(16 x 2 / 8)
    assert (args.lr_scheduler_type.value, args.lr_scheduler_kwargs) == ("cosine_with_restarts", {"num_cycles": 3})
    assert _warmup(args) == pytest.approx(0.25) and args.weight_decay == 0.0
    assert (args.max_steps, args.seed, args.data_seed) == (7, 3, 3)
    assert (args.save_strategy.value, args.save_steps, args.save_total_limit) == ("steps", 5, 2)
    assert args.gradient_accumulation_steps == 2


@pytest.mark.parametrize(
    "precision, bf16, fp16", [("fp32", False, False), ("bf16", True, False), ("fp16", False, True)]
)
def test_precision_flags_follow_the_plan(tmp_path, precision, bf16, fp16):
    cfg = _cfg(tmp_path)
    args = build_training_args(cfg, replace(resolve_plan(cfg, world_size=1), precision=precision))
    assert (args.bf16, args.fp16) == (bf16, fp16)


def test_several_processes(tmp_path):
    cfg = _cfg(tmp_path, batch={"per_device_train_batch_size": 8, "mini_batch_size": 4, "drop_last": False})
    plan = resolve_plan(cfg, world_size=2)
    args = build_training_args(cfg, plan)
    assert args.ddp_find_unused_parameters is False
    assert args.dataloader_drop_last is True  # every rank needs full batches
    assert args.learning_rate == pytest.approx(2e-5 * math.sqrt(16 / 32))
    one = build_training_args(cfg, resolve_plan(cfg, world_size=1))
    assert one.dataloader_drop_last is False and one.ddp_find_unused_parameters is None


def test_several_sources_draw_batches_by_source(tmp_path):
    cfg = _cfg(tmp_path)
    plan = resolve_plan(cfg, world_size=1)
    mix = SourceMix(("a", "b"), (10, 20), "round_robin")
    sampler = build_training_args(cfg, plan, sources=mix).batch_sampler
    assert isinstance(sampler, partial) and sampler.func is NoDuplicatesSampler
    assert sampler.keywords == {"sources": mix, "no_duplicates": True}
    # one source: the plain sampler
    assert build_training_args(cfg, plan, sources=SourceMix(("a",), (10,))).batch_sampler is NoDuplicatesSampler
    cfg = _cfg(tmp_path, sampler={"no_duplicates": False})
    assert build_training_args(cfg, plan, sources=mix).batch_sampler.keywords["no_duplicates"] is False


def test_eval_args_override(tmp_path):
    cfg = _cfg(tmp_path, train={"save_steps": 10})
    overrides = {"eval_strategy": "steps", "eval_steps": 5, "save_steps": 5, "load_best_model_at_end": True}
    overrides |= {"metric_for_best_model": "eval_loss", "greater_is_better": False}
    args = build_training_args(cfg, resolve_plan(cfg, world_size=1), eval_args=overrides)
    assert (args.eval_strategy.value, args.eval_steps, args.save_steps) == ("steps", 5, 5)
    assert args.load_best_model_at_end is True and args.metric_for_best_model == "eval_loss"


def test_missing_tracker_package_named(tmp_path, monkeypatch):
    def refuse(**kwargs):
        raise ValueError("wandb is not installed: pip install wandb\nmore detail")

    monkeypatch.setattr(sentence_transformers, "SentenceTransformerTrainingArguments", refuse)
    cfg = _cfg(tmp_path, train={"report_to": "wandb"})
    with pytest.raises(UserError, match=r"^train.report_to: wandb is not installed: pip install wandb$"):
        build_training_args(cfg, resolve_plan(cfg, world_size=1))
    cfg = _cfg(tmp_path)  # no tracker asked for: the error is not about report_to
    with pytest.raises(ValueError, match="wandb is not installed"):
        build_training_args(cfg, resolve_plan(cfg, world_size=1))
