"""Tiled MaxSim over ragged token vectors (cembed.model.maxsim, issue 40 item 3): the scores equal
sentence-transformers' ``maxsim`` of the same vectors padded, and InfoNCE over them has the loss and
gradients that autograd gives through sentence-transformers' padded scoring, whatever the tiles. Three
deliberately broken copies (a tile boundary that drops a document's last token, a running max reset per
tile, a re-padded cache: the last in tests/losses/test_maxsim_loss.py) fail the same checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.util import maxsim, mean_maxsim

import cembed.model.maxsim as M
from cembed.model.maxsim import RaggedTokens, Tiles, maxsim_infonce, maxsim_scores

DIM = 8
# Whole batch in one tile; one token / one document at a time; tiles that cut documents in pieces.
TILES = [Tiles(), Tiles(1, 1, 1), Tiles(5, 7, 3), Tiles(9, 4, 2), Tiles(3, 64, 5)]
SOME_TILES = [Tiles(), Tiles(1, 2, 1), Tiles(5, 7, 3)]


def ragged(lengths: list[int], seed: int) -> RaggedTokens:
    g = torch.Generator().manual_seed(seed)
    values = F.normalize(torch.randn(sum(lengths), DIM, generator=g), dim=-1)
    return RaggedTokens.from_lengths(values, lengths)


def padded(tokens: RaggedTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows padded to the longest, with their mask (sentence-transformers' layout)."""
    rows = [tokens.values[tokens.offsets[i] : tokens.offsets[i + 1]] for i in range(tokens.rows)]
    width = max(1, *(len(r) for r in rows))
    out = torch.zeros(len(rows), width, DIM, dtype=tokens.values.dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)], mask[i, : len(r)] = r, True
    return out, mask


QUERY_LENGTHS = [3, 1, 6, 2, 4, 5, 2]
# Lengths 0 (a document with no scored token: -1e9) to 13 (longer than most tiles).
DOC_LENGTHS = [4, 0, 13, 1, 7, 2, 9, 3, 5, 11, 1]


@pytest.fixture(scope="module")
def batch():
    queries, documents = ragged(QUERY_LENGTHS, 1), ragged(DOC_LENGTHS, 2)
    labels = torch.tensor([2, 0, 4, 9, 6, 2, 10])
    return queries, documents, labels


def reference(queries, documents, labels, scale, length_normalize=False):
    """Loss and gradients (as ragged values) through sentence-transformers' padded scoring."""
    q, qm = padded(queries)
    d, dm = padded(documents)
    q.requires_grad_(), d.requires_grad_()
    scores = (mean_maxsim if length_normalize else maxsim)(q, d, qm, dm)
    loss = F.cross_entropy(scale * scores, labels)
    loss.backward()
    return loss.detach(), q.grad[qm], d.grad[dm]


def relative(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def infonce_error(queries, documents, labels, scale, tiles, length_normalize=False) -> float:
    """The largest relative difference of the tiled InfoNCE's loss and gradients from :func:`reference`."""
    loss_ref, gq_ref, gd_ref = reference(queries, documents, labels, scale, length_normalize)
    q = queries.values.clone().requires_grad_()
    d = documents.values.clone().requires_grad_()
    loss = maxsim_infonce(
        RaggedTokens(q, queries.offsets), RaggedTokens(d, documents.offsets), labels, scale, length_normalize, tiles
    )
    loss.backward()
    return max(relative(loss.detach(), loss_ref), relative(q.grad, gq_ref), relative(d.grad, gd_ref))


@pytest.mark.parametrize("tiles", TILES)
def test_scores_equal_sentence_transformers_maxsim(batch, tiles):
    queries, documents, _ = batch
    reference_scores = maxsim(*padded(queries)[:1], padded(documents)[0], padded(queries)[1], padded(documents)[1])
    scores = maxsim_scores(queries, documents, tiles)
    assert scores.shape == (7, 11) and scores[:, 1].eq(M.EMPTY_DOCUMENT_SCORE).all()
    torch.testing.assert_close(scores, reference_scores, rtol=1e-6, atol=1e-6)
    normalized = mean_maxsim(*padded(queries)[:1], padded(documents)[0], padded(queries)[1], padded(documents)[1])
    torch.testing.assert_close(maxsim_scores(queries, documents, tiles, length_normalize=True), normalized)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize(("scale", "length_normalize"), [(7.5, False)])
def test_infonce_equals_autograd_through_padded_scoring_whatever_the_tiles(batch, tiles, scale, length_normalize):
    assert infonce_error(*batch, scale, tiles, length_normalize) < 1e-5


@pytest.mark.parametrize("tiles", SOME_TILES)
@pytest.mark.parametrize(("scale", "length_normalize"), [(1.0, False), (4.0, True)])
def test_infonce_loss_and_gradients_equal_autograd_through_padded_scoring(batch, tiles, scale, length_normalize):
    assert infonce_error(*batch, scale, tiles, length_normalize) < 1e-5


def test_a_tie_sends_the_gradient_to_the_first_token_as_torch_max_does():
    # Document 0's tokens 1 and 3 are the same vector: every query token's max over it is a tie.
    queries = ragged([2, 3], 5)
    documents = ragged([4, 3], 6)
    values = documents.values.clone()
    values[3] = values[1]
    values[0] = -values[1]
    documents = RaggedTokens(values, documents.offsets)
    labels = torch.tensor([0, 1])
    for tiles in (Tiles(), Tiles(2, 2, 1), Tiles(1, 3, 2)):
        assert infonce_error(queries, documents, labels, 2.0, tiles) < 1e-5
    d = documents.values.clone().requires_grad_()
    maxsim_infonce(queries, RaggedTokens(d, documents.offsets), labels, 2.0, tiles=Tiles(1, 2, 1)).backward()
    assert d.grad[3].abs().max() == 0  # the later copy of the tie gets nothing


def test_ties_are_resolved_for_the_tied_query_tokens_only_a_few_at_a_time(monkeypatch):
    # Document 0's tokens 0 and 1 are the same vector and token 2 another: the query tokens whose max over
    # it is token 0 tie there, the others do not. Resolving a tie used to allocate several (Sq, T) buffers
    # for the whole tile (float32 similarities tie by chance about once per 10^7 comparisons: the loss
    # stage's peak then doubled); now only the tied query tokens are resolved, TIE_ROWS at a time.
    queries = ragged([3, 4, 2, 5], 7)
    documents = ragged([3, 2, 4, 3], 8)
    values = documents.values.clone()
    values[1] = values[0]
    documents = RaggedTokens(values, documents.offsets)
    labels = torch.tensor([0, 1, 2, 3])
    sims = queries.values @ values[:3].T
    tied = int((sims[:, 0] >= sims[:, 2]).sum())
    assert 0 < tied < queries.values.shape[0]  # some query tokens tie, some do not
    rows_seen = []
    first_hits = M._Chunk._first_hits
    monkeypatch.setattr(M, "TIE_ROWS", 2, raising=False)
    monkeypatch.setattr(
        M._Chunk, "_first_hits", staticmethod(lambda h, seg: rows_seen.append(len(h)) or first_hits(h, seg))
    )
    assert infonce_error(queries, documents, labels, 2.0, Tiles()) < 1e-5
    assert max(rows_seen) <= 2 and sum(rows_seen) == tied


# Cut points of the 56 document tokens (DOC_LENGTHS): inside documents, at a document's end, an empty piece.
PIECE_CUTS = [0, 3, 3, 20, 21, 40, 56]


def pieces(values: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    return [values[a:b].clone().requires_grad_() for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("tiles", SOME_TILES + [Tiles(4, 9, 4)])
def test_a_cache_of_pieces_scores_as_its_concatenation_and_each_piece_gets_its_gradient(batch, tiles):
    # The loss reads the cache's mini-batches in place (TokenPieces): tiles that cross a piece's end, pieces
    # that end inside a document, an empty piece; the pieces' gradients are those of the concatenation.
    queries, documents, labels = batch
    q_cuts = [0, 2, 9, 12, queries.offsets[-1]]
    q_parts, d_parts = pieces(queries.values, q_cuts), pieces(documents.values, PIECE_CUTS)
    loss = maxsim_infonce(
        RaggedTokens(M.TokenPieces(q_parts), queries.offsets),
        RaggedTokens(M.TokenPieces(d_parts), documents.offsets),
        labels,
        3.0,
        tiles=tiles,
    )
    loss.backward()
    loss_ref, gq_ref, gd_ref = reference(queries, documents, labels, 3.0)
    assert relative(loss.detach(), loss_ref) < 1e-6
    assert relative(torch.cat([p.grad for p in q_parts]), gq_ref) < 1e-5
    assert relative(torch.cat([p.grad for p in d_parts]), gd_ref) < 1e-5
    assert [p.grad.shape[0] for p in d_parts] == [3, 0, 17, 1, 19, 16]


def test_offsets_are_int32_while_they_fit_and_int64_beyond():
    small = M.offset_array(torch.tensor([0, 3, 2**31 - 1]))
    large = M.offset_array(torch.tensor([0, 3, 2**31]))
    assert (small.typecode, small.itemsize, list(small)) == ("i", 4, [0, 3, 2**31 - 1])
    assert (large.typecode, large.itemsize, list(large)) == ("q", 8, [0, 3, 2**31])
    tokens = RaggedTokens(torch.zeros(5, 2), [0, 2, 2, 5])
    assert tokens.offsets.typecode == "i" and tokens.lengths().tolist() == [2, 0, 3]
    assert RaggedTokens.from_lengths(torch.zeros(5, 2), torch.tensor([2, 0, 3])).offsets.typecode == "i"


def test_token_pieces_read_a_slice_as_a_view_within_a_piece_and_a_copy_of_it_across():
    parts = [torch.arange(6.0).view(3, 2), torch.zeros(0, 2), torch.arange(6.0, 14.0).view(4, 2)]
    values = M.TokenPieces(parts)
    assert values.shape == (7, 2) and values.dtype == torch.float32
    within = values[4:6]
    assert within.tolist() == [[8, 9], [10, 11]] and within.data_ptr() == parts[2][1].data_ptr()
    assert values[2:4].tolist() == [[4, 5], [6, 7]] and values[:].tolist() == torch.cat(parts).tolist()
    assert values[7:7].shape == (0, 2) and values[-2:].tolist() == [[10, 11], [12, 13]]
    with pytest.raises(ValueError, match="one width, dtype and device"):
        M.TokenPieces([torch.zeros(2, 2), torch.zeros(2, 3)])


def test_ragged_tokens_from_padded_keeps_only_the_masked_tokens():
    emb = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    tokens = RaggedTokens.from_padded(emb, mask)
    assert list(tokens.offsets) == [0, 2, 4]
    assert tokens.values.tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]
    with pytest.raises(ValueError, match="5 token vectors but the lengths sum to 4"):
        RaggedTokens.from_lengths(torch.zeros(5, 2), [1, 3])


def test_tiles_cover_every_token_once():
    offsets = [0, 4, 4, 17, 18, 25]
    chunks = M.document_tiles(offsets, Tiles(1, 5, 2))
    assert [(j0, j1) for j0, j1, _ in chunks] == [(0, 2), (2, 4), (4, 5)]
    covered = [t for _, _, tiles in chunks for a, b in tiles for t in range(a, b)]
    assert covered == list(range(25)) and all(b - a <= 5 for _, _, tiles in chunks for a, b in tiles)
    assert M.query_tiles([0, 3, 4, 10, 12], 4) == [(0, 2), (2, 3), (3, 4)]
    assert Tiles(10, 20, 30).bound_bytes(longest_query=12, queries=100) == 4 * (3 * 12 * 20 + 5 * 12 * 30) + 3200


# --- deliberately broken copies: the checks above must see each one --------------------------------------


DOCUMENT_TILES = M.document_tiles  # the real one, which the broken copy calls


def _drop_last_token_tiles(offsets, tiles):
    """Broken: each chunk's last token tile ends one token early (its document's last token is never read)."""
    out = []
    for j0, j1, token_tiles in DOCUMENT_TILES(offsets, tiles):
        *head, (a, b) = token_tiles
        out.append((j0, j1, [*head, (a, b - 1)] if b - 1 > a else head))
    return out


def _reset_running_max(self):
    """Broken: the running max restarts at each token tile (only the last tile of a document counts)."""
    sq = self.q.shape[0]
    rmax = None
    for t0, t1 in self.token_tiles:
        sim, docs, _ = self.tile(t0, t1)
        rmax = torch.full((sq, self.j1 - self.j0), float("-inf"))
        rmax.scatter_reduce_(1, docs.expand(sq, -1), sim, "amax", include_self=True)
    return rmax if rmax is not None else torch.full((sq, self.j1 - self.j0), float("-inf"))


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(("document_tiles", _drop_last_token_tiles), id="tile-boundary-drops-last-token"),
        pytest.param(("_Chunk.running_max", _reset_running_max), id="running-max-reset-per-tile"),
    ],
)
def test_the_checks_fail_on_a_broken_copy(batch, monkeypatch, broken):
    name, replacement = broken
    if name == "document_tiles":
        monkeypatch.setattr(M, "document_tiles", replacement)
    else:
        monkeypatch.setattr(M._Chunk, "running_max", replacement)
    tiles = Tiles(5, 7, 3)  # documents span token tiles
    assert infonce_error(*batch, 3.0, tiles) > 1e-3
    queries, documents, _ = batch
    q, qm = padded(queries)
    d, dm = padded(documents)
    assert (maxsim_scores(queries, documents, tiles) - maxsim(q, d, qm, dm)).abs().max() > 1e-3
