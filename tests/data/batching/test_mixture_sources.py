"""Several training sources in one run (every batch from one source) and no column silently ignored.

The two real sources: the packaged COCO caption pairs (``cembed:coco-captions``) and SciFact
(query, abstract) pairs from the BEIR folder in tests/fixtures (its test qrels: the repository holds no
SciFact train split; ../shared/data/scifact has the full one).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import SCIFACT_TEST_SUBSET, end_gloo_rank, free_port, join_gloo_rank
from safetensors.torch import load_file
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import config_from_dict
from cembed.data.batching.full_table import SOURCE_SEED_STRIDE, NoDuplicatesSampler, build_batches
from cembed.data.batching.mixture import SourceMix, interleave
from cembed.data.identity import row_hashes
from cembed.data.load import load_training_data
from cembed.errors import RunInterrupted, UserError


def _sources(coco_rows: int, scifact_rows: int) -> dict:
    return {
        "coco": {"path": "cembed:coco-captions", "max_samples": coco_rows},
        "scifact": {"beir": str(SCIFACT_TEST_SUBSET), "split": "test", "max_samples": scifact_rows},
    }


def _config(tmp: Path, model_dir: Path, out: str, coco_rows=96, scifact_rows=64, batch=8, **train) -> dict:
    return {
        "model": {"name_or_path": str(model_dir), "max_seq_length": 16, "device": "cpu"},
        "data": {"train": _sources(coco_rows, scifact_rows), "cache_dir": str(tmp / "cache")},
        "batch": {"per_device_train_batch_size": batch, "mini_batch_size": batch},
        "optim": {"learning_rate": 1e-3, "warmup_ratio": 0.0},
        "train": {"logging_steps": 1, "output_dir": str(tmp / out), "seed": 7, **train},
    }


# --- the schedule ----------------------------------------------------------------------------


def test_schedules_are_exact():
    # round_robin: one of each in turn until one runs out (sentence-transformers' RoundRobinBatchSampler).
    assert interleave([3, 5], [1, 1], stop_when_short=True) == [0, 1, 0, 1, 0, 1]
    # weighted 1:3: the source furthest behind its share goes next (ties to the first); stops when
    # source 1 is asked for an 11th batch.
    assert interleave([10, 10], [1, 3], stop_when_short=True) == [1, 0] + [1, 1, 1, 0] * 3
    # proportional: every batch once.
    assert SourceMix(("a", "b"), (1, 1)).schedule([2, 4]) == [1, 0, 1, 1, 0, 1]
    seq = SourceMix(("a", "b"), (1, 1)).schedule([7, 30])
    assert seq.count(0) == 7 and seq.count(1) == 30
    # Every prefix of the epoch is within one batch of the proportional share, not only the whole.
    worst = max(abs(seq[:t].count(0) - t * 7 / 37) for t in range(1, 38))
    assert worst < 1, worst
    assert SourceMix(("a", "b", "c"), (1, 1, 1), "round_robin").schedule([4, 2, 9]) == [0, 1, 2, 0, 1, 2]


# --- the sampler on the two real sources -------------------------------------------------------


def _prepared(tmp_path, model_dir, **data):
    cfg = config_from_dict(_config(tmp_path, model_dir, "out", **data), base=tmp_path)
    return cfg, load_training_data(cfg.data)


def test_every_batch_is_one_source_with_proportional_shares(tiny_model_dir, tmp_path):
    cfg, data = _prepared(tmp_path, tiny_model_dir)
    assert [(s.name, s.rows, s.offset) for s in data.sources] == [("coco", 96, 0), ("scifact", 64, 96)]
    mix = SourceMix.from_data(data, cfg.data.sampling)
    sampler = NoDuplicatesSampler(data.dataset, 8, drop_last=True, seed=7, world_size=1, sources=mix)
    hashes = row_hashes(data.dataset, data.columns)
    # Each source alone, shuffled as the sampler shuffles it: the batches the mix must contain.
    alone = [build_batches(hashes[:96], 8, True, 7)[0], build_batches(hashes[96:], 8, True, 7 + SOURCE_SEED_STRIDE)[0]]
    assert [len(b) for b in alone] == [11, 8]  # 96 coco rows: one batch's worth of rows repeat a caption
    batches, order = list(sampler), sampler.batch_sources()
    assert len(sampler) == len(batches) == 19
    # Proportional: the smooth schedule over 11 and 8 batches, with each source's own batches in order.
    assert order == [0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert batches == [[r + 96 * i for r in alone[i][order[:k].count(i)]] for k, i in enumerate(order)]
    for batch, source in zip(batches, order):
        assert all((r >= 96) == (source == 1) for r in batch)  # one source per batch
    # Shares within one batch of the rows' proportions, over the epoch and every prefix of it.
    for t in range(1, 20):
        assert abs(order[:t].count(0) - t * 96 / 160) <= 1
    assert sampler.trained_per_source(19) == [(11, 88), (8, 64)] and sampler.unplaced == 8
    assert sampler.trained_per_source(5) == [(3, 24), (2, 16)]
    # A new epoch reshuffles inside each source; the same epoch gives the same batches (resume).
    sampler.set_epoch(1)
    assert list(sampler) != batches
    sampler.set_epoch(0)
    assert list(sampler) == batches


def test_round_robin_and_weights_from_config(tiny_model_dir, tmp_path):
    cfg, data = _prepared(tmp_path, tiny_model_dir)
    rr = config_from_dict(
        {
            **_config(tmp_path, tiny_model_dir, "o"),
            "data": {**cfg.data.model_dump(), "sampling": {"strategy": "round_robin"}},
        },
        base=tmp_path,
    )
    sampler = NoDuplicatesSampler(
        data.dataset, 8, True, seed=7, world_size=1, sources=SourceMix.from_data(data, rr.data.sampling)
    )
    assert sampler.batch_sources() == [0, 1] * 8 and len(sampler) == 16
    assert sampler.unplaced == 3 * 8 + 8  # coco's 3 batches past scifact's 8, and the 8 rows no batch holds
    weighted = cfg.data.model_copy(
        update={"sampling": cfg.data.sampling.model_copy(update={"weights": {"coco": 1, "scifact": 3}})}
    )
    sampler = NoDuplicatesSampler(
        data.dataset, 8, True, seed=7, world_size=1, sources=SourceMix.from_data(data, weighted.sampling)
    )
    assert sampler.batch_sources() == [1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1]  # scifact has 8 batches
    with pytest.raises(
        UserError, match=r"data: sampling.weights: names \['coco', 'nli'\] must be exactly the sources' names"
    ):
        config_from_dict(
            {
                **_config(tmp_path, tiny_model_dir, "o"),
                "data": {"train": _sources(8, 8), "sampling": {"weights": {"coco": 1, "nli": 2}}},
            },
            base=tmp_path,
        )


def test_two_ranks_get_one_source_per_step(tiny_model_dir, tmp_path):
    """Per-rank view of the sampler: rank r trains on slice r of each global batch (accelerate deals
    batch i to rank i % 2), so both ranks see the same source at every step."""
    cfg, data = _prepared(tmp_path, tiny_model_dir, coco_rows=48, scifact_rows=32)
    mix = SourceMix.from_data(data, cfg.data.sampling)
    sampler = NoDuplicatesSampler(data.dataset, 4, True, seed=7, world_size=2, sources=mix)
    slices = list(sampler)
    assert len(slices) == len(sampler) == 2 * len(sampler.batch_sources())
    for step, source in enumerate(sampler.batch_sources()):
        for rank in range(2):
            assert {r >= 48 for r in slices[2 * step + rank]} == {source == 1}


# --- training: summary counts, resume, two gloo ranks ------------------------------------------


def _run(cfg_dict, base, trainer_cls=None, **kwargs):

    from cembed.train.recipe import check_run_inputs, run_training

    cfg = config_from_dict(cfg_dict, base=base)
    plan, data = check_run_inputs(cfg)
    extra = {"trainer_cls": trainer_cls} if trainer_cls else {}
    return run_training(cfg, plan, data, **extra, **kwargs)


def _sigterm_at(step: int):
    from transformers import TrainerCallback

    from cembed.train.trainer import CembedTrainer

    class SignalAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                os.kill(os.getpid(), signal.SIGTERM)

    class Trainer(CembedTrainer):
        def train(self, *args, **kwargs):
            self.add_callback(SignalAt())
            return super().train(*args, **kwargs)

    return Trainer


@pytest.mark.slow
def test_two_source_resume_equals_uninterrupted(tiny_dropout_model_dir, tmp_path):
    straight = _run(_config(tmp_path, tiny_dropout_model_dir, "straight", max_steps=6), tmp_path)
    sources = straight["data"]["sources"]
    assert [(s["name"], s["rows"], s["batches_per_epoch"]) for s in sources] == [("coco", 96, 11), ("scifact", 64, 8)]
    # The first 6 steps of the schedule above: coco at steps 1, 3, 5 and scifact at 2, 4, 6.
    assert [(s["batches_trained"], s["rows_trained"]) for s in sources] == [(3, 24), (3, 24)]
    assert straight["data"]["sampling"] == "proportional" and straight["samples_seen"] == 48

    cfg = _config(tmp_path, tiny_dropout_model_dir, "killed", max_steps=6, save_steps=3)
    with pytest.raises(RunInterrupted) as stop:
        _run(cfg, tmp_path, _sigterm_at(3))
    assert 3 <= stop.value.step < 6  # stopped after the signal's step (the step in flight finishes)
    resumed = _run(cfg, tmp_path, resume=True)
    assert resumed["resumed_from"].endswith(f"checkpoint-{stop.value.step}") and resumed["steps"] == 6
    assert resumed["data"]["sources"] == sources
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def _rank(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, 2, port, 600)
    import accelerate.data_loader as adl

    seen: list[list[int]] = []
    original = adl.BatchSamplerShard.__iter__

    def recording(self):
        for batch in original(self):
            seen.append(list(batch))
            yield batch

    adl.BatchSamplerShard.__iter__ = recording
    cfg = _config(Path(tmp), Path(model_dir), "ddp", coco_rows=48, scifact_rows=32, batch=4, num_train_epochs=1)
    summary = _run(cfg, Path(tmp))
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({"batches": seen, "summary": summary["data"]}))
    end_gloo_rank()


@pytest.mark.slow
def test_two_gloo_ranks_train_the_same_source_each_step(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(str(tmp_path), str(tiny_model_dir), free_port()), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    sources = ranks[0]["summary"]["sources"]
    steps = sum(s["batches_per_epoch"] for s in sources)
    assert [len(r["batches"]) for r in ranks] == [steps, steps] and steps > 5
    per_step = [[int(b[0] >= 48) for b in r["batches"]] for r in ranks]
    assert per_step[0] == per_step[1]  # both ranks: the same source at every step
    for r in ranks:
        assert all(len({i >= 48 for i in b}) == 1 and len(b) == 4 for b in r["batches"])
    assert [per_step[0].count(0), per_step[0].count(1)] == [s["batches_trained"] for s in sources]
    assert [s["rows_trained"] for s in sources] == [8 * s["batches_trained"] for s in sources]


# --- columns ----------------------------------------------------------------------------------


def test_unmapped_negative_column_is_named_with_its_mapping(tiny_model_dir, write_config, pairs_file):
    rows = [{"anchor": f"q {i}", "positive": f"p {i}", "negative": f"n {i}", "source_id": i} for i in range(16)]
    path = pairs_file(rows)
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(path)},
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 4},
        }
    )
    result = CliRunner().invoke(app, ["validate", str(cfg)], terminal_width=400)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert (
        f"{path}: column(s) negative look like hard negatives but are not trained on; to use them add "
        "data.columns.negatives: [negative]" in out
    )
    assert f"{path}: column(s) source_id are not mapped in data.columns and are not trained on" in out


def test_list_of_negatives_is_expanded_with_a_count(tmp_path, pairs_file):
    rows = [
        {"anchor": f"q {i}", "positive": f"p {i}", "negs": [f"n {i} {j}" for j in range(2 + i % 2)]} for i in range(6)
    ]
    cfg = config_from_dict(
        {"data": {"train": str(pairs_file(rows)), "columns": {"negatives": ["negs"]}}}, base=tmp_path
    )
    data = load_training_data(cfg.data)
    assert data.columns == ["anchor", "positive", "negative_1", "negative_2"]
    assert data.roles == {"anchor": "anchor", "positive": "positive", "negative_1": "negs[1]", "negative_2": "negs[2]"}
    assert data.dataset[1] == {"anchor": "q 1", "positive": "p 1", "negative_1": "n 1 0", "negative_2": "n 1 1"}
    assert any(
        "column 'negs' holds lists of 2 to 3 negatives: expanded into 2 columns (negs[1]..negs[2]); 3 texts beyond "
        "the first 2 of a row are left out" in w
        for w in data.warnings
    )
    rows[4]["negs"] = []
    cfg = config_from_dict(
        {"data": {"train": str(pairs_file(rows)), "columns": {"negatives": ["negs"]}}}, base=tmp_path
    )
    with pytest.raises(UserError, match=r"row 5: column 'negs' \(data.train: negatives\) holds an empty list"):
        load_training_data(cfg.data)


def test_sources_with_different_roles_share_the_widest_layout(tmp_path, pairs_file):
    """Pairs beside triplets: the dataset has the triplets' columns, the pairs' rows hold nulls in the
    negative they do not map; each source keeps its own columns (views, batchability, sample texts)."""
    from cembed.data.batchable import check_batchable
    from cembed.data.rows import source_views

    triplets = pairs_file([{"anchor": f"a{i}", "positive": f"p{i}", "negative": f"n{i}"} for i in range(8)], "t.jsonl")
    pairs = pairs_file([{"q": f"q{i}", "a": f"x{i}"} for i in range(6)], "p.jsonl")
    cfg = config_from_dict(
        {
            "data": {
                "train": [
                    {"path": str(pairs), "columns": {"anchor": "q", "positive": "a"}},
                    {"path": str(triplets), "columns": {"negatives": ["negative"]}},
                ]
            }
        },
        base=tmp_path,
    )
    assert [s.name for s in cfg.data.sources()] == ["p", "t"] and cfg.data.max_columns() == 3
    data = load_training_data(cfg.data)
    assert data.columns == ["anchor", "positive", "negative_1"]
    assert data.source_columns() == [["anchor", "positive"], ["anchor", "positive", "negative_1"]]
    assert data.dataset[0] == {"anchor": "q0", "positive": "x0", "negative_1": None}
    assert data.dataset[6] == {"anchor": "a0", "positive": "p0", "negative_1": "n0"}
    assert data.roles == {"anchor": "q | anchor", "positive": "a | positive", "negative_1": "negative"}
    assert [v.columns for v in source_views(data)] == data.source_columns()
    assert data.sample_texts() == {"anchor": ["q0"], "positive": ["x0"], "negative_1": ["n0"]}
    check_batchable(data, 6, no_duplicates=True)  # the pairs' null negatives are not 1 distinct text


def test_inspect_data_and_unplaceable_rows_per_source(tiny_model_dir, tmp_path):
    from cembed.data.batching.placement import unplaceable_warnings
    from cembed.data.inspect import inspect_data
    from cembed.plan.resolve import resolve_plan

    cfg, data = _prepared(tmp_path, tiny_model_dir)
    reports = inspect_data(data, 8, True, 7)
    assert [(r.source.split(" ")[0], r.rows, r.batching["batches_per_epoch"]) for r in reports] == [
        ("data.train.coco", 96, 11),
        ("data.train.scifact", 64, 8),
    ]
    assert [r.batching["rows_unplaced"] for r in reports] == [8, 0]
    # coco's 8 unused rows are a whole batch beyond 96 % 8 = 0: named, for coco only.
    found = unplaceable_warnings(
        resolve_plan(cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"per_device_train_batch_size": 8})})),
        data,
        True,
        7,
    )
    placed = [w for w in found if "cannot be placed" in w]
    assert len(placed) == 1 and placed[0].startswith("8 of 96 rows cannot be placed in a duplicate-free batch of 8")
