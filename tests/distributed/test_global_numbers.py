"""The whole batch's numbers from every rank (issue 38 items 5 and 6), on 2 gloo ranks.

- A table run's ``step_losses`` are the global step's loss (the mean over the ranks, as the
  trainer logs it): equal to ``losses`` / ``train.log`` and to the loss of step 1's global batch
  computed here by hand (the initial model on both ranks' rows, scored against all positives).
- A stream with many repeated texts: every global batch (both ranks' slices, as each rank's loss
  saw them) is duplicate-free, and the global batches are the 1-process run's with the same
  ``batch.global_batch_size``.

One pair of spawned ranks runs both (module fixture); the 1-process stream run is in the test
process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import end_gloo_rank, free_port, join_gloo_rank

WORLD = 2
GLOBAL = 8  # rows per global batch: 2 ranks x 4
STEPS = 3  # the table run's
STREAM_STEPS = 12


def _table_rows() -> list[dict]:
    words = "man woman dog cat train table street car room plate food bus red blue white black".split()
    return [
        {"anchor": f"a {words[i % 16]} {i}", "positive": f"the {words[(i * 5) % 16]} next to {i}"} for i in range(48)
    ]


def _stream_rows() -> list[dict]:
    # 200 rows drawing from 14 anchors and 16 positives: nearly every text repeats within a few rows.
    import random

    pick = random.Random(0)
    return [{"anchor": f"topic {pick.randrange(14)}", "positive": f"answer {pick.randrange(16)}"} for _ in range(200)]


def _config(tmp: Path, model_dir: Path, name: str, data: Path, stream: bool) -> dict:
    train = {"path": str(data), "streaming": {"window_batches": 2}} if stream else str(data)
    return {
        "model": {"name_or_path": str(model_dir), "max_seq_length": 16, "device": "cpu"},
        "data": {"train": train, "cache_dir": str(tmp / "cache")},
        "batch": {"global_batch_size": GLOBAL, "mini_batch_size": 2},
        "optim": {"learning_rate": 1e-3, "base_batch_size": GLOBAL, "warmup_ratio": 0.0},
        "loss": {"name": "cached_mnrl", "scale": 20},
        "train": {
            "max_steps": STREAM_STEPS if stream else STEPS,
            "logging_steps": 1,
            "seed": 5,
            "output_dir": str(tmp / name),
        },
    }


def _recording_trainer(record: list):
    """A CembedTrainer that appends each training batch's token ids (padding stripped) per column."""
    from cembed.train.trainer import CembedTrainer

    class Recording(CembedTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                batch = {}
                for column in ("anchor", "positive"):
                    ids, mask = inputs[f"{column}_input_ids"], inputs[f"{column}_attention_mask"]
                    batch[column] = [i[m.bool()].tolist() for i, m in zip(ids, mask)]
                record.append(batch)
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def _train(cfg_dict: dict, base: Path, record: list) -> dict:
    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training

    cfg = config_from_dict(cfg_dict, base=base)
    plan, data = check_run_inputs(cfg)
    return run_training(cfg, plan, data, trainer_cls=_recording_trainer(record))


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _worker(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 600)
    tmp_path, model_path = Path(tmp), Path(model_dir)
    results = {}
    for name, stream in (("table", False), ("stream", True)):
        record: list = []
        cfg = _config(tmp_path, model_path, name, tmp_path / f"{name}.jsonl", stream)
        summary = _train(cfg, tmp_path, record)
        kept = {k: summary[k] for k in ("step_losses", "losses", "steps")}
        kept |= {"batch": summary["config"]["batch"], "sources": summary["data"]["sources"]}
        results[name] = {"summary": kept, "batches": record}
    (tmp_path / f"results-rank{rank}.json").write_text(json.dumps(results))
    end_gloo_rank()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    """Both 2-rank runs, once: ``(tmp, [rank 0's results, rank 1's])``."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("global_numbers")
    _write_rows(tmp / "table.jsonl", _table_rows())
    _write_rows(tmp / "stream.jsonl", _stream_rows())
    mp.spawn(_worker, args=(str(tmp), str(tiny_model_dir), free_port()), nprocs=WORLD, join=True)
    return tmp, [json.loads((tmp / f"results-rank{r}.json").read_text()) for r in range(WORLD)]


def _global_batches(results: list[dict], name: str) -> list[dict]:
    """Each step's global batch: rank 0's slice, then rank 1's, per column."""
    per_rank = [r[name]["batches"] for r in results]
    assert len(per_rank[0]) == len(per_rank[1])
    return [{c: b0[c] + b1[c] for c in b0} for b0, b1 in zip(*per_rank)]


def _hand_loss(model_dir: Path, batch: dict, scale: float = 20.0) -> float:
    """MultipleNegativesRankingLoss of one batch with the model at ``model_dir``: every anchor's
    cosine similarity x ``scale`` to every positive, cross entropy on its own positive, the mean."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    model.eval()

    def embed(rows: list[list[int]]) -> torch.Tensor:
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        with torch.no_grad():
            return model({"input_ids": ids, "attention_mask": mask})["sentence_embedding"].double()

    a = torch.nn.functional.normalize(embed(batch["anchor"]), dim=-1)
    p = torch.nn.functional.normalize(embed(batch["positive"]), dim=-1)
    scores = scale * a @ p.T
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(a))).item()


@pytest.mark.slow
def test_step_losses_are_the_global_steps_loss(two_ranks, tiny_model_dir):
    tmp, results = two_ranks
    summaries = [r["table"]["summary"] for r in results]
    step_losses = [dict(map(tuple, s["step_losses"])) for s in summaries]
    logged = dict(map(tuple, summaries[0]["losses"]))  # the trainer's logged loss: the mean over ranks
    assert sorted(step_losses[0]) == sorted(logged) == list(range(1, STEPS + 1))
    for step, value in logged.items():
        assert step_losses[0][step] == pytest.approx(value, abs=1e-6), step
        assert step_losses[1][step] == step_losses[0][step], step  # every rank has the same numbers
    # train.log prints each logged loss to 4 decimals
    lines = (tmp / "table" / "train.log").read_text()
    printed = {int(s): float(v) for s, v in re.findall(r"step (\d+)/\d+ +loss ([0-9.]+)", lines)}
    assert printed.keys() == logged.keys()
    for step, value in printed.items():
        assert step_losses[0][step] == pytest.approx(value, abs=5e-5), step
    # by hand: step 1 trained the initial weights on both ranks' rows, each anchor against all 8 positives
    first = _global_batches(results, "table")[0]
    assert len(first["anchor"]) == GLOBAL
    by_hand = _hand_loss(tiny_model_dir, first)
    print(
        f"\nstep 1: step_losses {step_losses[0][1]:.7f}  logged {logged[1]:.7f}  by hand {by_hand:.7f}  "
        f"|d| {abs(step_losses[0][1] - by_hand):.1e}"
    )
    assert step_losses[0][1] == pytest.approx(by_hand, abs=1e-6)


@pytest.mark.slow
def test_the_summary_records_the_runs_batch_and_counts_with_two_ranks(two_ranks):
    """The config as run holds the per-device batch batch.global_batch_size derived (not the schema's
    default 64), and the per-source counts come through accelerate's per-rank sampler."""
    _, results = two_ranks
    summary = results[0]["table"]["summary"]
    assert (summary["batch"]["per_device_train_batch_size"], summary["batch"]["global_batch_size"]) == (4, GLOBAL)
    (source,) = summary["sources"]
    assert (source["batches_per_epoch"], source["batches_trained"], source["rows_trained"]) == (
        6,
        STEPS,
        STEPS * GLOBAL,
    )


def _repeats(batch: dict) -> int:
    """Texts (token ids, any column) that occur more than once in ``batch``."""
    texts = [tuple(t) for column in batch.values() for t in column]
    return len(texts) - len(set(texts))


@pytest.mark.slow
def test_a_stream_on_two_ranks_has_duplicate_free_global_batches(two_ranks, tiny_model_dir):
    tmp, results = two_ranks
    batches = _global_batches(results, "stream")
    assert len(batches) == STREAM_STEPS and all(len(b["anchor"]) == GLOBAL for b in batches)
    with_repeat = sum(_repeats(b) > 0 for b in batches)
    print(f"\nstream, 2 ranks: {with_repeat} of {len(batches)} global batches hold a repeated text")
    assert with_repeat == 0
    # the 1-process run of the same config: the same global batches, row for row
    record: list = []
    alone = _train(_config(tmp, tiny_model_dir, "stream-1proc", tmp / "stream.jsonl", True), tmp, record)
    assert record == batches
    # the window rule's counts are the global batches', the same on every rank as in one process
    streams = [r["stream"]["summary"]["sources"][0]["stream"] for r in results]
    assert streams[0]["world_size"] == 2 and streams[0]["counts"]["rows_read"] == 200  # every rank read it all
    assert streams[0]["counts"] == streams[1]["counts"] == alone["data"]["sources"][0]["stream"]["counts"]
