"""Issue 14 item 2: the loss's token bookkeeping reads nothing back from the device per mini-batch,
and its counts stay exact.

A host read is what would synchronise a GPU with the host: a scalar read (``item``, ``int``,
``float``, ``bool``, formatting, indexing with a tensor: all ``aten._local_scalar_dense``),
``tolist`` / ``numpy``, and ops whose output shape depends on the values (``nonzero``,
``masked_select``, boolean indexing, ``unique``, ``repeat_interleave`` without ``output_size``).
:class:`HostReads` catches them at torch's dispatcher (and ``tolist``/``numpy``, which bypass it on a
CPU tensor, at the torch-function layer) and charges each to the innermost non-torch frame's package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import cembed
from cembed.config.loss import loss_config
from cembed.losses.counts import TokenCounts, count_tokens
from cembed.losses.length_sorted import minibatch_ranges
from cembed.losses.registry import build_loss
from cembed.losses.token_budget import token_budget_ranges

CEMBED_DIR = str(Path(cembed.__file__).parent)
TORCH_DIR = str(Path(torch.__file__).parent)
_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default}
_SHAPE_READS = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
}


def _owner() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_DIR) and name != __file__:
            if name.startswith(CEMBED_DIR):
                return "cembed"
            return "sentence_transformers" if "sentence_transformers" in name else "other"
        frame = frame.f_back
    return "other"


class HostReads:
    """Context manager counting host reads per owner (``cembed``, ``sentence_transformers``, ``other``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        reads = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                shape_read = func in _SHAPE_READS
                if func is torch.ops.aten.index.Tensor:
                    shape_read = any(i is not None and i.dtype == torch.bool for i in args[1])
                if func is torch.ops.aten.repeat_interleave.Tensor:
                    shape_read = kwargs.get("output_size") is None
                if func in _SCALAR_READS or shape_read:
                    reads.add()
                return func(*args, **kwargs)

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in (torch.Tensor.tolist, torch.Tensor.numpy):
                    reads.add()
                return func(*args, **(kwargs or {}))

        self._modes = [Dispatch(), Function()]

    def add(self) -> None:
        owner = _owner()
        self.counts[owner] = self.counts.get(owner, 0) + 1

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def test_host_reads_counter_catches_each_kind_of_read():
    """The counter is not blind: each kind of read it names is caught and charged to this file's
    caller ("other": a test file is neither cembed nor sentence-transformers)."""
    t = torch.arange(6)
    reads = [
        lambda: int(t.sum()),
        lambda: float(t.sum()),
        lambda: bool(t.any()),
        lambda: t.max().item(),
        lambda: t.tolist(),
        lambda: t.numpy(),
        lambda: t[t > 2],
        lambda: t.nonzero(),
        lambda: torch.repeat_interleave(t, t),
        lambda: [0] * 9 and [1, 2, 3, 4, 5, 6, 7][t[1]],
    ]
    for read in reads:
        with HostReads() as counter:
            read()
        assert sum(counter.counts.values()) >= 1, read
    with HostReads() as counter:  # device-only work: nothing
        (t * t).sum() + t[::2].amax()
        torch.repeat_interleave(t, t, output_size=15)
    assert counter.counts == {}


TEXTS = [("word " * (1 + (i * 7) % 19)).strip() for i in range(16)]


def _features(model):
    return [model.tokenize(TEXTS), model.tokenize([t + " end" for t in reversed(TEXTS)])]


@pytest.mark.slow
@pytest.mark.parametrize("sort_by_length", [True, False])
@pytest.mark.parametrize("unpad", [False, True])
def test_cached_step_bookkeeping_reads_nothing_per_minibatch(tiny_model_dir, sort_by_length, unpad):
    """A whole cached training step (forward, GradCache backward) with 2 and with 8 mini-batches per
    column: cembed's own code (sorting, gathers, token counting, reordering) does 0 host reads in
    both with padded mini-batches, and with packed rows (``batch.unpad``) exactly one per column (the
    packing plan needs the row lengths on the host) for 2 and for 8 mini-batches alike, while
    sentence-transformers' mini-batch trimming reads per mini-batch (the counter sees it)."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = _features(model)
    seen = {}
    for mbs in (8, 2):  # 16 rows per column: 2 and 8 mini-batches
        built = build_loss(model, loss_config(), mbs, sort_by_length=sort_by_length, unpad=unpad)
        assert built.unpadding.enabled is unpad
        model.zero_grad()
        with HostReads() as counter:
            built.module(features, None).backward()
        seen[mbs] = counter.counts
    expected = len(features) if unpad else 0
    assert seen[8].get("cembed", 0) == expected and seen[2].get("cembed", 0) == expected, seen
    assert seen[2].get("sentence_transformers", 0) > seen[8].get("sentence_transformers", 0), seen


def _cut(feature: dict, rows: int, budget: int | None) -> list[tuple[int, int]]:
    """The loss's mini-batches of a column: its rows sorted longest first, cut by ``budget`` or ``rows``."""
    if budget is None:
        return minibatch_ranges(feature, rows)
    mask = feature["attention_mask"]
    return token_budget_ranges({"attention_mask": mask[mask.sum(dim=1).argsort(descending=True, stable=True)]}, budget)


@pytest.mark.parametrize("by_tokens", [False, True])
def test_bookkeeping_reads_do_not_grow_with_minibatches(tiny_model_dir, monkeypatch, by_tokens):
    """The loss's bookkeeping alone (the parent loss stubbed out), cutting each column into about 2
    and about 8 mini-batches, padded (packed rows: the test above): with ``mini_batch_size`` it reads nothing; with a token budget
    (``mini_batch_num_tokens``) it reads each column's row widths once to cut the ranges
    (:func:`cembed.losses.token_budget.token_budget_ranges`), the same for 2 and for 8 mini-batches."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    features = _features(model)
    monkeypatch.setattr(CachedMultipleNegativesRankingLoss, "forward", lambda self, features, labels: None)
    widest = max(f["attention_mask"].shape[1] for f in features)
    totals, minibatches = [], []
    for k in (2, 8):
        budget = widest * (16 // k) if by_tokens else None  # positions: 16 // k rows of the widest
        loss = build_loss(model, loss_config(), 16 // k, mini_batch_num_tokens=budget, unpad=False).module
        with HostReads() as counter:
            loss(features, None)
        totals.append(sum(counter.counts.values()))
        minibatches.append(sum(len(_cut(f, 16 // k, budget)) for f in features))
        real, processed, _ = loss.token_counts.read()
        assert real == sum(int(f["attention_mask"].sum()) for f in features) and processed >= real
    assert minibatches[0] <= 3 * len(features) and minibatches[1] >= 3 * minibatches[0]  # ~2, then 6 to 8 per column
    assert totals[0] == totals[1] == (len(features) if by_tokens else 0)


def _mask(lengths: list[int]) -> dict:
    width = max(lengths)
    return {"attention_mask": torch.tensor([[1] * n + [0] * (width - n) for n in lengths])}


LENGTHS = [5, 3, 7, 2, 6]  # real = 23, sum of squares = 25 + 9 + 49 + 4 + 36 = 123


@pytest.mark.parametrize(
    "rows, ranges, longest_first, processed",
    [
        (LENGTHS, None, False, 5 * 7),  # one forward, padded to 7
        (LENGTHS, [(0, 2), (2, 4), (4, 5)], False, 2 * 5 + 2 * 7 + 1 * 6),  # [5,3] [7,2] [6]
        (sorted(LENGTHS, reverse=True), [(0, 2), (2, 4), (4, 5)], True, 2 * 7 + 2 * 5 + 1 * 2),  # [7,6] [5,3] [2]
        (LENGTHS, [(0, 1), (1, 4), (4, 5)], False, 5 + 3 * 7 + 6),  # token budget: [5] [3,7,2] [6]
        (sorted(LENGTHS, reverse=True), [(0, 1), (1, 4), (4, 5)], True, 7 + 3 * 6 + 2),  # [7] [6,5,3] [2]
        (sorted(LENGTHS, reverse=True), [(0, 5)], True, 5 * 7),
    ],
)
def test_token_counts_are_exact(rows, ranges, longest_first, processed):
    counts = TokenCounts()
    count_tokens(_mask(rows), ranges, counts, longest_first=longest_first)
    assert isinstance(counts.real, torch.Tensor)  # kept on the device until read
    assert counts.read() == (23, processed, 123)
    count_tokens(_mask(rows), ranges, counts, longest_first=longest_first)  # accumulates
    assert counts.read() == (46, 2 * processed, 246)
    counts.reset()
    assert counts.read() == (0, 0, 0)


def test_length_sorted_loss_counts_match_a_hand_count(tiny_model_dir):
    """The loss's counts after a step equal a count from the token lengths in plain Python: sort each
    column longest first, cut into mini-batches of 3, each costs rows x its longest row."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    features = _features(model)
    loss = build_loss(model, loss_config(), 3, unpad=False).module  # padded mini-batches (packing: test_unpad)
    with torch.no_grad():
        loss(features, None)
    real = processed = real_sq = 0
    for f in features:
        lengths = sorted((int(n) for n in f["attention_mask"].sum(dim=1)), reverse=True)
        real += sum(lengths)
        real_sq += sum(n * n for n in lengths)
        processed += sum(len(lengths[i : i + 3]) * max(lengths[i : i + 3]) for i in range(0, len(lengths), 3))
    assert loss.token_counts.read() == (real, processed, real_sq)
    assert processed > real  # the texts differ in length: some padding is left


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bookkeeping_does_not_synchronise_cuda(tiny_model_dir, monkeypatch):
    """On a GPU, torch's own sync detector (``set_sync_debug_mode("error")``) sees no synchronising
    call in the loss's bookkeeping: sorting, gathers, counting with regular ranges and with
    irregular (token-budget) ranges, which go to the device by a non-blocking pinned copy."""
    model = SentenceTransformer(str(tiny_model_dir), device="cuda")
    features = [{k: v.to("cuda") for k, v in f.items()} for f in _features(model)]
    monkeypatch.setattr(CachedMultipleNegativesRankingLoss, "forward", lambda self, features, labels: None)
    loss = build_loss(model, loss_config(), 2, unpad=False).module  # packing reads the lengths once per column
    counts = TokenCounts()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss(features, None)
        for longest_first in (True, False):
            count_tokens(features[0], [(0, 1), (1, 9), (9, 16)], counts, longest_first=longest_first)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    real = sum(int(f["attention_mask"].sum()) for f in features)
    assert loss.token_counts.read()[0] == real
    assert counts.read()[0] == 2 * int(features[0]["attention_mask"].sum())
