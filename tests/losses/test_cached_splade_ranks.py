"""One sparsity whatever the process count: the sparse cached SPLADE loss on 2 gloo ranks x B rows
(documents gathered, gradients averaged as DDP does) equals 1 process x 2B rows -- per step the loss with
its FLOPS terms, the first step's gradient and the weights after 3 SGD steps -- in the sparse, the dense and
the mixed (``auto``) cache forms, with all four MNRL directions (queries gathered too) and thresholds.
A per-rank FLOPS term (the broken copy) and sentence-transformers' own ``CachedSpladeLoss`` (which
regularizes each rank's rows) do not; their numbers are printed (``pytest -s``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import WORDS, end_gloo_rank, free_port, join_gloo_rank, make_tiny_splade, rel_diff

pytestmark = pytest.mark.slow  # 2 spawned gloo ranks

WORLD, ROWS, STEPS, MINI, LR = (
    2,
    4,
    3,
    3,
    0.005,
)  # LR: the FLOPS terms (weights 0.3, 0.4) leave rows active for 3 steps  # ROWS per rank; 1 process takes WORLD * ROWS
ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
# name -> (cembed keyword arguments or "stock", MNRL directions); the threshold 65 splits the first step's
# rows (57-71 active coordinates of 127).
CASES = {
    "auto": ({"cache_form": "auto"}, ("query_to_doc",)),
    "sparse_all_directions_thresholds": (
        {"cache_form": "sparse", "document_regularizer_threshold": 65, "query_regularizer_threshold": 65},
        ALL_DIRECTIONS,
    ),
    "dense": ({"cache_form": "dense"}, ("query_to_doc",)),
    "per_rank_flops": ({"cache_form": "auto"}, ("query_to_doc",)),  # flops() without its all-reduce
    "stock": ("stock", ("query_to_doc",)),
}


def texts(column: str, step: int, rank: int | None) -> list[str]:
    """Distinct texts: all ``WORLD * ROWS`` rows of a step (``rank`` None), or one rank's share."""
    rows = [
        f"{column[0]} {WORDS[(7 * i + 3 * step) % len(WORDS)]} {WORDS[(5 * i + step + len(column)) % len(WORDS)]} {i}"
        for i in range(WORLD * ROWS)
    ]
    return rows if rank is None else rows[rank * ROWS : (rank + 1) * ROWS]


def make_loss(model, case: str):
    from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, SparseMultipleNegativesRankingLoss

    from cembed.losses.cached_splade import SparseCachedSpladeLoss

    kwargs, directions = CASES[case]
    base = SparseMultipleNegativesRankingLoss(model, gather_across_devices=True, directions=directions)
    common = dict(document_regularizer_weight=0.3, query_regularizer_weight=0.4, mini_batch_size=MINI)
    if kwargs == "stock":
        return CachedSpladeLoss(model, base, **common)
    return SparseCachedSpladeLoss(model, base, **common, **kwargs)


def train(model_dir: str, case: str, rank: int | None, world: int) -> dict:
    """3 SGD steps of ``case`` on this process's rows; gradients averaged over ranks (as DDP does)."""
    import torch.distributed as dist
    from sentence_transformers.sparse_encoder import SparseEncoder

    torch.manual_seed(0)
    model = SparseEncoder(model_dir, device="cpu")
    model.train()
    loss = make_loss(model, case)
    params = list(model.parameters())
    start = torch.cat([p.detach().flatten() for p in params])
    optimizer = torch.optim.SGD(params, lr=LR)
    out = {"losses": [], "components": []}
    for step in range(STEPS):
        feats = [model.preprocess(texts(column, step, rank)) for column in ("query", "passage", "negative")]
        optimizer.zero_grad()
        total = sum(loss(feats, None).values())
        total.backward()
        if world > 1:
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= world
        if step == 0:
            out["first_grads"] = torch.cat([p.grad.flatten() for p in params])
        optimizer.step()
        out["losses"].append(total.item())
        out["components"].append(dict(loss._component_values))
    out["update"] = torch.cat([p.detach().flatten() for p in params]) - start
    return out


def _worker(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 300)
    import torch.distributed as dist

    import cembed.losses.cached_splade as cached_splade

    dist.init_process_group("gloo")
    results = {}
    real_flops = cached_splade.flops
    for case in CASES:
        if case == "per_rank_flops":
            cached_splade.flops = lambda parts, threshold, world: real_flops(parts, threshold, 1)
        results[case] = train(model_dir, case, rank, WORLD)
        cached_splade.flops = real_flops
        torch.save(results, Path(tmp) / f"rank{rank}.pt")  # kept if a later case hangs
    end_gloo_rank()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(one process x 2B per case, [rank 0, rank 1] x B per case)``."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("splade_ranks")
    model = make_tiny_splade(tmp / "build", bias=-0.1)  # about half the coordinates active: mixed forms
    model_dir = tmp / "model"
    model.save(str(model_dir))
    single = {case: train(str(model_dir), case, None, 1) for case in CASES if case != "per_rank_flops"}
    try:
        mp.spawn(_worker, args=(str(tmp), str(model_dir), free_port()), nprocs=WORLD, join=True)
    except Exception as err:  # noqa: BLE001 - a hung or failed rank: the tests say which case is missing
        print(f"ranks failed: {err}")
    ranks = [torch.load(tmp / f"rank{r}.pt") if (tmp / f"rank{r}.pt").exists() else {} for r in range(WORLD)]
    return single, ranks


def agreement(single: dict, ranks: list[dict]) -> dict[str, float]:
    """Relative differences of the 2-rank run from the 1-process run: the step losses (mean over ranks),
    the document FLOPS term (worst step and rank), the first gradient and the 3-step weight update."""
    losses = torch.tensor([r["losses"] for r in ranks]).mean(dim=0)

    def reg(run, s):
        return run["components"][s]["document_regularizer_loss"]

    flops = max(abs(reg(r, s) - reg(single, s)) / max(reg(single, s), 1e-12) for r in ranks for s in range(STEPS))
    return {
        "loss": rel_diff(losses, torch.tensor(single["losses"])),
        "document_flops": flops,
        "first_grads": max(rel_diff(r["first_grads"], single["first_grads"]) for r in ranks),
        "update": max(rel_diff(r["update"], single["update"]) for r in ranks),
    }


@pytest.mark.parametrize("case", ["auto", "sparse_all_directions_thresholds", "dense"])
def test_two_ranks_equal_one_process(runs, case):
    single, ranks = runs
    assert all(case in r for r in ranks), f"{case}: a rank hung or failed"
    diffs = agreement(single[case], [r[case] for r in ranks])
    print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) <= 1e-5, diffs
    if CASES[case][0] in ({"cache_form": "auto"}, {"cache_form": "dense"}):  # stock's settings: one process as stock
        assert rel_diff(single[case]["update"], single["stock"]["update"]) <= 1e-5
    assert torch.equal(ranks[0][case]["update"], ranks[1][case]["update"])


def test_a_per_rank_flops_term_is_caught(runs):
    """The broken copy: each rank's FLOPS over its own rows, as sentence-transformers computes it."""
    single, ranks = runs
    diffs = agreement(single["auto"], [r["per_rank_flops"] for r in ranks])
    print("per-rank FLOPS (broken copy)", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert diffs["document_flops"] > 1e-2 and diffs["update"] > 1e-4


def test_stock_regularizes_per_rank(runs):
    """sentence-transformers' CachedSpladeLoss on the same 2 ranks: the contrastive part agrees with one
    process, the FLOPS terms do not (each rank's mean is over its own B rows)."""
    single, ranks = runs
    stock = [r["stock"] for r in ranks]
    diffs = agreement(single["stock"], stock)
    for s in range(STEPS):
        row = {"1 process x 2B": single["stock"]["components"][s]}
        row |= {f"rank {r} x B": stock[r]["components"][s] for r in range(WORLD)}
        print(f"stock step {s + 1}:", {k: {c: round(v, 5) for c, v in x.items()} for k, x in row.items()})
    print("stock vs 1 process", {k: f"{v:.1e}" for k, v in diffs.items()})
    first = [r["components"][0] for r in stock]
    assert abs(sum(c["base_loss"] for c in first) / WORLD - single["stock"]["components"][0]["base_loss"]) < 1e-5
    assert diffs["document_flops"] > 1e-2
