"""A multi-vector run on 2 gloo ranks through the real trainer (issue 40 item 4 and acceptance): 2 ranks x B
rows with documents gathered across ranks train as 1 process x 2B rows, under DDP and under FSDP
(``distributed.strategy: fsdp``): the loss of each of 3 AdamW steps and the final weights within 1e-5;
the final FSDP folder is a full ``MultiVectorEncoder``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import end_gloo_rank, free_port, join_gloo_rank

pytestmark = pytest.mark.slow  # 2 spawned gloo ranks

WORLD, ROWS, STEPS = 2, 8, 3  # ROWS: the global batch (2 x 4 rows == 1 x 8 rows)
WORDS = "man woman dog cat train table street car room plate food bus red blue white black".split()


def _config(tmp: Path, model_dir: str, world: int, out: str, strategy: str = "ddp") -> dict:
    data = tmp / "pairs.jsonl"
    if not data.exists():
        rows = [
            {
                "anchor": f"{WORDS[i % 16]} {i} on the {WORDS[(i * 5) % 16]}",
                "positive": f"the {WORDS[(i * 3) % 16]} {i}, {'near a ' + WORDS[(i * 7) % 16] + ' ' * (i % 3)}",
                "negative": f"two {WORDS[(i + 9) % 16]} {i} by the {WORDS[(i * 11) % 16]} {'car ' * (i % 4)}",
            }
            for i in range(ROWS * STEPS)
        ]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": {"kind": "multi_vector", "name_or_path": model_dir, "device": "cpu", "dim": 16, "document_length": 20},
        "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
        "batch": {"per_device_train_batch_size": ROWS // world, "mini_batch_size": 2},
        "optim": {"learning_rate": 1e-3, "lr_scaling": "none", "warmup_ratio": 0.0, "lr_scheduler_type": "constant"},
        "loss": {"name": "cached_maxsim", "scale": 2.0, "score_query_tokens": 16, "score_document_tokens": 24},
        "distributed": {"strategy": strategy},
        "train": {"max_steps": STEPS, "logging_steps": 1, "seed": 3, "output_dir": str(tmp / out)},
    }


def _run(cfg: dict, base: Path) -> dict:
    from cembed.config.file import config_from_dict
    from cembed.train.recipe import check_run_inputs, run_training

    cfg = config_from_dict(cfg, base=base)
    plan, data = check_run_inputs(cfg)
    return run_training(cfg, plan, data)


def _worker(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 900)
    tmp_path = Path(tmp)
    results = {}
    for strategy in ("ddp", "fsdp"):
        summary = _run(_config(tmp_path, model_dir, WORLD, strategy, strategy), tmp_path)
        results[strategy] = {"losses": summary["losses"], "distributed": summary["distributed"]}
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(results))
    end_gloo_rank()


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("mv_ranks")
    mp.spawn(_worker, args=(str(tmp), str(tiny_model_dir), free_port()), nprocs=WORLD, join=True)
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.rglob("model.safetensors")):
        if "checkpoint-" not in str(file):
            out |= {f"{file.parent.relative_to(folder)}/{k}": v for k, v in load_file(str(file)).items()}
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_with_gathered_documents_train_as_one_process(ranks, tiny_model_dir, strategy):
    from sentence_transformers import MultiVectorEncoder

    tmp, results = ranks
    one = _run(_config(tmp, str(tiny_model_dir), 1, f"one-{strategy}"), tmp)
    two = results[0][strategy]
    assert two["distributed"]["gather_across_devices"] and two["distributed"]["strategy"] == strategy
    assert len(one["losses"]) == len(two["losses"]) == STEPS
    for (_, a), (_, b) in zip(one["losses"], two["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (one["losses"], two["losses"])
    mine, theirs = _weights(tmp / f"one-{strategy}"), _weights(tmp / strategy)
    assert mine.keys() == theirs.keys() and any(k.startswith("1_Dense/") for k in mine)
    d_w = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    d_loss = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(one["losses"], two["losses"]))
    print(f"\n{strategy}: 2 ranks x 4 rows vs 1 x 8, {STEPS} steps: max rel |dloss| {d_loss:.2e}  max |dW| {d_w:.2e}")
    assert d_w <= 1e-5
    assert MultiVectorEncoder(str(tmp / strategy), device="cpu").get_embedding_dimension() == 16
