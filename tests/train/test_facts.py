"""cembed.train.facts: a run's batches per epoch (per source and through the sampling schedule),
its optimizer steps and warmup, the rows the no-duplicates sampler cannot place and the loss's path,
counted by hand for small tables (no model is loaded)."""

from __future__ import annotations

import pytest
from conftest import distinct_pairs

from cembed.config.data import SamplingConfig
from cembed.config.file import load_config
from cembed.data.rows import UnloadedData
from cembed.model.unpad import Unpadding
from cembed.plan.resolve import resolve_plan
from cembed.train.facts import LossPath, StepFacts, batch_count, loss_path, run_facts
from cembed.train.recipe import check_run_inputs

POPULAR = "a popular answer"


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _config(write_config, data, per_device=4, **sections):
    """A config training on ``data`` (``data.train``) with ``sections`` (``batch`` merged)."""
    cfg = {
        "model": {"device": "cpu"},
        "data": {"train": data},
        "batch": {"per_device_train_batch_size": per_device, "mini_batch_size": 2, **sections.pop("batch", {})},
    }
    cfg.update(sections)
    return load_config(write_config(cfg))


def _facts(cfg, **kwargs):
    plan, data = check_run_inputs(cfg)
    return run_facts(cfg, plan, data, **kwargs)


def test_batch_count_counts_a_short_last_batch_unless_dropped():
    assert batch_count(10, 4, drop_last=False) == 3
    assert batch_count(10, 4, drop_last=True) == 2
    assert batch_count(8, 4, drop_last=True) == batch_count(8, 4, drop_last=False) == 2
    assert batch_count(3, 4, drop_last=True) == 0


def test_epochs_give_steps_per_epoch_total_and_warmup(write_config, pairs_file):
    # 10 rows, batch 4, short last batch kept: 3 batches; 2 per optimizer step: ceil(3 / 2) = 2 steps
    # an epoch; 2.5 epochs: ceil(2.5 x 2) = 5 steps, ceil(5 x 0.25) = 2 of them warmup.
    cfg = _config(
        write_config,
        str(pairs_file(distinct_pairs(10))),
        batch={"drop_last": False, "gradient_accumulation_steps": 2},
        optim={"warmup_ratio": 0.25},
        train={"num_train_epochs": 2.5},
    )
    facts = _facts(cfg)
    assert (facts.global_batch, facts.drop_last) == (4, False)
    assert facts.source_batches == (3,) and facts.batches_per_epoch == 3
    assert facts.steps == StepFacts(total=5, total_from="train.num_train_epochs: 2.5", per_epoch=2, warmup=2)
    assert facts.warnings == ()


def test_drop_last_and_max_steps(write_config, pairs_file):
    # drop_last (the default): 10 rows give 2 batches of 4; train.max_steps sets the length, the
    # warmup is ceil(7 x 0.1) = 1 step.
    cfg = _config(write_config, str(pairs_file(distinct_pairs(10))), train={"max_steps": 7})
    facts = _facts(cfg)
    assert facts.drop_last is True and facts.batches_per_epoch == 2
    assert facts.steps == StepFacts(total=7, total_from="train.max_steps", per_epoch=2, warmup=1)


def test_two_processes_force_drop_last_and_double_the_global_batch(write_config, pairs_file):
    cfg = _config(write_config, str(pairs_file(distinct_pairs(10))), batch={"drop_last": False})
    plan, data = check_run_inputs(cfg)
    plan = resolve_plan(cfg, world_size=2)  # the data does not depend on it: 10 rows in batches of 8
    facts = run_facts(cfg, plan, data)
    assert (facts.global_batch, facts.drop_last, facts.batches_per_epoch) == (8, True, 1)
    assert facts.steps.per_epoch == 1 and facts.steps.total == 1  # one epoch (train.num_train_epochs 1)


@pytest.mark.parametrize(
    ("sampling", "batches"),
    [
        ({}, 4),  # proportional: every source's batches once: 3 + 1
        ({"strategy": "round_robin"}, 2),  # one of each in turn until b runs out
        ({"weights": {"a": 1, "b": 1}}, 3),  # equal shares, ties to a: a, b, a, then b's turn finds none
    ],
)
def test_several_sources_count_batches_per_source_through_the_schedule(write_config, pairs_file, sampling, batches):
    rows = distinct_pairs(14)
    train = {"a": {"path": str(pairs_file(rows[:10], "a.jsonl"))}, "b": {"path": str(pairs_file(rows[10:], "b.jsonl"))}}
    cfg = _config(write_config, train, batch={"drop_last": False})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"sampling": SamplingConfig(**sampling)})})
    facts = _facts(cfg)
    assert facts.source_batches == (3, 1)  # 10 rows and 4 rows in batches of 4
    assert facts.batches_per_epoch == batches and facts.steps.per_epoch == batches


def test_unplaceable_rows_are_warnings_of_the_no_duplicates_sampler_only(write_config, pairs_file):
    # 12 rows, 8 sharing one positive: a duplicate-free batch of 4 holds one of them, so one batch is
    # built and 8 rows are left out (tests/data/test_placement.py counts the same table).
    rows = [{"anchor": f"question {i}", "positive": POPULAR if i < 8 else f"answer {i}"} for i in range(12)]
    path = str(pairs_file(rows))
    (warning,) = _facts(_config(write_config, path)).warnings
    assert warning.startswith("8 of 12 rows cannot be placed in a duplicate-free batch of 4 (1 batches per epoch)")
    assert f"{POPULAR!r} is in 8 rows" in warning
    plain = _config(write_config, path, sampler={"no_duplicates": False})
    assert _facts(plain).warnings == ()  # a plain sampler places every row
    assert _facts(_config(write_config, path), placement=False).warnings == ()
    # the counts are the rows', not the sampler's: 12 rows are 3 batches of 4
    assert _facts(_config(write_config, path)).batches_per_epoch == 3


def test_unloaded_hub_data_counts_nothing(write_config, pairs_file):
    cfg = _config(write_config, str(pairs_file(distinct_pairs(10))), optim={"warmup_ratio": 0.5})
    plan = resolve_plan(cfg)
    facts = run_facts(cfg, plan, UnloadedData("org/pairs", "offline: HF_DATASETS_OFFLINE=1"))
    assert (facts.source_batches, facts.batches_per_epoch, facts.warnings) == ((), None, ())
    assert facts.steps == StepFacts(total=None, total_from="train.num_train_epochs: 1", per_epoch=None, warmup=None)
    capped = _config(write_config, str(pairs_file(distinct_pairs(10))), train={"max_steps": 9})
    steps = run_facts(capped, resolve_plan(capped), UnloadedData("org/pairs", "offline")).steps
    assert steps == StepFacts(total=9, total_from="train.max_steps", per_epoch=None, warmup=1)


def test_the_loss_path(write_config, pairs_file):
    path = str(pairs_file(distinct_pairs(10)))
    cached = _config(write_config, path, batch={"sort_by_length": False})  # the default loss: cached_mnrl
    plan = resolve_plan(cached)
    assert loss_path(cached, plan) == LossPath(True, 2, False, None, 4)  # packing unknown without the model
    packs = Unpadding(True, "packed rows")
    assert loss_path(cached, plan, attention=packs).packed is True
    assert loss_path(cached, plan, attention=packs).description == "packed (unpadded) mini-batches"
    pads = loss_path(cached, plan, attention=Unpadding(False, "padded"))
    assert pads.description == "sorted=False, padded per mini-batch of 2"
    plain = _config(write_config, path, loss={"name": "mnrl"})
    assert loss_path(plain, resolve_plan(plain)) == LossPath(False, 4, False, False, 3)  # one forward, the batch
    auto = _config(write_config, path, batch={"mini_batch_size": "auto"})
    assert loss_path(auto, resolve_plan(auto)).mini_batch_size == 4  # auto: probed later; the batch until then
    assert _facts(cached).loss == loss_path(cached, plan)


@pytest.mark.parametrize(
    ("sampling", "drop_last", "unused"),
    [
        # 37 rows -> 9 batches of 4 (a short batch of 1 row is never kept), 8 rows -> 2: two rounds,
        # 8 of 37 rows trained
        ({"strategy": "round_robin"}, False, {0: 29}),
        # drop_last: 9 full batches and 2; still 2 rounds: the 29 rows include the 1 no batch holds
        ({"strategy": "round_robin"}, True, {0: 29}),
        # equal weights: a, b, a, b, a, then b's turn finds none: big trains 3 batches (12 rows)
        ({"weights": {"big": 1, "small": 1}}, False, {0: 25}),
        # small weighted 4x: b, b, a, then b's turn finds none: big trains one batch (4 rows)
        ({"weights": {"big": 1, "small": 4}}, False, {0: 33}),
        ({}, False, {}),  # proportional: every batch of every source, nothing unused
    ],
)
def test_a_schedule_that_leaves_rows_unused_says_so_and_counts_what_the_sampler_yields(
    write_config, pairs_file, sampling, drop_last, unused
):
    """Issue 32 item 10: round_robin / weighted end the epoch when a source runs out; the other
    sources' remaining rows go unused each epoch. The warning's count is the one the sampler's own
    epoch plan gives: compared here to the rows the training sampler yields for epoch 0."""
    from collections import Counter

    from cembed.data.batching.full_table import NoDuplicatesSampler
    from cembed.data.batching.mixture import SourceMix

    rows = distinct_pairs(45)
    train = {
        "big": {"path": str(pairs_file(rows[:37], "big.jsonl"))},
        "small": {"path": str(pairs_file(rows[37:], "small.jsonl"))},
    }
    cfg = _config(write_config, train, batch={"drop_last": drop_last}, train={"seed": 3})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"sampling": SamplingConfig(**sampling)})})
    plan, data = check_run_inputs(cfg)
    facts = run_facts(cfg, plan, data)
    strategy = cfg.data.sampling.resolved_strategy
    expected = [
        f"{data.sources[i].where}: {n} of 37 rows ({round(100 * n / 37)}%) unused each epoch under "
        f"data.sampling.strategy {strategy}"
        for i, n in unused.items()
    ]
    # (37 rows leave one row over a batch of 4 either way: the unplaceable-rows warning says that)
    found = [w for w in facts.warnings if "unused each epoch" in w]
    assert [w.split(": the schedule")[0] for w in found] == expected, facts.warnings
    assert all("set data.sampling.strategy: proportional" in w for w in found)
    # what the trainer's sampler yields in one epoch, per source
    sampler = NoDuplicatesSampler(
        data.dataset, 4, drop_last, seed=3, world_size=1, sources=SourceMix.from_data(data, cfg.data.sampling)
    )
    sampler.set_epoch(0)
    yielded = Counter(int(r >= 37) for batch in sampler for r in batch)
    assert 37 - yielded[0] == unused.get(0, 1)  # proportional: only the row no batch of 4 holds
    assert yielded[1] == 8
