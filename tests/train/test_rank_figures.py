"""What each rank does on its own, checked in one process with the collectives stood in for
(issue 38 item 7): the step losses averaged over the ranks, reduced on every rank, and a resume
without this rank's RNG state re-seeding it by its own rank."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import cembed.train.trainer as trainer_module
from cembed.train.checkpoint import reseeded
from cembed.train.trainer import CembedTrainer, RunLog, RunLogCallback


def _bare_trainer() -> CembedTrainer:
    """A CembedTrainer with only the step-loss bookkeeping (no model, no data)."""
    trainer = object.__new__(CembedTrainer)
    trainer._pending_losses, trainer._step_losses, trainer._global_losses = [], {}, {}
    trainer._skipped_steps = set()
    return trainer


def _two_ranks(monkeypatch, other=lambda v: 3 * v):
    """Stand in for gather_over_ranks in the trainer: this rank's values and a second rank's
    (``other`` of each); returns the list of calls."""
    calls: list[list[float]] = []

    def gather(values):
        calls.append(list(values))
        return [list(values), [other(v) for v in values]]

    monkeypatch.setattr(trainer_module, "gather_over_ranks", gather)
    return calls


def test_step_losses_are_the_mean_over_ranks_of_each_ranks_loss(monkeypatch):
    calls = _two_ranks(monkeypatch)
    trainer = _bare_trainer()
    # step 1 in two accumulated micro-batches (each loss / 2), step 2 in one; step 3 skipped (non-finite)
    for step, value in ((1, 0.5), (1, 0.25), (2, 1.0), (3, float("nan"))):
        trainer._pending_losses.append((step, torch.tensor(value)))
    trainer._skipped_steps.add(3)
    assert trainer.step_losses()[:2] == [(1, 1.5), (2, 2.0)]  # rank 0: 0.75 and 1.0; rank 1: 2.25 and 3.0
    assert [s for s, _ in trainer.step_losses()] == [1, 2]
    assert len(calls) == 1 and calls[0][:2] == [0.75, 1.0]  # one gather for the pending steps, none after
    trainer._pending_losses.append((4, torch.tensor(0.5)))
    assert trainer.step_loss(4) == 1.0 and calls[-1] == [0.5]  # only the new step is gathered


def test_every_rank_reduces_each_steps_loss_at_its_end(monkeypatch):
    """The reduction is a collective: a rank other than 0 joins it at every step end too (else rank 0
    would wait in it), though only rank 0 shows the loss."""
    calls = _two_ranks(monkeypatch)
    trainer = _bare_trainer()
    log = RunLog()
    callback = RunLogCallback(log, 8, step_loss=trainer.step_loss)
    for rank_zero in (False, True):
        step = len(calls) + 1
        trainer._pending_losses.append((step, torch.tensor(0.25)))
        state = SimpleNamespace(global_step=step, is_world_process_zero=rank_zero)
        callback.on_step_end(None, state, None)
        assert len(calls) == step
    assert log.step_loss == 0.5  # rank 0 shows the global step's loss: (0.25 + 0.75) / 2


def test_a_resume_without_this_ranks_rng_state_reseeds_it_by_its_rank(tmp_path):
    """A checkpoint of another world size holds no RNG state for this process: each rank is re-seeded
    with its own seed (rank 1 is not rank 0's stream)."""
    seeds = {}
    for rank in (0, 1):
        trainer = object.__new__(CembedTrainer)
        trainer.args = SimpleNamespace(seed=42, world_size=2, process_index=rank)
        trainer.state = SimpleNamespace(global_step=6)
        CembedTrainer._load_rng_state(trainer, str(tmp_path))  # an empty folder: no RNG state for 2 processes
        seeds[rank] = torch.initial_seed()
    assert seeds == {0: reseeded(42, 6, 0), 1: reseeded(42, 6, 1)} and seeds[0] != seeds[1]
