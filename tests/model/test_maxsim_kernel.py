"""The fused MaxSim kernel's selection (cembed.model.maxsim_kernel, issue 40 Deliver 3), on CPU with fake
kernels that follow late-interaction-kernels' ``maxsim_varlen`` interface: InfoNCE scored by a kernel block
by block equals the tiled path (loss and every token gradient); the first batch's check picks the kernel
only where it agrees, else keeps the tiled path with one line saying why; a CPU run, a missing package and
``loss.score_kernel: tiled`` keep the tiled path; the cached loss decides once and its note reaches the
run's log once."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import cembed.model.maxsim_kernel as K
from cembed.model.maxsim import RaggedTokens, Tiles, fused_tiles, maxsim_infonce

DIM = 8
QUERY_LENGTHS = [3, 1, 6, 2, 4, 5, 2]
DOC_LENGTHS = [4, 0, 13, 1, 7, 2, 9, 3, 5, 11, 1]  # a document without tokens: -1e9
LABELS = torch.tensor([2, 0, 4, 9, 6, 2, 10])


def ragged(lengths: list[int], seed: int) -> RaggedTokens:
    g = torch.Generator().manual_seed(seed)
    return RaggedTokens.from_lengths(F.normalize(torch.randn(sum(lengths), DIM, generator=g), dim=-1), lengths)


def exact_varlen(q, d, q_cu, d_cu, max_q, max_d):
    """A stand-in for ``maxsim_varlen`` in plain torch: each pair's sum over the query's tokens of the
    largest dot product with a document token (0 where either has no token); autograd as torch gives."""
    qo, do = q_cu.tolist(), d_cu.tolist()
    assert max_q == max(b - a for a, b in zip(qo, qo[1:])) and max_d == max(b - a for a, b in zip(do, do[1:]))
    rows = []
    for i in range(len(qo) - 1):
        qi = q[qo[i] : qo[i + 1]]
        row = [
            (qi @ d[do[j] : do[j + 1]].T).max(dim=1).values.sum() if len(qi) and do[j + 1] > do[j] else q.sum() * 0
            for j in range(len(do) - 1)
        ]
        rows.append(torch.stack(row))
    return torch.stack(rows)


def short_documents(q, d, q_cu, d_cu, max_q, max_d):
    """A broken kernel: each document's last token left out (a loop bound one short)."""
    do = d_cu.tolist()
    keep = torch.ones(d.shape[0], dtype=torch.bool)
    for j in range(len(do) - 1):
        if do[j + 1] > do[j]:
            keep[do[j + 1] - 1] = False
    lengths = [int(keep[a:b].sum()) for a, b in zip(do, do[1:])]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return exact_varlen(q, d[keep], q_cu, cu, max_q, max(lengths))


EXACT = K.FusedMaxSim("fake exact 1.0 varlen", exact_varlen)
BROKEN = K.FusedMaxSim("fake short 1.0 varlen", short_documents)
NAN = K.FusedMaxSim("fake nan 1.0 varlen", lambda q, d, *a: exact_varlen(q, d, *a) * float("nan"))


def loss_and_grads(queries, documents, labels, kernel, **options):
    q = queries.values.clone().requires_grad_()
    d = documents.values.clone().requires_grad_()
    loss = maxsim_infonce(
        RaggedTokens(q, queries.offsets), RaggedTokens(d, documents.offsets), labels, kernel=kernel, **options
    )
    loss.backward()
    return loss.detach(), q.grad, d.grad


def relative(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("tiles", [Tiles(), Tiles(1, 1, 1), Tiles(7, 9, 3), Tiles(12, 64, 4)])
@pytest.mark.parametrize(("scale", "length_normalize"), [(1.0, False), (5.0, True)])
def test_a_kernel_scores_block_by_block_as_the_tiled_path(tiles, scale, length_normalize):
    queries, documents = ragged(QUERY_LENGTHS, 1), ragged(DOC_LENGTHS, 2)
    options = dict(scale=scale, length_normalize=length_normalize, tiles=tiles)
    ref = loss_and_grads(queries, documents, LABELS, None, **options)
    got = loss_and_grads(queries, documents, LABELS, EXACT, **options)
    assert max(relative(g, r) for g, r in zip(got, ref)) < 1e-6


def test_fused_blocks_hold_whole_rows_within_the_tiles():
    queries, documents = ragged(QUERY_LENGTHS, 1), ragged(DOC_LENGTHS, 2)
    q_tiles, d_chunks = fused_tiles(queries, documents, Tiles(12, 16, 3))
    # queries x the longest of them <= 12: [3, 1] 2 x 3; [6, 2] 2 x 6; [4, 5] 2 x 5 ([4, 5, 2] 3 x 5 > 12); [2]
    assert q_tiles == [(0, 2), (2, 4), (4, 6), (6, 7)]
    # documents: at most 3 rows and 16 tokens: [4, 0]; [13, 1]; [7, 2]; [9, 3]; [5, 11]; [1]
    assert d_chunks == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 11)]
    for tiles in (Tiles(1, 1, 1), Tiles()):
        q_tiles, d_chunks = fused_tiles(queries, documents, tiles)
        assert [r for a, b in q_tiles for r in range(a, b)] == list(range(len(QUERY_LENGTHS)))
        assert [r for a, b in d_chunks for r in range(a, b)] == list(range(len(DOC_LENGTHS)))


def batch():
    return ragged(QUERY_LENGTHS, 1), ragged(DOC_LENGTHS, 2), LABELS


def finder(kernel, why=""):
    calls = []

    def find(device):
        calls.append(torch.device(device).type)
        return kernel, why

    find.calls = calls
    return find


def test_an_agreeing_kernel_is_chosen_with_a_note():
    find = finder(EXACT)
    choice = K.choose_scoring("auto", *batch(), find=find, scale=2.0)
    assert choice.kernel is EXACT and choice.path == "fused: fake exact 1.0 varlen" and find.calls == ["cpu"]
    assert choice.note.startswith("MaxSim: fused kernel fake exact 1.0 varlen; agrees with the tiled path")


@pytest.mark.parametrize("kernel", [BROKEN, NAN], ids=["drops-last-token", "nan"])
def test_a_kernel_that_disagrees_leaves_the_tiled_path_with_one_line(kernel):
    choice = K.choose_scoring("auto", *batch(), find=finder(kernel), scale=2.0)
    assert choice.kernel is None and choice.path == "tiled (torch)"
    assert choice.note.startswith(f"MaxSim: the tiled path; {kernel.name} differs from it on the first batch: loss ")
    assert "\n" not in choice.note


def test_the_check_measures_what_a_broken_kernel_changes():
    agreement = K.check_agreement(BROKEN, *batch(), scale=2.0)
    assert not agreement.ok and agreement.loss_rel > K.LOSS_TOLERANCE and agreement.gradient_rel > 0.05
    exact = K.check_agreement(EXACT, *batch(), scale=2.0)
    assert exact.ok and exact.loss_rel < 1e-6 and exact.gradient_rel < 1e-6


def test_the_check_scores_a_bounded_part_of_the_batch():
    queries, documents, labels = batch()
    head, picked, local = K.check_batch(queries, documents, labels, 3, 2)
    assert list(head.offsets) == [0, 3, 4, 10]
    # the first 2 documents and the positives of the first 3 queries (2, 0, 4), in document order
    assert list(picked.offsets) == [0, 4, 4, 17, 24] and local.tolist() == [2, 0, 3]
    assert torch.equal(picked.values[4:17], documents.values[4:17])


def test_no_kernel_no_check():
    tiled = finder(EXACT)
    assert K.choose_scoring("tiled", *batch(), find=tiled) == K.ScoringChoice(None, "tiled (torch)")
    assert tiled.calls == []  # loss.score_kernel: tiled never looks for one
    assert K.choose_scoring("auto", *batch(), find=finder(None)) == K.ScoringChoice(None, "tiled (torch)", None)
    missing = K.choose_scoring("auto", *batch(), find=finder(None, "late-interaction-kernels is not importable (x)"))
    assert missing.note == "MaxSim: the tiled path; late-interaction-kernels is not importable (x)"


def test_the_kernel_is_looked_for_on_cuda_only(monkeypatch):
    assert K.find_fused_maxsim("cpu") == (None, "")
    monkeypatch.setitem(sys.modules, "late_interaction_kernels", None)  # import fails as if not installed
    kernel, why = K.find_fused_maxsim("cuda")
    assert kernel is None and why.startswith("late-interaction-kernels is not importable (")
    assert why.endswith("pip install late-interaction-kernels for the fused kernel")


QUERIES = ["a man on a bus", "two dogs", "the red car", "a cat on a table, by the window", "people"]
POSITIVES = ["a man riding the bus", "dogs playing", "a red car near a white car", "cat on the table", "a crowd"]
NEGATIVES = ["blue room", "black dog", "white car", "bus top", "the table"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from cembed.config.model import model_config
    from cembed.model.load import load_model

    cfg = model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), dim=16, skiplist="punctuation")
    return load_model(cfg, "cpu", seed=3).eval()


def step(model, loss):
    """One training step of ``loss`` on the fixed triplets: the loss and every parameter's gradient."""
    features = [
        model.preprocess(t, task="query" if i == 0 else "document")
        for i, t in enumerate([QUERIES, POSITIVES, NEGATIVES])
    ]
    model.zero_grad(set_to_none=True)
    value = loss([dict(f) for f in features], None)
    value.backward()
    return value.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize(
    ("kernel", "chosen", "note"),
    [
        (EXACT, "fused: fake exact 1.0 varlen", "MaxSim: fused kernel fake exact 1.0 varlen; agrees with"),
        (BROKEN, "tiled (torch)", "MaxSim: the tiled path; fake short 1.0 varlen differs from it on the first batch"),
    ],
    ids=["agrees", "disagrees"],
)
def test_the_cached_loss_decides_once_and_trains_as_the_stock_loss(model, kernel, chosen, note):
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    from cembed.config.loss import loss_config
    from cembed.losses.registry import build_loss

    reference = step(model, CachedMultiVectorMultipleNegativesRankingLoss(model, scale=2.0, mini_batch_size=64))
    built = build_loss(model, loss_config(name="cached_maxsim", scale=2.0, score_query_tokens=8), 2)
    find = finder(kernel)
    built.cached_module.find_kernel = find
    for _ in range(2):
        value, grad = step(model, built.module)
        assert relative(value, reference[0]) < 1e-5 and relative(grad, reference[1]) < 1e-5
    assert find.calls == ["cpu"] and built.cached_module.scoring.path == chosen
    assert len(built.notes) == 1 and built.notes[0].startswith(note)


def test_the_tiled_setting_and_a_cpu_run_say_nothing(model):
    from cembed.config.loss import loss_config
    from cembed.losses.registry import build_loss

    for setting in ("tiled", "auto"):
        built = build_loss(model, loss_config(name="cached_maxsim", score_kernel=setting), 2)
        step(model, built.module)
        assert built.cached_module.scoring == K.ScoringChoice(None, "tiled (torch)") and built.notes == []


def test_a_loss_note_is_shown_and_logged_once(tmp_path):
    from types import SimpleNamespace

    from cembed.train.trainer import RunLog, RunLogCallback

    notes, shown = [], []
    callback = RunLogCallback(RunLog(), 8, tmp_path / "train.log", shown.append, notes=notes)
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    callback.on_step_end(None, state, None)
    notes.append("MaxSim: fused kernel x")
    for step_ in (1, 2):
        state.global_step = step_
        callback.on_step_end(None, state, None)
    assert shown == ["MaxSim: fused kernel x"]
    assert (tmp_path / "train.log").read_text().count("MaxSim: fused kernel x") == 1
