"""``train.torch_compile`` reaches the trainer's arguments (off by default), and a resume may
switch it (speed only, like dataloader_num_workers)."""

from __future__ import annotations

from cembed.config.schema import CembedConfig
from cembed.plan.resolve import resolve_plan
from cembed.train.args import build_training_args
from cembed.train.preflight import check_resume


def _cfg(**train) -> CembedConfig:
    return CembedConfig.model_validate(
        {"data": {"train": "pairs.jsonl"}, "model": {"device": "cpu"}, "train": {"output_dir": "/tmp/x", **train}}
    )


def test_torch_compile_is_the_trainers_option_and_off_by_default():
    default = _cfg()
    assert default.train.torch_compile is False
    assert build_training_args(default, resolve_plan(default)).torch_compile is False
    on = _cfg(torch_compile=True)
    args = build_training_args(on, resolve_plan(on))
    assert args.torch_compile is True and args.torch_compile_backend == "inductor"


def test_a_resume_may_switch_torch_compile(tmp_path):
    old = {"config": _cfg().model_dump(mode="json"), "samples_per_step": 64, "effective_learning_rate": 1e-5}
    new = {**old, "config": _cfg(torch_compile=True).model_dump(mode="json")}
    assert check_resume(str(tmp_path), old, new) == ["train.torch_compile False -> True"]
