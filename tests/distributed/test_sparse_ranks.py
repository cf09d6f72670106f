"""A sparse run on 2 gloo ranks through the real trainer (issue 41 item 3): ``batch.global_batch_size: 8`` on
2 ranks x 4 rows (documents gathered, the FLOPS terms over the global batch) trains as 1 process x 8 rows,
under DDP and under FSDP (``distributed.strategy: fsdp``): the loss of each of 4 AdamW steps (the
regularizer weights ramping up over the first 2) and the final weights within 1e-5; the 2-rank DDP run's
checkpoint-2 resumes on 1 process to the same weights; the final FSDP folder is a full ``SparseEncoder``
giving the 1-process run's sparse embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import end_gloo_rank, free_port, join_gloo_rank, make_tiny_splade

pytestmark = pytest.mark.slow  # 2 spawned gloo ranks

WORLD, BATCH, STEPS = 2, 8, 4
WORDS = "man woman dog cat train table street car room plate food bus red blue white black".split()


def _config(tmp: Path, model_dir: str, out: str, strategy: str = "ddp") -> dict:
    data = tmp / "pairs.jsonl"
    if not data.exists():
        rows = [
            {
                "anchor": f"{WORDS[i % 16]} {i} on the {WORDS[(i * 5) % 16]}",
                "positive": f"the {WORDS[(i * 3) % 16]} {i}, {'near a ' + WORDS[(i * 7) % 16] + ' ' * (i % 3)}",
            }
            for i in range(BATCH * STEPS)
        ]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": {"kind": "sparse", "name_or_path": model_dir, "device": "cpu"},
        "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
        "batch": {"global_batch_size": BATCH, "mini_batch_size": 2},
        "optim": {"learning_rate": 1e-3, "lr_scaling": "none", "warmup_ratio": 0.0, "lr_scheduler_type": "constant"},
        "loss": {
            "document_regularizer_weight": 0.05,
            "query_regularizer_weight": 0.1,
            "regularizer_warmup_ratio": 0.5,
            "regularizer_schedule": "linear",
        },
        "distributed": {"strategy": strategy},
        "train": {"max_steps": STEPS, "save_steps": 2, "logging_steps": 1, "seed": 3, "output_dir": str(tmp / out)},
    }


def _run(cfg: dict, base: Path, resume_from: str | None = None) -> dict:
    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training

    cfg = config_from_dict(cfg, base=base)
    plan, data = check_run_inputs(cfg)
    return run_training(cfg, plan, data, resume_from=resume_from)


def _worker(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 900)
    tmp_path = Path(tmp)
    results = {}
    for strategy in ("ddp", "fsdp"):
        summary = _run(_config(tmp_path, model_dir, strategy, strategy), tmp_path)
        results[strategy] = {"losses": summary["losses"], "distributed": summary["distributed"]}
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(results))
    end_gloo_rank()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("sparse_ranks")
    make_tiny_splade(tmp / "model", bias=-0.2)
    model_dir = str(tmp / "model" / "hf")
    mp.spawn(_worker, args=(str(tmp), model_dir, free_port()), nprocs=WORLD, join=True)
    two = json.loads((tmp / "rank0.json").read_text())
    one = _run(_config(tmp, model_dir, "one"), tmp)
    resumed = _run(_config(tmp, model_dir, "two-to-one"), tmp, resume_from=str(tmp / "ddp" / "checkpoint-2"))
    return tmp, two, one, resumed


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _max_dw(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_as_one_process(runs, strategy):
    tmp, two, one, _ = runs
    assert (
        two[strategy]["distributed"]["gather_across_devices"] and two[strategy]["distributed"]["strategy"] == strategy
    )
    mine, theirs = one["losses"], two[strategy]["losses"]
    assert len(mine) == len(theirs) == STEPS
    d_loss = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(mine, theirs))
    d_w = _max_dw(tmp / "one", tmp / strategy)
    moved = _max_dw(tmp / "one", tmp / "model" / "hf")
    print(f"\n{strategy}: 2 ranks x 4 rows vs 1 x 8, {STEPS} steps: max rel |dloss| {d_loss:.2e}  max |dW| {d_w:.2e}")
    assert d_loss <= 1e-5 and d_w <= 1e-5 and moved > 1e-4


def test_the_fsdp_folder_is_a_sparse_encoder_giving_the_same_embeddings(runs):
    from sentence_transformers import SparseEncoder

    tmp, *_ = runs
    texts = ["a dog on the table", "the red car near a bus"]
    a, b = (SparseEncoder(str(tmp / out), device="cpu") for out in ("fsdp", "one"))
    for encode in ("encode_query", "encode_document"):
        x = getattr(a, encode)(texts, convert_to_tensor=True).to_dense()
        y = getattr(b, encode)(texts, convert_to_tensor=True).to_dense()
        assert (x != 0).any() and torch.allclose(x, y, atol=1e-5, rtol=0)


def test_a_two_rank_checkpoint_resumes_on_one_process(runs):
    tmp, two, _, resumed = runs
    summary = resumed["summary"] if "summary" in resumed else resumed
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert "world_size 2 -> 1" in summary["resume_changes"]
    losses = dict(map(tuple, two["ddp"]["losses"]))
    after = dict(map(tuple, summary["losses"]))
    assert sorted(after) == [1, 2, 3, 4]  # 1, 2: the checkpoint's history (the 2-rank run's own)
    d_loss = max(abs(after[s] - losses[s]) / abs(losses[s]) for s in after)
    d_w = _max_dw(tmp / "ddp", tmp / "two-to-one")
    print(f"\n2 -> 1 resume at step 2 vs the 2-rank run: max rel |dloss| {d_loss:.2e}  max |dW| {d_w:.2e}")
    assert d_loss <= 1e-5 and d_w <= 1e-5
