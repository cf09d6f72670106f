"""A new batching rule through the registry only (``cembed.data.batching.rules.register_batching_rule``):
a toy rule that batches rows in table order is picked by ``sampler.rule``, reaches the trainer's
arguments, is not mistaken for the no-duplicates rule by the checks ahead or the run summary, and
(slow) trains with exactly its batches. The built-in rule keeps ``sampler.no_duplicates``' meaning."""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import pytest
from conftest import distinct_pairs
from sentence_transformers.base.sampler import BatchSamplers, DefaultBatchSampler

import cembed.train.recipe as T
from cembed.config.file import config_from_dict
from cembed.data.batching.full_table import NoDuplicatesSampler
from cembed.data.batching.mixture import SourceMix
from cembed.data.batching.rules import (
    RULES,
    batch_sampler,
    counted_batches,
    predicted_by_placement,
    register_batching_rule,
)
from cembed.errors import UserError
from cembed.plan.resolve import resolve_plan
from cembed.train.args import build_training_args


class FixedOrderSampler(DefaultBatchSampler):
    """Batches of consecutive rows in table order, the same every epoch: 0..B-1, B..2B-1, ...;
    records what it yields."""

    yielded: ClassVar[list[list[int]]] = []

    def __iter__(self):
        n = len(self.sampler)  # the dataset (torch's BatchSampler keeps it as `sampler`)
        stop = n - n % self.batch_size if self.drop_last else n
        for start in range(0, stop, self.batch_size):
            batch = list(range(start, min(start + self.batch_size, n)))
            FixedOrderSampler.yielded.append(batch)
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def fixed_order(settings, sources):
    """The rule's factory: one source only (a mix would need its schedule)."""
    if sources is not None and len(sources.names) > 1:
        raise UserError("sampler.rule: fixed_order batches one source; give one")
    return FixedOrderSampler


@pytest.fixture
def toy_rule():
    register_batching_rule("fixed_order", fixed_order)
    FixedOrderSampler.yielded = []
    yield
    RULES.pop("fixed_order", None)


def _cfg(tmp_path, rule=None, **sections):
    sampler = {"rule": rule} if rule else {}
    data = {"data": {"train": "x.jsonl"}, "model": {"device": "cpu"}, "sampler": sampler, **sections}
    return config_from_dict(data, base=tmp_path)


def test_the_rule_reaches_the_trainer_and_is_not_taken_for_no_duplicates(toy_rule, tmp_path):
    cfg = _cfg(tmp_path, "fixed_order")
    assert cfg.sampler.rule == "fixed_order" and cfg.sampler.no_duplicates  # the flag is the built-in rule's
    args = build_training_args(cfg, resolve_plan(cfg, world_size=1))
    assert args.batch_sampler is FixedOrderSampler
    assert not predicted_by_placement(cfg.sampler)  # validate does not predict its batches as no-duplicates ones
    sampler = FixedOrderSampler(list(range(10)), batch_size=4, drop_last=False)
    assert counted_batches(sampler) is None  # the summary counts steps x batch for it
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and len(sampler) == 3
    two = SourceMix(("a", "b"), (5, 5))
    with pytest.raises(UserError, match="fixed_order batches one source"):
        batch_sampler(cfg.sampler, two)


def test_the_built_in_rule_is_the_default_and_keeps_no_duplicates_meaning(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.sampler.rule == "no_duplicates" and predicted_by_placement(cfg.sampler)
    assert batch_sampler(cfg.sampler) is NoDuplicatesSampler
    plain = _cfg(tmp_path, sampler={"no_duplicates": False}).sampler
    assert batch_sampler(plain) == BatchSamplers.BATCH_SAMPLER and not predicted_by_placement(plain)
    two = SourceMix(("a", "b"), (5, 5))
    mixed = batch_sampler(plain, two)
    assert isinstance(mixed, partial) and mixed.func is NoDuplicatesSampler
    assert mixed.keywords == {"sources": two, "no_duplicates": False}
    from datasets import Dataset

    rows = Dataset.from_dict({"anchor": [f"a{i}" for i in range(4)], "positive": [f"p{i}" for i in range(4)]})
    counted = NoDuplicatesSampler(rows, batch_size=2, drop_last=False, world_size=1)
    assert counted_batches(counted) is counted


def test_counted_batches_unwraps_accelerates_per_rank_sampler():
    """With several processes the trainer's batch sampler is accelerate's per-rank shard of the rule's
    sampler: the summary's per-source counts come from the sampler inside it (issue 38 item 7)."""
    from accelerate.data_loader import BatchSamplerShard
    from datasets import Dataset

    rows = Dataset.from_dict({"anchor": [f"a{i}" for i in range(8)], "positive": [f"p{i}" for i in range(8)]})
    counted = NoDuplicatesSampler(rows, batch_size=2, drop_last=True, world_size=2)
    for rank in (0, 1):
        shard = BatchSamplerShard(counted, num_processes=2, process_index=rank, even_batches=False)
        assert counted_batches(shard) is counted
    assert counted_batches(BatchSamplerShard(FixedOrderSampler(list(range(8)), 2, True), num_processes=2)) is None


def test_an_unknown_rule_names_the_field_and_the_known_ones(toy_rule, tmp_path):
    cfg = _cfg(tmp_path, "fixed_ordr")
    with pytest.raises(
        UserError, match=r"^sampler\.rule: unknown batching rule 'fixed_ordr'; known: no_duplicates, fixed_order$"
    ):
        build_training_args(cfg, resolve_plan(cfg, world_size=1))


def test_a_stream_refuses_another_rule(tmp_path):
    data = {"train": {"path": "x.jsonl", "streaming": True}}
    with pytest.raises(
        UserError, match=r"sampler\.rule: fixed_order: a streaming source always batches by the windowed"
    ):
        config_from_dict({"data": data, "sampler": {"rule": "fixed_order"}, "train": {"max_steps": 3}}, base=tmp_path)


@pytest.mark.slow
def test_training_takes_exactly_the_rules_batches(toy_rule, tiny_model_dir, tmp_path, pairs_file):
    pairs = distinct_pairs(32)
    pairs[5] = dict(pairs[4])  # a repeated row: the toy rule batches it anyway (no text is compared)
    pairs_file(pairs)
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": "pairs.jsonl", "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
            "sampler": {"rule": "fixed_order"},
            "train": {"max_steps": 3, "logging_steps": 1, "output_dir": str(tmp_path / "out"), "seed": 2},
        },
        base=tmp_path,
    )
    plan, data = T.check_run_inputs(cfg)
    summary = T.run_training(cfg, plan, data)
    assert summary["status"] == "completed" and summary["steps"] == 3
    # The loader may fetch one batch ahead; the three trained are the rule's first three, in order.
    assert FixedOrderSampler.yielded[:3] == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    assert summary["samples_seen"] == 3 * 8  # not counted by the rule: steps x batch
    assert summary["data"]["batches_per_epoch"] == 4  # the sampler's own length (32 rows / 8)
    assert summary["data"]["sources"][0]["batches_per_epoch"] is None
