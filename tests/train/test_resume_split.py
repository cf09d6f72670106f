"""Issue 33 item 2: a resume may change how a step is split over processes (the world size, the
per-device batch at the same samples per step), not what is trained; it says that the per-process
RNG streams are re-seeded, and refuses a split that changes what an anchor is contrasted with."""

from __future__ import annotations

import pytest

from cembed.config.schema import CembedConfig
from cembed.errors import UserError
from cembed.plan.resolve import resolve_plan
from cembed.train.checkpoint import holds_rng_states, reseeded, rng_state_file
from cembed.train.preflight import check_resume, resume_differences, training_record


def _record(world: int, gather: bool | None = None, **batch) -> dict:
    cfg = CembedConfig.model_validate(
        {
            "data": {"train": "pairs.jsonl"},
            "model": {"device": "cpu"},
            "batch": {"mini_batch_size": 2, **(batch or {"global_batch_size": 8})},
            "loss": {"gather_across_devices": gather},
            "train": {"output_dir": "/tmp/x"},
        }
    )
    plan = resolve_plan(cfg, world)
    rows = [{"anchor": "a", "positive": "b"}]
    return training_record(
        cfg, plan.samples_per_step, plan.learning_rate, rows, plan.precision, plan.world_size, plan.contrast_rows
    )


RESEEDED_2_TO_1 = (
    "RNG streams (dropout) re-seeded per rank: the checkpoint holds 2 process(es)' RNG states, this run has 1"
)


def test_a_new_world_size_with_the_same_global_batch_is_a_safe_change():
    assert resume_differences(_record(2), _record(1)) == ([], ["world_size 2 -> 1", RESEEDED_2_TO_1])
    assert resume_differences(_record(1), _record(4))[1][0] == "world_size 1 -> 4"
    assert resume_differences(_record(2), _record(2)) == ([], [])


def test_a_new_per_device_batch_at_the_same_samples_per_step_is_a_safe_change(tmp_path):
    old, new = _record(2, per_device_train_batch_size=4), _record(1, per_device_train_batch_size=8)
    assert check_resume(str(tmp_path), old, new) == [
        "batch.per_device_train_batch_size 4 -> 8",
        "world_size 2 -> 1",
        RESEEDED_2_TO_1,
    ]
    # from per_device_train_batch_size to global_batch_size, same 8 samples per step
    assert resume_differences(old, _record(1))[0] == []
    # more samples per step changes what is trained: the batch field is refused with it
    refused, _ = resume_differences(old, _record(2, per_device_train_batch_size=8))
    assert refused == [
        "batch.per_device_train_batch_size 4 -> 8",
        "effective_learning_rate 1e-05 -> 1.4142135623730953e-05",
        "samples_per_step 8 -> 16",
    ]


def test_a_global_batch_size_resume_names_the_per_device_batch_it_derives(tmp_path):
    """Issue 38 item 5: a batch.global_batch_size run records the per-device batch it trains, not the
    schema's unused default (64), so a resume names only the fields that changed, with their values."""
    old = _record(2, per_device_train_batch_size=4)
    assert check_resume(str(tmp_path), old, _record(1)) == [
        "batch.global_batch_size None -> 8",
        "batch.per_device_train_batch_size 4 -> 8",
        "world_size 2 -> 1",
        RESEEDED_2_TO_1,
    ]
    assert _record(2)["config"]["batch"]["per_device_train_batch_size"] == 4
    # both runs set the global batch: the per-device one follows the world size, whose change is named
    assert check_resume(str(tmp_path), _record(2), _record(1)) == ["world_size 2 -> 1", RESEEDED_2_TO_1]
    assert check_resume(str(tmp_path), _record(1), old) == [
        "batch.global_batch_size 8 -> None",
        "batch.per_device_train_batch_size 8 -> 4",
        "world_size 1 -> 2",
        "RNG streams (dropout) re-seeded per rank: the checkpoint holds 1 process(es)' RNG states, this run has 2",
    ]
    assert check_resume(str(tmp_path), _record(2), _record(2)) == []
    # a record written before the derived batch was recorded: its unused default is no change either
    older = _record(2)
    older["config"]["batch"]["per_device_train_batch_size"] = 64
    assert check_resume(str(tmp_path), older, _record(2)) == []
    assert check_resume(str(tmp_path), _record(2), older) == []
    assert check_resume(str(tmp_path), older, old) == ["batch.global_batch_size 8 -> None"]  # 4 rows per device


def test_a_split_that_changes_the_contrast_is_refused_naming_the_field(tmp_path):
    # gather_across_devices false: each of 2 processes contrasts its own 4 rows; on 1 process all 8
    old, new = _record(2, gather=False), _record(1, gather=False)
    with pytest.raises(UserError) as err:
        check_resume("ck", old, new)
    message = str(err.value)
    assert message.startswith(
        "cannot resume ck with a changed config: loss.gather_across_devices: each process contrasts only its own "
        "rows, so the split over 2 -> 1 process(es) changes the rows an anchor is contrasted with (4 -> 8); "
        "resume on 2 process(es), or set loss.gather_across_devices: true for a fresh run"
    ), message
    assert check_resume("ck", _record(2, gather=True), _record(1, gather=True)) == [
        "world_size 2 -> 1",
        RESEEDED_2_TO_1,
    ]


def test_a_record_from_before_the_split_was_recorded_compares_without_it():
    old = _record(2)
    del old["world_size"], old["contrast_rows"]
    assert resume_differences(old, _record(1)) == ([], [])


def test_rng_file_names_and_reseeding():
    assert [rng_state_file(1, 0), rng_state_file(2, 0), rng_state_file(2, 1)] == [
        "rng_state.pth",
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]
    seeds = {reseeded(42, step, rank) for step in (3, 4) for rank in range(4)}
    assert len(seeds) == 8 and reseeded(42, 3, 1) == reseeded(42, 3, 1)
    # the documented seed: a resume at step 3 on rank 1 of a run seeded 42
    assert [reseeded(42, 3, 0), reseeded(42, 3, 1), reseeded(7, 0, 5)] == [3_000_051, 3_000_052, 12]


@pytest.mark.parametrize(
    ("saved", "world", "holds"),
    [
        (["rng_state.pth"], 1, True),
        (["rng_state_0.pth", "rng_state_1.pth"], 2, True),
        (["rng_state_0.pth", "rng_state_1.pth"], 1, False),
        (["rng_state_0.pth", "rng_state_1.pth"], 3, False),  # 0 and 1 would find another split's states
        (["rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"], 2, False),
        (["rng_state.pth"], 2, False),
    ],
)
def test_rng_states_load_only_on_the_world_size_that_saved_them(tmp_path, saved, world, holds):
    for name in saved:
        (tmp_path / name).write_bytes(b"")
    assert holds_rng_states(tmp_path, world) is holds
