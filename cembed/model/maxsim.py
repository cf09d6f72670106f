"""MaxSim (late interaction, Khattab & Zaharia 2020, arXiv:2004.12832) over ragged token vectors, in tiles.

A text of a multi-vector model is a set of token vectors. Here a column of texts is :class:`RaggedTokens`:
the scored token vectors of all rows end to end (``values``, ``(tokens, dim)``) and the row offsets
(``offsets``, ``rows + 1``): no padding anywhere, whatever the lengths. The score of query ``q`` and
document ``d`` is ``sum_{s in q} max_{t in d} <q_s, d_t>`` (sentence-transformers' ``maxsim``: a document
with no token scores ``-1e9``; ``length_normalize`` divides by the query's token count, MeanMaxSim, the
``-1e9`` too).

Tiles. Queries are cut into tiles of whole rows holding at most ``Tiles.query_tokens`` tokens (at least
one row); documents into chunks of at most ``Tiles.document_rows`` consecutive rows, each read in token
tiles of at most ``Tiles.document_tokens`` tokens of the flat ``values`` (a tile may end inside a
document: a long document spans tiles). For each (query tile, document chunk) a running max per
(query token, document) is kept over the chunk's token tiles, and the chunk's scores update a running
(online) log-sum-exp per query (Milakov & Gimelshein 2018, arXiv:1805.02867), so neither the
``(queries, documents)`` score matrix nor any ``(query tokens, document tokens)`` similarity beyond one
tile is ever materialised. Scoring memory, besides the inputs and their gradients, is bounded by the tiles
(:func:`cembed.config.loss.maxsim_scoring_bytes`; ``validate`` and ``estimate`` state it):

    at most 4 bytes x (3 x Sq x Td + 5 x Sq x Rd) + 32 bytes x queries

for ``Sq = max(query_tokens, longest query)``, ``Td = document_tokens``, ``Rd = document_rows`` (a tile's
similarities, one gathered copy of a per-(query token, document) array and their product; the running
max, its gradient, the hits found so far and in the tile, the scores; per query its largest logit and
log-sum (the log-sum-exp in two parts), its label, and the row offsets, kept on the host as 4-byte ints),
whatever the batch. The inputs are read in place: a cache of mini-batches is :class:`TokenPieces`, never concatenated (a tile that spans
two mini-batches is copied, the tile only).

:func:`maxsim_infonce` is InfoNCE over these scores (``CachedMultiVectorMultipleNegativesRankingLoss``'s
loss: ``mean_i [logsumexp_j(scale s_ij) - scale s_i,label_i]``) as one autograd Function whose backward
recomputes each tile's similarities and sends each (query token, document) pair's gradient to the one
document token that held its max (the first in token order on a tie, as ``torch.max`` returns) — again
without the full similarity tensor. :func:`maxsim_scores` is the forward alone, for retrieval.
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass

import torch

from cembed.config.loss import maxsim_scoring_bytes

EMPTY_DOCUMENT_SCORE = -1e9  # sentence-transformers' score of a document with no scored token
TIE_ROWS = 64  # query tokens whose ties in a tile are resolved at once (the buffers are (TIE_ROWS, T))


class TokenPieces:
    """Token vectors held as consecutive pieces (a cache's mini-batches, ``(tokens_i, dim)`` each) and read as
    one ``(tokens, dim)`` array without concatenating them: a slice within one piece is a view of it, a
    slice across pieces a copy of that slice only (a tile, never the cache).

    Raises:
        ValueError: no piece, or pieces that differ in width, dtype or device.
    """

    def __init__(self, parts) -> None:
        self.parts = tuple(parts)
        if not self.parts:
            raise ValueError("TokenPieces needs at least one piece")
        first = self.parts[0]
        for p in self.parts:
            if p.dim() != 2 or p.shape[1] != first.shape[1] or p.dtype != first.dtype or p.device != first.device:
                raise ValueError("TokenPieces: every piece must be (tokens, dim) of one width, dtype and device")
        self.starts = array("q", [0])
        for p in self.parts:
            self.starts.append(self.starts[-1] + p.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.starts[-1], self.parts[0].shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def __getitem__(self, key: slice) -> torch.Tensor:
        """Rows ``key`` (a slice with step 1) as one tensor: a view when they lie in one piece."""
        start, stop, step = key.indices(self.starts[-1])
        if step != 1:
            raise ValueError("TokenPieces: only slices with step 1")
        out = []
        while start < stop:
            i = bisect.bisect_right(self.starts, start) - 1  # the (non-empty) piece holding row `start`
            end = min(stop, self.starts[i + 1])
            out.append(self.parts[i][start - self.starts[i] : end - self.starts[i]])
            start = end
        if not out:
            return self.parts[0][:0]
        return out[0] if len(out) == 1 else torch.cat(out)


# Row offsets on the host: int32 while they fit (half the bytes a row), else int64.
OFFSET_DTYPES = {"i": torch.int32, "q": torch.int64}
assert array("i").itemsize == 4 and array("q").itemsize == 8


def offset_array(offsets: torch.Tensor) -> array:
    """``offsets`` (a 1-D integer tensor, starting at 0) as a host ``array``: typecode ``i`` (int32) when its
    last value fits in int32, else ``q`` (int64)."""
    code = "i" if int(offsets[-1]) < 2**31 else "q"
    out = array(code)
    out.frombytes(offsets.to(OFFSET_DTYPES[code]).cpu().numpy().tobytes())
    return out


def _pieces(values) -> TokenPieces:
    return values if isinstance(values, TokenPieces) else TokenPieces([values])


@dataclass(frozen=True)
class RaggedTokens:
    """Token vectors of ``rows`` texts end to end: ``values`` ``(tokens, dim)`` (a tensor, or the cache's
    mini-batches as :class:`TokenPieces`) and ``offsets`` (``rows + 1`` ints on the host, kept as an
    ``array``: 4 bytes a row while the tokens fit in int32, else 8 (:func:`offset_array`); row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``). A list of offsets is converted.

    Raises:
        ValueError: the offsets do not end at the number of token vectors."""

    values: torch.Tensor | TokenPieces
    offsets: array

    def __post_init__(self) -> None:
        if not isinstance(self.offsets, array) or self.offsets.typecode not in OFFSET_DTYPES:
            object.__setattr__(self, "offsets", offset_array(torch.tensor([int(o) for o in self.offsets])))
        if self.offsets[-1] != self.values.shape[0]:
            raise ValueError(f"{self.values.shape[0]} token vectors but the offsets end at {self.offsets[-1]}")

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_lengths(cls, values, lengths) -> RaggedTokens:
        """From ``values`` (a tensor or :class:`TokenPieces`) and each row's token count (a tensor or a list)."""
        counts = torch.as_tensor(lengths if isinstance(lengths, torch.Tensor) else list(lengths), dtype=torch.int64)
        ends = torch.cumsum(counts.detach().cpu(), dim=0)
        offsets = offset_array(torch.cat([ends.new_zeros(1), ends]))
        if offsets[-1] != values.shape[0]:
            raise ValueError(f"{values.shape[0]} token vectors but the lengths sum to {offsets[-1]}")
        return cls(values, offsets)

    @classmethod
    def from_padded(cls, embeddings: torch.Tensor, mask: torch.Tensor) -> RaggedTokens:
        """From a padded ``(rows, width, dim)`` tensor and its ``(rows, width)`` scoring mask."""
        mask = mask.bool()
        return cls.from_lengths(embeddings[mask], mask.sum(dim=1))

    def lengths(self, device=None) -> torch.Tensor:
        """Each row's token count, ``(rows,)`` int64."""
        offsets = torch.frombuffer(self.offsets, dtype=OFFSET_DTYPES[self.offsets.typecode]).long()
        return (offsets[1:] - offsets[:-1]).to(device)


@dataclass(frozen=True)
class Tiles:
    """How MaxSim is cut (see the module docstring): query tiles of at most ``query_tokens`` tokens (whole
    rows), document chunks of at most ``document_rows`` rows read in tiles of ``document_tokens`` tokens."""

    query_tokens: int = 1024
    document_tokens: int = 8192
    document_rows: int = 1024

    def __post_init__(self) -> None:
        for name in ("query_tokens", "document_tokens", "document_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tiles.{name} must be at least 1, got {getattr(self, name)}")

    def bound_bytes(self, longest_query: int, queries: int) -> int:
        """The scoring memory bound of the module docstring, in bytes
        (:func:`cembed.config.loss.maxsim_scoring_bytes`)."""
        return maxsim_scoring_bytes(self.query_tokens, self.document_tokens, self.document_rows, longest_query, queries)


def query_tiles(offsets: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ``(first row, end row)`` ranges of whole rows holding at most ``max_tokens`` tokens
    each (a longer row alone)."""
    tiles, begin = [], 0
    rows = len(offsets) - 1
    while begin < rows:
        end = begin + 1
        while end < rows and offsets[end + 1] - offsets[begin] <= max_tokens:
            end += 1
        tiles.append((begin, end))
        begin = end
    return tiles


def document_tiles(offsets: list[int], tiles: Tiles) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``(first row, end row, token tiles)`` per chunk of at most ``tiles.document_rows`` rows, its
    tokens ``offsets[first]:offsets[end]`` cut into ``(begin, end)`` ranges of at most
    ``tiles.document_tokens`` tokens (a range may end inside a document)."""
    out = []
    rows = len(offsets) - 1
    for j0 in range(0, rows, tiles.document_rows):
        j1 = min(rows, j0 + tiles.document_rows)
        t0, t1 = offsets[j0], offsets[j1]
        token_tiles = [(t, min(t1, t + tiles.document_tokens)) for t in range(t0, t1, tiles.document_tokens)]
        out.append((j0, j1, token_tiles))
    return out


def _row_ids(offsets: list[int], begin: int, end: int, device) -> torch.Tensor:
    """For the rows ``begin:end``: each of their tokens' row index minus ``begin`` (long, on ``device``)."""
    counts = torch.tensor([offsets[i + 1] - offsets[i] for i in range(begin, end)], device=device)
    return torch.repeat_interleave(torch.arange(end - begin, device=device), counts)


class _Chunk:
    """One (query tile, document chunk) pair: its running max per (query token, document), its scores
    and the backward of the running max. Holds one tile's similarities at most (the chunk's only tile,
    reused by the backward), dropped by :meth:`release`."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, d_offsets: list[int], j0: int, j1: int, token_tiles):
        self.q, self.d, self.offsets, self.j0, self.j1, self.token_tiles = q, d, d_offsets, j0, j1, token_tiles
        lengths = torch.tensor([d_offsets[j + 1] - d_offsets[j] for j in range(j0, j1)], device=q.device)
        self.empty = lengths == 0
        self.similarities: torch.Tensor | None = None  # kept when the chunk is one token tile
        self.kept_max: torch.Tensor | None = None  # the running max, kept for block_backward

    def tile(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token tile ``t0:t1``: ``(similarities (Sq, T) float32, each token's chunk-local document
        (T,), each token's tile-local column where its document starts within the tile (T,))``."""
        first = bisect.bisect_right(self.offsets, t0) - 1  # the document holding token t0
        last = bisect.bisect_left(self.offsets, t1)  # one past the document holding token t1 - 1
        while first < last and self.offsets[first + 1] <= t0:  # skip documents without tokens
            first += 1
        starts = [max(self.offsets[j], t0) for j in range(first, last)]
        ends = [min(self.offsets[j + 1], t1) for j in range(first, last)]
        counts = torch.tensor([e - b for b, e in zip(starts, ends)], device=self.q.device)
        docs = torch.repeat_interleave(torch.arange(first - self.j0, last - self.j0, device=self.q.device), counts)
        seg = torch.repeat_interleave(torch.tensor([b - t0 for b in starts], device=self.q.device), counts)
        if self.similarities is None:
            sim = (self.q @ self.d[t0:t1].T).float()
        else:
            sim = self.similarities
        return sim, docs, seg

    def running_max(self) -> torch.Tensor:
        """``(Sq, documents)`` float32: each query token's max similarity to each document of the chunk
        (``-inf`` for a document without tokens), over the chunk's token tiles."""
        sq = self.q.shape[0]
        rmax = torch.full((sq, self.j1 - self.j0), float("-inf"), device=self.q.device)
        for t0, t1 in self.token_tiles:
            sim, docs, _ = self.tile(t0, t1)
            rmax.scatter_reduce_(1, docs.expand(sq, -1), sim, "amax", include_self=True)
            if len(self.token_tiles) == 1:
                self.similarities = sim
        return rmax

    def release(self) -> None:
        """Drop the kept similarities."""
        self.similarities = None

    def scores(self, rmax: torch.Tensor, q_rows: torch.Tensor, n_rows: int, divide: torch.Tensor | None):
        """``(query rows, documents)`` float32 MaxSim scores from the running max (``divide``: the query
        token counts, for MeanMaxSim)."""
        return finish_scores(self.sums(rmax, q_rows, n_rows), self.empty, divide)

    def sums(self, rmax: torch.Tensor, q_rows: torch.Tensor, n_rows: int) -> torch.Tensor:
        """``(query rows, documents)``: each query's sum of its tokens' running max (0 for a document
        without tokens)."""
        return torch.zeros(n_rows, rmax.shape[1], device=rmax.device).index_add_(
            0, q_rows, rmax.masked_fill(self.empty, 0.0)
        )

    def block_sums(self, q_rows: torch.Tensor, n_rows: int, for_backward: bool = False) -> torch.Tensor:
        """The block protocol's forward (:class:`FusedBlock` has the same): :meth:`sums` of the chunk's
        running max. ``for_backward``: keep the running max (and a one-tile chunk's similarities) for
        :meth:`block_backward`; else release them."""
        rmax = self.running_max()
        if for_backward:
            self.kept_max = rmax
        else:
            self.release()
        return self.sums(rmax, q_rows, n_rows)

    def block_backward(self, q_rows: torch.Tensor, dsums: torch.Tensor, dq: torch.Tensor, dd: torch.Tensor) -> None:
        """The block protocol's backward, after :meth:`block_sums` ``(for_backward=True)``: add to ``dq``
        (the query tile's tokens) and ``dd`` (all document tokens) the gradient of the sums given
        ``dsums``, their gradient; then release what was kept."""
        self.backward(self.kept_max, dsums[q_rows].masked_fill(self.empty, 0.0), dq, dd)
        self.kept_max = None
        self.release()

    def backward(self, rmax: torch.Tensor, dmax: torch.Tensor, dq: torch.Tensor, dd: torch.Tensor) -> None:
        """Add to ``dq`` (this query tile's tokens, in place) and ``dd`` (all document tokens) the
        gradient of the running max, ``dmax`` ``(Sq, documents)``: each (query token, document) pair's
        goes to the first token of the document that reached the max (as ``torch.max`` picks on a tie).

        Memory: the tile's similarities are turned in place into the hit mask and then the weights, so
        at most three ``(Sq, T)`` float buffers live at once (the similarities, one gathered copy of the
        running max or of ``dmax``, the product). A tie (two tokens of a document at its max: float32
        similarities tie by chance about once per 10^7 comparisons, bf16 ones far more often) is resolved
        for the tied query tokens only, ``TIE_ROWS`` at a time: a few ``(TIE_ROWS, T)`` buffers, not
        ``(Sq, T)`` ones (resolving the whole tile at once doubled the loss stage's peak on a tie)."""
        sq = self.q.shape[0]
        spans = len(self.token_tiles) > 1  # a document may reach its max in an earlier tile
        found = torch.zeros(sq, self.j1 - self.j0, device=self.q.device) if spans else None
        for t0, t1 in self.token_tiles:
            sim, docs, seg = self.tile(t0, t1)
            index = docs.expand(sq, -1)
            hits = sim.eq_(rmax.gather(1, index))  # in place: 1 where a token holds its document's max
            if found is not None:  # documents already served by an earlier tile take nothing here
                hits.mul_(found.gather(1, index) == 0)
            counts = torch.zeros_like(rmax).scatter_add_(1, index, hits)
            if bool((counts > 1).any()):  # a tie within this tile: keep each document's first hit only
                tied = (counts > 1).any(dim=1).nonzero().flatten()  # the query tokens with a tie
                for part in tied.split(TIE_ROWS):
                    hits[part] = self._first_hits(hits[part], seg)
                counts.zero_().scatter_add_(1, index, hits)
            if found is not None:
                found.add_(counts)
            weights = hits.mul_(dmax.gather(1, index))
            dq += weights @ self.d[t0:t1].float()
            dd[t0:t1] += weights.T @ self.q.float()
            del weights, hits

    @staticmethod
    def _first_hits(hits: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        """``hits`` (0/1, ``(Sq, T)``) with only each document's first hit in the tile kept (``seg``: each
        token's tile-local column where its document starts): a running count per document segment."""
        count = hits.to(torch.int32).cumsum(dim=1)
        before = torch.where(seg > 0, count.gather(1, (seg - 1).clamp_min(0).expand(hits.shape[0], -1)), 0)
        return hits * (count - before == 1)


def finish_scores(sums: torch.Tensor, empty: torch.Tensor, divide: torch.Tensor | None) -> torch.Tensor:
    """MaxSim scores from each query's sum of its tokens' maxima (``(query rows, documents)``): a document
    without tokens scores ``-1e9``, then every score is divided by ``divide`` (the query token counts,
    MeanMaxSim) when given, as sentence-transformers does."""
    total = sums.masked_fill(empty, EMPTY_DOCUMENT_SCORE)
    return total / divide[:, None] if divide is not None else total


class FusedBlock:
    """One (query tile, document chunk) scored by a fused kernel (``FusedMaxSim``, the protocol the kernel finder returns):
    the same block protocol as :class:`_Chunk` (``j0``, ``j1``, ``empty``, :meth:`block_sums`,
    :meth:`block_backward`). The kernel takes the tile's and the chunk's token vectors packed with their
    row offsets and returns each (query, document) pair's sum of maxima (0 for an empty document); its
    backward runs here on the detached inputs, so what it keeps lives for one block only."""

    def __init__(self, kernel, q: torch.Tensor, q_offsets: list[int], documents: RaggedTokens, j0: int, j1: int):
        self.kernel, self.q, self.j0, self.j1 = kernel, q, j0, j1
        device = q.device
        self.t0, self.t1 = documents.offsets[j0], documents.offsets[j1]
        self.d = documents.values[self.t0 : self.t1]
        d_offsets = [o - self.t0 for o in documents.offsets[j0 : j1 + 1]]
        self.q_cu = torch.tensor(q_offsets, dtype=torch.int32).to(device, non_blocking=True)
        self.d_cu = torch.tensor(d_offsets, dtype=torch.int32).to(device, non_blocking=True)
        self.max_q = max((b - a for a, b in zip(q_offsets, q_offsets[1:])), default=0)
        lengths = [b - a for a, b in zip(d_offsets, d_offsets[1:])]
        self.max_d = max(lengths, default=0)
        self.empty = torch.tensor([n == 0 for n in lengths], device=device)

    def _call(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return self.kernel.scores(q, d, self.q_cu, self.d_cu, self.max_q, self.max_d).float()

    def block_sums(self, q_rows: torch.Tensor, n_rows: int, for_backward: bool = False) -> torch.Tensor:
        """Each (query, document) pair's sum of maxima; ``for_backward``: computed with the kernel's
        autograd on detached copies of the inputs, the graph kept for :meth:`block_backward`."""
        if not for_backward:
            with torch.no_grad():
                return self._call(self.q, self.d).masked_fill(self.empty, 0.0)
        with torch.enable_grad():
            q, d = self.q.detach().requires_grad_(), self.d.detach().requires_grad_()
            self.graph = (q, d, self._call(q, d))
        return self.graph[2].detach().masked_fill(self.empty, 0.0)

    def block_backward(self, q_rows: torch.Tensor, dsums: torch.Tensor, dq: torch.Tensor, dd: torch.Tensor) -> None:
        """Add the kernel's gradients of the kept sums given ``dsums`` to ``dq`` and ``dd``."""
        q, d, sums = self.graph
        self.graph = None
        # allow_unused: a block of documents without tokens (or a kernel that skips them) reaches no input
        gq, gd = torch.autograd.grad(sums, (q, d), dsums.masked_fill(self.empty, 0.0), allow_unused=True)
        if gq is not None:
            dq += gq.float()
        if gd is not None:
            dd[self.t0 : self.t1] += gd.float()


def fused_tiles(queries: RaggedTokens, documents: RaggedTokens, tiles: Tiles) -> tuple[list, list]:
    """How a fused kernel's blocks are cut: ``(query tiles, document chunks)``, each a list of ``(first
    row, end row)``. A query tile holds whole queries whose count times the longest of them is at most
    ``tiles.query_tokens`` (the kernel keeps an argmax per (query, document, query position)); a document
    chunk whole documents, at most ``tiles.document_rows`` of them and ``tiles.document_tokens`` tokens
    (a longer query or document alone)."""

    q_off, d_off = queries.offsets, documents.offsets
    query, begin = [], 0
    while begin < queries.rows:  # whole queries: rows x the longest of them within query_tokens
        end, longest = begin + 1, q_off[begin + 1] - q_off[begin]
        while end < queries.rows:
            wider = max(longest, q_off[end + 1] - q_off[end])
            if (end + 1 - begin) * wider > tiles.query_tokens:
                break
            end, longest = end + 1, wider
        query.append((begin, end))
        begin = end
    document, begin = [], 0
    while begin < documents.rows:  # whole documents: at most document_rows of them and document_tokens
        end = begin + 1
        while end < documents.rows and end + 1 - begin <= tiles.document_rows:
            if d_off[end + 1] - d_off[begin] > tiles.document_tokens:
                break
            end += 1
        document.append((begin, end))
        begin = end
    return query, document


def _blocks(queries: RaggedTokens, documents: RaggedTokens, tiles: Tiles, kernel=None):
    """Each query tile ``(r0, r1, a0, a1, token rows, blocks)``; ``blocks`` yields its (query tile,
    document chunk) blocks one at a time: tiled :class:`_Chunk` s, or :class:`FusedBlock` s with a
    ``kernel`` (cut by :func:`fused_tiles`)."""
    if kernel is None:
        yield from _query_tiles(queries, documents, tiles)
        return
    q_tiles, d_chunks = fused_tiles(queries, documents, tiles)
    for r0, r1 in q_tiles:
        a0, a1 = queries.offsets[r0], queries.offsets[r1]
        q = queries.values[a0:a1]
        rows = _row_ids(queries.offsets, r0, r1, q.device)
        local = [o - a0 for o in queries.offsets[r0 : r1 + 1]]
        blocks = (FusedBlock(kernel, q, local, documents, j0, j1) for j0, j1 in d_chunks)
        yield r0, r1, a0, a1, rows, blocks


def _query_tiles(queries: RaggedTokens, documents: RaggedTokens, tiles: Tiles):
    """Each query tile ``(r0, r1, a0, a1, token rows, chunks)``; ``chunks`` yields its document chunks
    (:class:`_Chunk`) one at a time."""
    d_tiles = document_tiles(documents.offsets, tiles)
    for r0, r1 in query_tiles(queries.offsets, tiles.query_tokens):
        a0, a1 = queries.offsets[r0], queries.offsets[r1]
        q = queries.values[a0:a1]
        rows = _row_ids(queries.offsets, r0, r1, q.device)
        chunks = (_Chunk(q, documents.values, documents.offsets, *dt) for dt in d_tiles)
        yield r0, r1, a0, a1, rows, chunks


def _token_counts(queries: RaggedTokens, device) -> torch.Tensor:
    return queries.lengths(device).float().clamp_min(1.0)


@torch.no_grad()
def maxsim_scores(
    queries: RaggedTokens, documents: RaggedTokens, tiles: Tiles = Tiles(), length_normalize: bool = False
) -> torch.Tensor:
    """``(queries, documents)`` float32 MaxSim scores (sentence-transformers' ``maxsim`` of the same
    vectors), computed in tiles. The returned matrix is the only thing that grows with both counts: a
    retrieval scores one block of queries at a time."""
    out = torch.empty(queries.rows, documents.rows, device=queries.values.device)
    counts = _token_counts(queries, queries.values.device) if length_normalize else None
    for r0, r1, _a0, _a1, rows, chunks in _query_tiles(queries, documents, tiles):
        divide = counts[r0:r1] if counts is not None else None
        for chunk in chunks:
            out[r0:r1, chunk.j0 : chunk.j1] = chunk.scores(chunk.running_max(), rows, r1 - r0, divide)
            chunk.release()
    return out


class _MaxSimInfoNCE(torch.autograd.Function):
    """InfoNCE over tiled MaxSim scores; see :func:`maxsim_infonce`. The inputs are the pieces of the
    queries' and then the documents' values (``setup`` says how many are the queries'), so a cache of
    mini-batches is scored as it is held, and each piece gets its own gradient (views of one float32
    buffer per column, which autograd keeps as the pieces' ``.grad``: no copy of the cache is made)."""

    @staticmethod
    def forward(ctx, setup, labels, *parts):
        n_q, q_offsets, d_offsets, scale, length_normalize, tiles, divisor, kernel = setup
        q_values, d_values = TokenPieces(parts[:n_q]), TokenPieces(parts[n_q:])
        queries, documents = RaggedTokens(q_values, q_offsets), RaggedTokens(d_values, d_offsets)
        device = q_values.device
        counts = _token_counts(queries, device) if length_normalize else None
        # Per query its largest logit and the log of sum(exp(logit - largest)), kept apart: the loss is
        # (largest - positive) + log-sum, as cross_entropy's log_softmax takes it. Their sum (the log-sum-exp)
        # rounds at the logits' magnitude (256 at the -2e9 of documents without tokens, ~2e-6 at 30), which
        # swamps a small loss (a trained model's) once the positive is subtracted.
        tops = torch.empty(queries.rows, device=device)
        log_totals = torch.empty(queries.rows, device=device)
        loss = torch.zeros((), device=device)
        for r0, r1, _a0, _a1, rows, blocks in _blocks(queries, documents, tiles, kernel):
            n = r1 - r0
            top = torch.full((n,), float("-inf"), device=device)
            total = torch.zeros(n, device=device)
            positive = torch.empty(n, device=device)
            label = labels[r0:r1]
            divide = counts[r0:r1] if counts is not None else None
            for block in blocks:
                logits = scale * finish_scores(block.block_sums(rows, n), block.empty, divide)
                new_top = torch.maximum(top, logits.max(dim=1).values)
                total = total * torch.exp(top - new_top) + torch.exp(logits - new_top[:, None]).sum(dim=1)
                top = new_top
                inside = (label >= block.j0) & (label < block.j1)
                local = (label - block.j0).clamp(0, block.j1 - block.j0 - 1)
                positive = torch.where(inside, logits.gather(1, local[:, None])[:, 0], positive)
                del logits  # freed before the next block's tile is allocated, not after: the bound counts one block
            tops[r0:r1], log_totals[r0:r1] = top, torch.log(total)
            loss += ((top - positive) + log_totals[r0:r1]).sum()
        ctx.save_for_backward(labels, tops, log_totals, *parts)
        ctx.setup = setup
        return loss / divisor

    @staticmethod
    def backward(ctx, grad):
        labels, tops, log_totals, *parts = ctx.saved_tensors
        n_q, q_offsets, d_offsets, scale, length_normalize, tiles, divisor, kernel = ctx.setup
        q_values, d_values = TokenPieces(parts[:n_q]), TokenPieces(parts[n_q:])
        queries, documents = RaggedTokens(q_values, q_offsets), RaggedTokens(d_values, d_offsets)
        device = q_values.device
        dq = torch.zeros(q_values.shape, dtype=torch.float32, device=device)
        dd = torch.zeros(d_values.shape, dtype=torch.float32, device=device)
        counts = _token_counts(queries, device) if length_normalize else None
        weight = grad.float() / divisor
        for r0, r1, a0, a1, rows, blocks in _blocks(queries, documents, tiles, kernel):
            n = r1 - r0
            label = labels[r0:r1]
            divide = counts[r0:r1] if counts is not None else None
            for block in blocks:
                logits = scale * finish_scores(block.block_sums(rows, n, for_backward=True), block.empty, divide)
                dlogits = torch.exp((logits - tops[r0:r1, None]) - log_totals[r0:r1, None])  # softmax, as forward
                inside = (label >= block.j0) & (label < block.j1)
                local = (label - block.j0).clamp(0, block.j1 - block.j0 - 1)
                dlogits.scatter_add_(1, local[:, None], -inside.float()[:, None])
                dsums = (dlogits * (weight * scale)).masked_fill(block.empty, 0.0)
                if divide is not None:
                    dsums = dsums / divide[:, None]
                block.block_backward(rows, dsums, dq[a0:a1], dd)
                del logits, dlogits, dsums  # as in the forward: one block's buffers alive at a time
        grads = []
        for buffer, pieces in ((dq, q_values), (dd, d_values)):
            sizes = [p.shape[0] for p in pieces.parts]
            grads += [g.to(p.dtype) for g, p in zip(buffer.split(sizes), pieces.parts)]
        return (None, None, *grads)


def maxsim_infonce(
    queries: RaggedTokens,
    documents: RaggedTokens,
    labels: torch.Tensor,
    scale: float = 1.0,
    length_normalize: bool = False,
    tiles: Tiles = Tiles(),
    divisor: int | None = None,
    kernel=None,
) -> torch.Tensor:
    """InfoNCE of each query against every document by MaxSim, summed and divided by ``divisor``.

    ``sum_i [logsumexp_j(scale * s_ij) - scale * s_i,labels_i] / divisor``, with ``s`` the MaxSim
    scores (:func:`maxsim_scores`): sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss``
    on the same scores when ``divisor`` is the number of queries (its default here). Differentiable
    with respect to ``queries.values`` and ``documents.values`` (a custom autograd Function: the backward
    recomputes every tile, so no score matrix is kept).

    Args:
        queries: the queries' token vectors.
        documents: every candidate document's token vectors (positives, hard negatives, other ranks').
        labels: ``(queries,)`` long: the index (among ``documents``' rows) of each query's positive.
        scale: ``1 / temperature``.
        length_normalize: MeanMaxSim (each score divided by its query's token count).
        tiles: the tile sizes (they change the memory, never the result beyond float rounding).
        divisor: what the summed loss is divided by (the local batch's rows); default the query count.
        kernel: a fused MaxSim kernel (``FusedMaxSim``, the protocol the kernel finder returns) that scores each
            block of :func:`fused_tiles` in place of the tiled torch path; None (default): the tiled path.

    Raises:
        ValueError: ``labels`` is not one index per query, or an index is out of range.
    """
    if labels.shape != (queries.rows,):
        raise ValueError(f"labels: expected ({queries.rows},) positives, got {tuple(labels.shape)}")
    if queries.rows and (int(labels.min()) < 0 or int(labels.max()) >= documents.rows):
        raise ValueError(f"labels must index the {documents.rows} documents")
    q_values, d_values = _pieces(queries.values), _pieces(documents.values)
    setup = (
        len(q_values.parts),
        queries.offsets,
        documents.offsets,
        float(scale),
        bool(length_normalize),
        tiles,
        divisor if divisor is not None else max(queries.rows, 1),
        kernel,
    )
    return _MaxSimInfoNCE.apply(setup, labels, *q_values.parts, *d_values.parts)
