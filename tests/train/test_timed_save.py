"""``train.save_every_minutes`` (issue 33 item 3): a checkpoint at the end of the first step that ends
that long after the last save, beside the step-count saves."""

from __future__ import annotations

from types import SimpleNamespace

from cembed.config.schema import CembedConfig
from cembed.train.checkpoint import TimedSaveCallback
from cembed.train.preflight import resume_differences


def test_timed_save_asks_for_a_save_once_the_minutes_passed_since_the_last():
    now = [0.0]
    callback = TimedSaveCallback(2, clock=lambda: now[0])
    callback.on_train_begin(None, None, None)
    saves = []
    for t in (30, 90, 119, 120, 150, 200, 239, 241):  # seconds at the end of each step
        now[0] = float(t)
        control = SimpleNamespace(should_save=False)
        callback.on_step_end(None, None, control)
        if control.should_save:
            saves.append(t)
            callback.on_save(None, None, control)
    assert saves == [120, 241]


def test_save_every_minutes_is_a_config_field_a_resume_may_change():
    cfg = CembedConfig.model_validate({"data": {"train": "x.jsonl"}, "train": {"save_every_minutes": 30}})
    assert cfg.train.save_every_minutes == 30
    old = {"config": CembedConfig.model_validate({"data": {"train": "x.jsonl"}}).model_dump(mode="json")}
    assert resume_differences(old, {"config": cfg.model_dump(mode="json")}) == (
        [],
        ["train.save_every_minutes None -> 30.0"],
    )
