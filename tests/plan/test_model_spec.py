"""Resolved values travel on the Plan: the model as resolved is a frozen ModelSpec (Plan.model, or
resolve_model without a plan), and the probe's answer is the one change made to a plan."""

from __future__ import annotations

import dataclasses

import pytest

from cembed.config.schema import CembedConfig, ModelConfig
from cembed.plan.resolve import ModelSpec, Plan, resolve_model, resolve_plan


def _cfg(**model) -> CembedConfig:
    return CembedConfig.model_validate({"data": {"train": "pairs.jsonl"}, "model": model})


def test_plan_model_is_the_spec_resolve_model_gives():
    model = {"name_or_path": "some/model", "device": "cpu", "precision": "auto", "save_dtype": "bf16"}
    plan = resolve_plan(_cfg(**model))
    spec = resolve_model(ModelConfig(**model))
    assert plan.model == spec == ModelSpec("some/model", "cpu", "fp32", "bfloat16", False, "fp32 (auto: CPU)")
    assert (plan.device, plan.precision, plan.save_dtype) == (spec.device, spec.precision, spec.save_dtype)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.precision = "bf16"


def test_with_probe_is_the_one_amendment_and_leaves_the_plan_unchanged():
    plan = Plan("cpu", 1, 64, 1, 64, 1e-5, "", "fp32", warnings=("resolved",))
    probed = plan.with_probe(16, 2048, {"recommended": 16})
    assert (probed.mini_batch_size, probed.mini_batch_num_tokens, probed.mini_batch_probe) == (
        16,
        2048,
        {"recommended": 16},
    )
    assert probed.warnings == ("resolved",) and plan.mini_batch_size is None  # a new plan; the old one is frozen
    warned = plan.with_probe(64, warning="batch.mini_batch_size: auto has no effect")
    assert warned.warnings == ("resolved", "batch.mini_batch_size: auto has no effect")
    assert warned.mini_batch_probe is None and warned.mini_batch_num_tokens is None
    unchanged = {f.name for f in dataclasses.fields(Plan)} - {
        "mini_batch_size",
        "mini_batch_num_tokens",
        "mini_batch_probe",
        "warnings",
    }
    assert all(getattr(probed, n) == getattr(plan, n) for n in unchanged)
