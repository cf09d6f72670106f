"""Field cases for ``cached_maxsim`` after its cache is scored in place (``TokenPieces``, commit 9d3a067):
each built from a public bug report about the same feature (GradCache, cached contrastive losses, ColBERT /
PyLate MaxSim, custom autograd Functions), tried as a new user would, and compared with a reference
computed without cembed's loss: sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss``,
or autograd through sentence-transformers' padded ``maxsim``. docs/development.md lists the round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import end_gloo_rank, free_port, join_gloo_rank
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from sentence_transformers.util import maxsim

from cembed.config.model import model_config
from cembed.model.load import load_model
from cembed.model.maxsim import RaggedTokens, TokenPieces, maxsim_infonce
from tests.losses.test_maxsim_loss import NEGATIVES, POSITIVES, QUERIES, cembed_loss, columns, grads, stock, worst_error

# A user's skiplist that leaves some documents without a scored token ([CLS], [SEP] and punctuation out).
EVERYTHING_OUT = ["[CLS]", "[SEP]", "!", ".", "?", ","]
SHORT_QUERIES = ["a dog", "two cats", "the red car", "people", "food on a table"]


def _texts(negatives: int) -> list[list[str]]:
    return [QUERIES, POSITIVES, *NEGATIVES[:negatives]]


def _multi_vector(model_dir, **options):
    cfg = model_config(kind="multi_vector", name_or_path=str(model_dir), dim=16, **options)
    return load_model(cfg, "cpu", seed=3).eval()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return _multi_vector(tiny_model_dir, skiplist="punctuation")


@pytest.fixture(scope="module")
def emptying_model(tiny_model_dir):
    return _multi_vector(tiny_model_dir, skiplist=EVERYTHING_OUT)


def _scored_tokens(model, feature) -> list[int]:
    with torch.no_grad():
        return model(dict(feature), task=feature.get("task", "document"))["attention_mask"].sum(dim=1).tolist()


def test_a_mini_batch_whose_documents_all_lose_every_token_to_the_skiplist(emptying_model):
    """lightonai/pylate#5 "Add the skiplist", stanford-futuredata/ColBERT#320 (skiplisted tokens masked out
    of the output); sentence-transformers scores "documents without any scoreable token" -1e9. With
    mini-batches of 2 unsorted, the second mini-batch's documents have no scored token: an empty piece of
    the cache, its gradient an empty view. Reference: the stock cached loss."""
    docs = ["a dog!", "!!!", "?", "", "food."]
    features = [
        emptying_model.preprocess(SHORT_QUERIES, task="query"),
        emptying_model.preprocess(docs, task="document"),
    ]
    assert _scored_tokens(emptying_model, features[1]) == [2, 0, 0, 0, 1]
    for settings in ({"mini_batch_size": 2, "sort_by_length": False}, {"mini_batch_size": 1}):
        built = cembed_loss(emptying_model, 2.0, **settings)
        assert worst_error(emptying_model, built.module, stock(emptying_model, 2.0), features) < 1e-5


def test_every_document_without_a_scored_token_gives_the_stock_loss(emptying_model):
    """The same reports, every document of the batch emptied by the skiplist: each scores -1e9, so every
    query's candidates tie and the stock loss is log(5). The tiled loss computed ``logsumexp - positive``
    at -2e9, where float32's spacing is 256: 0.0 (with and without gradients)."""
    docs = ["!!!", "?", "", ". .", "!"]
    features = [
        emptying_model.preprocess(SHORT_QUERIES, task="query"),
        emptying_model.preprocess(docs, task="document"),
    ]
    assert _scored_tokens(emptying_model, features[1]) == [0, 0, 0, 0, 0]
    built = cembed_loss(emptying_model, 2.0, mini_batch_size=2)
    with torch.no_grad():
        value = float(built.module([dict(f) for f in features], None))
    assert abs(value - 1.6094379) < 1e-6  # log(5)
    assert worst_error(emptying_model, built.module, stock(emptying_model, 2.0), features) < 1e-5


def test_a_small_loss_at_large_logits_keeps_the_stock_precision(model):
    """A trained model's regime: each positive scores far above its negatives, so the loss (0.014) is small
    next to the logits (scale 20 x MaxSim sums of about 9). The stock loss takes ``(top - positive) +
    log(sum exp(logit - top))``, accurate to the loss's own rounding; ``(top + log(...)) - positive``
    rounds at the logits' magnitude first (7.4e-5 relative here). No public report: found from the
    previous case's arithmetic."""
    features = [model.preprocess(QUERIES, task="query"), model.preprocess(QUERIES, task="document")]
    with torch.no_grad():
        reference = float(stock(model, 20.0)([dict(f) for f in features], None))
    assert reference < 0.02
    with torch.no_grad():  # evaluation: the value alone
        value = float(cembed_loss(model, 20.0, mini_batch_size=3).module([dict(f) for f in features], None))
    assert abs(value - reference) <= 1e-5 * reference
    for settings in ({"mini_batch_size": 3}, {"mini_batch_size": 1, "tiles": (1, 2, 1)}):
        assert worst_error(model, cembed_loss(model, 20.0, **settings).module, stock(model, 20.0), features) < 1e-5


def test_uneven_mini_batches_over_four_document_columns(model):
    """sentence-transformers#3420 (a short last batch of a cached loss), #3854 / #3862 (a mini-batched loss
    that dropped every mini-batch's gradient but the last): three hard negatives, a token budget that cuts
    each column into another number of mini-batches, a last mini-batch of one row. Reference: stock."""
    features = columns(model, 3)
    built = cembed_loss(model, 2.0, budget=20, tiles=(5, 6, 2))
    cached = []
    real = built.module.calculate_loss

    def spy(reps, masks, **kwargs):
        cached.append([[len(m) for m in column] for column in masks])
        return real(reps, masks, **kwargs)

    built.module.calculate_loss = spy
    assert worst_error(model, built.module, stock(model, 2.0), features) < 1e-5
    rows_per_minibatch = cached[0]
    assert len({len(column) for column in rows_per_minibatch}) > 1  # columns cut into different counts
    assert any(column[-1] == 1 for column in rows_per_minibatch)  # a last mini-batch of one row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_cache_gets_gradients_of_its_own_dtype(model, dtype):
    """sentence-transformers#3793 / #3800 (ranking losses under bf16: "Index put requires the source and
    destination dtype match"): under autocast the cache's mini-batches are half precision and the scoring
    Function's gradient buffer float32; each piece's gradient comes back in the piece's dtype (torch's engine
    would cast it anyway). The scores' sums are float32 as the stock loss keeps them ("the bf16 grid is 0.125
    wide"): the loss within 1e-4 of stock's under the same autocast (summed in bf16: 3.9e-4), the gradients
    as close to float32's as stock's are."""
    features = columns(model, 1)
    built = cembed_loss(model, 2.0, mini_batch_size=3, tiles=(7, 5, 2))
    leaves = []
    real = built.module.calculate_loss

    def spy(reps, masks, **kwargs):
        leaves.extend(piece for column in reps for piece in column)
        return real(reps, masks, **kwargs)

    built.module.calculate_loss = spy
    with torch.autocast("cpu", dtype=dtype):
        mine = grads(model, built.module, features)
        theirs = grads(model, stock(model, 2.0), features)
    assert leaves and all(p.dtype == dtype and p.grad.dtype == dtype for p in leaves)
    assert abs(float(mine[0] - theirs[0])) <= 1e-4 * float(theirs[0])
    full = grads(model, stock(model, 2.0), features)
    assert _relative(mine, full) <= 1.5 * _relative(theirs, full) + 1e-3, (
        _relative(mine, full),
        _relative(theirs, full),
    )


def _two_forwards_then_backward(model, loss, batches):
    model.zero_grad(set_to_none=True)
    total = sum(loss([dict(f) for f in features], None) for features in batches)
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _two_steps_accumulated(model, loss, batches):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for features in batches:
        value = loss([dict(f) for f in features], None)
        value.backward()
        total = total + value.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(mine, theirs) -> float:
    total = torch.sqrt(sum(g.pow(2).sum() for g in theirs[1].values()))
    errors = [float((mine[0] - theirs[0]).abs() / theirs[0].abs())]
    errors += [float((mine[1][n] - g).norm() / torch.maximum(g.norm(), 1e-4 * total)) for n, g in theirs[1].items()]
    return max(errors)


@pytest.mark.parametrize("run", [_two_forwards_then_backward, _two_steps_accumulated])
@pytest.mark.parametrize("second", ["same-batch", "other-batch"])
def test_the_loss_called_twice(model, run, second):
    """sentence-transformers#3862 (GradCache's backward hook must replay its own forward's cache, "so that a
    second forward pass before the first backward pass cannot make this hook back-propagate the wrong
    batch's gradients"), pytorch/pytorch#34082 (AccumulateGrad keeps a gradient that is a view as ``.grad``:
    the aliasing is observable): two forwards then one backward, and two accumulated steps, on the same
    batch and on another one (where gradients shared between the calls would show), with packed
    mini-batches whose gradients are views of one buffer. Reference: stock run the same way."""
    first = columns(model, 1)
    other = [
        model.preprocess(list(reversed(c)), task="query" if i == 0 else "document") for i, c in enumerate(_texts(1))
    ]
    batches = [first, first if second == "same-batch" else other]
    mine = run(model, cembed_loss(model, 2.0, mini_batch_size=3, tiles=(7, 5, 2)).module, batches)
    theirs = run(model, stock(model, 2.0), batches)
    assert set(mine[1]) == set(theirs[1])
    assert _relative(mine, theirs) < 1e-5


def _ragged(lengths: list[int], seed: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(sum(lengths), 8, generator=g), dim=-1), lengths


def _padded(values: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = values.split(lengths)
    out = torch.zeros(len(rows), max(lengths), values.shape[1])
    mask = torch.zeros(len(rows), max(lengths), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)], mask[i, : len(r)] = r, True
    return out, mask


def _padded_reference(q_values, q_lengths, d_values, d_lengths, labels, scale):
    """Loss and gradients (ragged) by autograd through sentence-transformers' padded ``maxsim``."""
    (q, qm), (d, dm) = _padded(q_values, q_lengths), _padded(d_values, d_lengths)
    q.requires_grad_(), d.requires_grad_()
    loss = F.cross_entropy(scale * maxsim(q, d, qm, dm), labels)
    loss.backward()
    return loss.detach(), q.grad[qm], d.grad[dm]


def test_each_pieces_gradient_is_its_own_rows_of_one_buffer():
    """pytorch/pytorch#34082 ("Autograd deep copy avoidance optimization unsound in the presence of views":
    AccumulateGrad steals a gradient that is a view, so ``.grad`` aliases its base): the pieces' gradients
    are views of one float32 buffer per column. Changing one piece's ``.grad`` in place must leave the others
    alone, and a second backward must add to each piece's own rows. Reference: autograd through padded
    ``maxsim``."""
    (qv, ql), (dv, dl) = _ragged([3, 2, 4], 1), _ragged([2, 3, 4, 1], 2)
    labels = torch.tensor([0, 3, 1])
    q_parts = [p.clone().requires_grad_() for p in qv.split([5, 4])]
    d_parts = [p.clone().requires_grad_() for p in dv.split([2, 3, 5])]

    def backward():
        queries = RaggedTokens.from_lengths(TokenPieces(q_parts), ql)
        maxsim_infonce(queries, RaggedTokens.from_lengths(TokenPieces(d_parts), dl), labels, 2.0).backward()

    backward()
    _, gq, gd = _padded_reference(qv, ql, dv, dl, labels, 2.0)
    assert d_parts[0].grad.untyped_storage().data_ptr() == d_parts[2].grad.untyped_storage().data_ptr()  # views
    first = [p.grad.clone() for p in d_parts]
    d_parts[1].grad.zero_()  # e.g. a hook that drops one mini-batch's gradient
    assert torch.equal(d_parts[0].grad, first[0]) and torch.equal(d_parts[2].grad, first[2])
    backward()
    expected = [2 * first[0], first[1], 2 * first[2]]
    assert all(torch.allclose(p.grad, e, rtol=1e-6, atol=0) for p, e in zip(d_parts, expected))
    assert torch.allclose(torch.cat(first), gd, rtol=1e-5, atol=1e-7)
    assert torch.allclose(torch.cat([p.grad for p in q_parts]), 2 * gq, rtol=1e-5, atol=1e-7)


def test_thousands_of_mini_batches_are_one_autograd_functions_inputs():
    """pytorch/pytorch#60726 (a custom Function over a variable number of tensors takes them as varargs and
    returns one gradient each): a batch cut into mini-batches of one row gives the scoring Function 1,200
    inputs, some of them empty. Loss and every piece's gradient equal autograd through padded ``maxsim``."""
    rows = 400
    q_lengths = [1 + i % 4 for i in range(rows)]
    d_lengths = [(i * 7) % 5 for i in range(2 * rows)]  # every fifth document has no scored token
    (qv, ql), (dv, dl) = _ragged(q_lengths, 3), _ragged(d_lengths, 4)
    labels = torch.arange(rows) * 2 + 1
    q_parts = [p.clone().requires_grad_() for p in qv.split(q_lengths)]
    d_parts = [p.clone().requires_grad_() for p in dv.split(d_lengths)]
    queries = RaggedTokens.from_lengths(TokenPieces(q_parts), ql)
    loss = maxsim_infonce(queries, RaggedTokens.from_lengths(TokenPieces(d_parts), dl), labels, 3.0)
    loss.backward()
    reference, gq, gd = _padded_reference(qv, ql, dv, dl, labels, 3.0)
    assert abs(float(loss) - float(reference)) <= 1e-6 * float(reference)
    assert sum(1 for p in d_parts if p.shape[0] == 0) == 2 * rows // 5
    got_q, got_d = torch.cat([p.grad for p in q_parts]), torch.cat([p.grad for p in d_parts])
    assert float((got_q - gq).norm() / gq.norm()) < 1e-5 and float((got_d - gd).norm() / gd.norm()) < 1e-5


def test_gradient_checkpointing_equals_the_stock_loss(tiny_model_dir):
    """luyug/GradCache#20 "Combining Gradient Caching with Gradient Accumulation/Checkpointing": the
    encoder's blocks checkpointed (``model.gradient_checkpointing``) under the cached loss's packed
    mini-batches. Reference: stock on the same checkpointed model."""
    cfg = model_config(
        kind="multi_vector",
        name_or_path=str(tiny_model_dir),
        dim=16,
        skiplist="punctuation",
        gradient_checkpointing=True,
    )
    model = load_model(cfg, "cpu", seed=3, for_training=True).eval()
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    built = cembed_loss(model, 2.0, mini_batch_size=3, tiles=(7, 5, 2))
    assert built.unpadding.enabled
    assert worst_error(model, built.module, stock(model, 2.0), columns(model, 2)) < 1e-5


def test_meanmaxsim_with_query_expansion_under_a_token_budget(tiny_model_dir):
    """AnswerDotAI/rerankers#75 / #76 (MeanMaxSim averaged over masked query positions), stanford-futuredata/
    ColBERT#314 ([MASK] tokens): MeanMaxSim divides by each query's scored tokens, expansion tokens
    included; with a token budget and tiles that cut documents. Reference: stock."""
    model = _multi_vector(tiny_model_dir, query_expansion=12, skiplist="punctuation")
    model.similarity_fn_name = "meanmaxsim"
    features = columns(model, 2)
    assert "query_expansion_positions" in features[0]
    built = cembed_loss(model, 8.0, budget=30, tiles=(13, 7, 2))
    assert worst_error(model, built.module, stock(model, 8.0), features) < 1e-5


# --- 2 gloo ranks: gathered documents over several mini-batches per column ---------------------------------

WORLD = 2
RANK_TEXTS = [  # (queries, positives, negatives) per rank; rank 1's negatives have no scored token at all
    (
        ["a man on a bus", "two dogs", "the red car"],
        ["a man is riding the bus to the street", "dogs playing", "a red car near a small white car"],
        ["blue room", "the table, with a cat", "top"],
    ),
    (
        ["a cat on a table", "people", "food"],
        ["cat sitting on the table", "people at the street with a dog", "a plate of food on a table"],
        ["!!!", "?", ""],
    ),
]


def _rank_worker(rank: int, tmp: str, model_dir: str, port: int) -> None:
    join_gloo_rank(rank, WORLD, port, 600)
    import torch.distributed as dist

    from cembed.config.loss import loss_config
    from cembed.losses.registry import build_loss

    dist.init_process_group("gloo")
    model = _multi_vector(model_dir, skiplist=EVERYTHING_OUT)
    features = [model.preprocess(t, task="query" if i == 0 else "document") for i, t in enumerate(RANK_TEXTS[rank])]
    cfg = loss_config(name="cached_maxsim", scale=2.0, score_query_tokens=4, score_document_tokens=5)
    mine = build_loss(model, cfg, 1, gather_across_devices=True).module
    theirs = CachedMultiVectorMultipleNegativesRankingLoss(
        model, scale=2.0, mini_batch_size=1, gather_across_devices=True
    )
    results = {"scored": _scored_tokens(model, features[2]), "error": worst_error(model, mine, theirs, features)}
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    end_gloo_rank()


@pytest.mark.slow
def test_gathered_documents_over_several_mini_batches_per_rank(tiny_model_dir, tmp_path):
    """lightonai/pylate#100 "Add gathering to (cached) contrastive loss", NVIDIA-NeMo/Automodel#2283 (are
    other ranks' gathered ColBERT passages given their gradient, as one process with the whole batch would
    give them?): 2 gloo ranks, triplets, mini-batches of one row (3 per column), one rank's negatives without
    a single scored token (empty pieces of that rank's cache: gathered from a slice of the cache, which skips
    them, they got no gradient and the library refused the column as "not used"). Reference: the stock
    gathered loss on each rank."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_worker, args=(str(tmp_path), str(tiny_model_dir), free_port()), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert results[1]["scored"] == [0, 0, 0] and min(results[0]["scored"]) > 0
    assert all(r["error"] < 1e-5 for r in results), results
