"""``cached_maxsim`` across ranks (issue 40 items 2 and acceptance), 2 gloo processes on CPU:

* with documents gathered from every rank it equals sentence-transformers'
  ``CachedMultiVectorMultipleNegativesRankingLoss(gather_across_devices=True)`` on each rank (loss and
  every parameter's gradient within 1e-5 relative);
* 2 ranks x B rows with gathered documents, under DDP, train as 1 process x 2B rows: the loss of each of
  3 AdamW steps and the final weights agree within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import WORDS, end_gloo_rank, free_port, join_gloo_rank

WORLD, ROWS, STEPS, SCALE = 2, 4, 3, 2.0  # ROWS per rank per step


def texts(step: int) -> list[list[str]]:
    """The global batch of ``step``: 2 x ROWS (query, positive, negative) rows, every text distinct."""
    out = [[], [], []]
    for i in range(WORLD * ROWS):
        n = step * WORLD * ROWS + i
        words = [WORDS[(7 * n + 3 * k) % len(WORDS)] for k in range(2 + n % 5)]
        out[0].append(f"{' '.join(words)} {n}")
        out[1].append(f"{' '.join(reversed(words))} about {n}, with {WORDS[n % len(WORDS)]}")
        out[2].append(f"{WORDS[(n * 5) % len(WORDS)]} {n} {' '.join(words[:2])}.")
    return out


def load(model_dir: str):
    from cembed.config.model import model_config
    from cembed.model.load import load_model

    cfg = model_config(kind="multi_vector", name_or_path=model_dir, dim=16, skiplist="punctuation")
    return load_model(cfg, "cpu", seed=3)


def freeze_unused(model) -> None:
    """Freeze what gets no gradient (the BERT pooler), as cembed does before DDP."""
    from cembed.distributed.ddp import freeze_parameters, unused_parameters
    from cembed.model.kinds.lookup import kind_of

    freeze_parameters(model, unused_parameters(model, ["a dog", "two cats"], outputs=kind_of(model).text_outputs))


def features(model, columns: list[list[str]], rows: slice) -> list[dict]:
    return [model.preprocess(c[rows], task="query" if i == 0 else "document") for i, c in enumerate(columns)]


def cembed_loss(model, gather: bool):
    from cembed.config.loss import loss_config
    from cembed.losses.registry import build_loss

    cfg = loss_config(name="cached_maxsim", scale=SCALE, score_query_tokens=9, score_document_tokens=13)
    return build_loss(model, cfg, 3, gather_across_devices=gather).module


def train(model, loss, batches) -> list[float]:
    """3 AdamW steps of ``loss`` on ``batches`` (one feature list per step); the losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for feats in batches:
        value = loss([dict(f) for f in feats], None)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(value.detach()))
    return losses


def _grads(model, loss, feats):
    model.zero_grad(set_to_none=True)
    value = loss([dict(f) for f in feats], None)
    value.backward()
    return float(value.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 600)
    import torch.distributed as dist
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    results = {}

    # 1. One step, gathered documents: cembed's loss vs the stock cached loss, on this rank's rows.
    model = load(model_dir).eval()
    feats = features(model, texts(0), mine)
    stock = CachedMultiVectorMultipleNegativesRankingLoss(
        model, scale=SCALE, mini_batch_size=2, gather_across_devices=True
    )
    value_ref, grads_ref = _grads(model, stock, feats)
    value, grads = _grads(model, cembed_loss(model, gather=True), feats)
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads_ref.values()))
    results["stock_loss"], results["loss"] = value_ref, value
    results["grad_error"] = max(
        float((grads[n] - g).norm() / torch.maximum(g.norm(), 1e-4 * total)) for n, g in grads_ref.items()
    )
    results["same_parameters"] = set(grads) == set(grads_ref)

    # 2. Three DDP steps on this rank's half of each global batch, documents gathered.
    model = load(model_dir)
    freeze_unused(model)
    loss = cembed_loss(model, gather=True)
    loss.model = DistributedDataParallel(model)  # as the trainer hands the loss its wrapped model
    batches = [features(model, texts(step), mine) for step in range(STEPS)]
    results["ddp_losses"] = train(model, loss, batches)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(tmp) / "ddp.pt")
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    end_gloo_rank()


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("maxsim_ddp")
    mp.spawn(_worker, args=(str(tmp), str(tiny_model_dir), free_port()), nprocs=WORLD, join=True)
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_gathered_documents_equal_the_stock_gathered_loss_on_every_rank(ranks):
    _, results = ranks
    for r in results:
        assert r["same_parameters"]
        assert abs(r["loss"] - r["stock_loss"]) <= 1e-5 * abs(r["stock_loss"])
        assert r["grad_error"] < 1e-5


@pytest.mark.slow
def test_two_ranks_with_gathered_documents_train_as_one_process_with_both_halves(ranks, tiny_model_dir):
    tmp, results = ranks
    model = load(str(tiny_model_dir))
    freeze_unused(model)
    everything = slice(0, WORLD * ROWS)
    losses = train(
        model, cembed_loss(model, gather=False), [features(model, texts(s), everything) for s in range(STEPS)]
    )
    ddp = [sum(r["ddp_losses"][s] for r in results) / WORLD for s in range(STEPS)]  # each rank's mean over its rows
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ddp, losses)), (ddp, losses)
    trained = torch.load(tmp / "ddp.pt")
    for name, value in model.state_dict().items():
        assert (trained[name] - value).abs().max() <= 1e-5, name
    assert losses[-1] < losses[0]  # it trains
