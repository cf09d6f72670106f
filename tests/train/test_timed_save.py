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


def test_the_timed_save_is_taken_by_every_rank_when_any_rank_s_clock_says_so(monkeypatch):
    """Each rank reads its own clock: the ranks decide together (a max over them), or a rank whose
    clock is behind would skip the save its peers start (they would wait for it in a collective)."""
    peer_due = [1]  # what the other rank's clock says (1: its minutes have passed)
    monkeypatch.setattr("cembed.distributed.collectives.max_over_ranks", lambda value: max(value, peer_due[0]))
    now = [0.0]
    callback = TimedSaveCallback(2, clock=lambda: now[0])
    callback.on_train_begin(None, None, None)
    now[0] = 30.0  # this rank: 30 s since the start, not 120
    control = SimpleNamespace(should_save=False)
    callback.on_step_end(None, None, control)
    assert control.should_save  # the peer's clock decided
    peer_due[0] = 0
    control = SimpleNamespace(should_save=False)
    callback.on_step_end(None, None, control)
    assert not control.should_save  # nobody's minutes have passed
    now[0] = 121.0
    callback.on_step_end(None, None, control)
    assert control.should_save  # this rank's own clock still counts


def test_a_timed_save_run_also_saves_its_last_step():
    """So that a run stopped during its final save or evaluation is finished by --resume from that
    checkpoint, without training again (as train.save_steps runs already do)."""
    callback = TimedSaveCallback(60, clock=lambda: 0.0)
    for step, due in ((4, False), (5, True)):
        control = SimpleNamespace(should_save=False)
        callback.on_step_end(None, SimpleNamespace(global_step=step, max_steps=5), control)
        assert control.should_save is due


def test_save_every_minutes_is_a_config_field_a_resume_may_change():
    cfg = CembedConfig.model_validate({"data": {"train": "x.jsonl"}, "train": {"save_every_minutes": 30}})
    assert cfg.train.save_every_minutes == 30
    old = {"config": CembedConfig.model_validate({"data": {"train": "x.jsonl"}}).model_dump(mode="json")}
    assert resume_differences(old, {"config": cfg.model_dump(mode="json")}) == (
        [],
        ["train.save_every_minutes None -> 30.0"],
    )
