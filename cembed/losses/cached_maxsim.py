"""``cached_maxsim``: InfoNCE with in-batch negatives over MaxSim scores, for a multi-vector model, with
GradCache; registered here.

It is sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss`` (the same loss and
gradients: query column 0 against every document of every other column, and of every rank with
``gather_across_devices``; the positive of query ``i`` is row ``i`` of column 1; ``mean_i`` of the cross
entropy at ``scale``), built from it with what cembed changes:

* the cache is ragged: each mini-batch's token vectors are kept as the scored tokens end to end
  (:meth:`CachedMaxSimLoss.embed_minibatch`: ``values`` and each row's count, from the model's scoring
  mask), never re-padded to the column's longest row, nor concatenated (the loss reads the mini-batches
  in place, :class:`cembed.model.maxsim.TokenPieces`, and their gradients are views of one buffer);
* scoring is tiled (:func:`cembed.model.maxsim.maxsim_infonce`): no score matrix and no similarity
  tensor beyond one tile, so the scoring memory is bounded by ``loss.score_*`` and not by the batch;
  the backward reaches the cached token vectors through the same tiles;
* rows are length-sorted, cut by a token budget and packed as for every cembed cached loss
  (:class:`cembed.losses.length_sorted.LengthSortedMixin`). The sorted rows are never put back in order:
  the loss only needs to know where each query's positive lies among the documents (the cross entropy
  of a query does not depend on the order of its candidates), so the labels are permuted instead;
* documents of other ranks are gathered ragged too (:func:`cembed.distributed.ragged.gather_rows`);
* on CUDA a fused MaxSim kernel scores the blocks when a package provides one and it agrees with the
  tiled path on the run's first batch (:func:`cembed.model.maxsim_kernel.choose_scoring`; the choice is
  :attr:`CachedMaxSimLoss.scoring`, its one-line note goes to :attr:`CachedMaxSimLoss.notes`).
"""

from __future__ import annotations

import torch
from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss
from torch import nn

from cembed.config.loss import CachedMaxSimLossConfig
from cembed.distributed.ragged import gather_rows, rank_and_world
from cembed.losses.length_sorted import LengthSortedMixin
from cembed.losses.registry import LossSettings, register_loss
from cembed.model.maxsim import RaggedTokens, Tiles, TokenPieces, maxsim_infonce
from cembed.model.maxsim_kernel import ScoringChoice, choose_scoring, find_fused_maxsim


class CachedMaxSimLoss(LengthSortedMixin, CachedMultiVectorMultipleNegativesRankingLoss):
    """``CachedMultiVectorMultipleNegativesRankingLoss`` with a ragged token cache, tiled MaxSim and
    cembed's length-sorted, token-budget, packed mini-batches (see the module docstring).

    Args:
        model: a ``MultiVectorEncoder``.
        scale: ``1 / temperature``.
        tiles: the MaxSim tile sizes (memory only, never the result).
        score_kernel: ``auto`` (a fused CUDA kernel where one imports and agrees with the tiled path on
            the first batch) or ``tiled``.
        **kwargs: ``mini_batch_size``, ``mini_batch_num_tokens``, ``sort_by_length``, ``unpad``,
            ``gather_across_devices`` (:meth:`cembed.losses.registry.LossSettings.cached_kwargs`).
    """

    def __init__(
        self, model, *, scale: float = 1.0, tiles: Tiles = Tiles(), score_kernel: str = "auto", **kwargs
    ) -> None:
        super().__init__(model, scale=scale, **kwargs)
        self.tiles = tiles
        self.score_kernel = score_kernel
        self.find_kernel = find_fused_maxsim  # where a fused kernel comes from (tests hand a fake one)
        self.scoring: ScoringChoice | None = None  # decided on the first batch
        self.notes: list[str] = []  # lines for the run's log (the scoring choice), taken by the trainer

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        """One mini-batch's scored token vectors, ragged: ``(values (tokens, dim), row token counts
        (rows,), RNG state)``; ``values`` is the model's ``token_embeddings`` under its scoring mask, in
        row order (the first item is what GradCache caches a gradient for and replays)."""
        embeddings, mask, state = super().embed_minibatch(
            sentence_feature, begin, end, with_grad, copy_random_state, random_state
        )
        return embeddings[mask], mask.sum(dim=1), state

    def replicate_minibatch(self, outputs: tuple, sizes: list[int]) -> list[list]:
        """The probe's cache of a whole batch from one mini-batch's ``(values, row token counts)``: per
        mini-batch of ``n`` rows, the first ``n`` rows' token vectors (fp32) and their counts (views:
        the probe copies them per column)."""
        values, lengths = outputs
        ends = torch.cumsum(lengths, dim=0).tolist()
        values = values.detach().float()
        return [[values[: ends[n - 1] if n else 0] for n in sizes], [lengths[:n] for n in sizes]]

    def _labels(self, rows: int, columns: int, rank: int) -> torch.Tensor:
        """Each cached query's positive among the documents: queries and documents are cached in sorted
        row order (:meth:`sort_rows`), the documents column after column, rank after rank."""
        inverse = self._inverse or [None, None]
        order = torch.arange(rows)
        if inverse[0] is not None:  # sorted query position p holds original row order[p]
            order = torch.argsort(inverse[0].cpu())
        positive = inverse[1].cpu()[order] if inverse[1] is not None else order
        return positive + rank * rows * columns

    def calculate_loss(self, reps, masks_chunks, *, with_backward: bool = False) -> torch.Tensor:
        """The loss from the ragged cache: ``reps[c]`` the mini-batches' token vectors of column ``c``,
        ``masks_chunks[c]`` their rows' token counts (:meth:`embed_minibatch`). With ``with_backward``
        the gradients reach ``reps``' leaves and the detached loss is returned."""
        # the mini-batches are scored as they are cached (TokenPieces): concatenating them would copy the cache
        queries = RaggedTokens.from_lengths(TokenPieces(reps[0]), torch.cat(masks_chunks[0]))
        doc_values = TokenPieces([v for column in reps[1:] for v in column])
        doc_lengths = torch.cat([n for column in masks_chunks[1:] for n in column])
        rank = 0
        if self.gather_across_devices:  # every rank's documents: a new tensor in any case
            # Every piece in the graph, empty ones too (a mini-batch whose documents the skiplist emptied): a
            # slice skips them, and a piece left without a gradient is a column "not used" for the library.
            doc_values, _ = gather_rows(torch.cat(doc_values.parts))
            doc_lengths, _ = gather_rows(doc_lengths)
            rank, _ = rank_and_world()
        documents = RaggedTokens.from_lengths(doc_values, doc_lengths)
        del doc_lengths  # its offsets are kept (8 bytes a row); the lengths need not live through the scoring
        labels = self._labels(queries.rows, len(reps) - 1, rank).to(queries.values.device)
        model = getattr(self.model, "module", self.model)  # the trainer hands a DDP-wrapped model
        length_normalize = getattr(model, "similarity_fn_name", "maxsim") == "meanmaxsim"
        options = dict(scale=self.scale, length_normalize=length_normalize, tiles=self.tiles)
        if self.scoring is None:  # the first batch: a fused kernel, if any, checked against the tiled path
            self.scoring = choose_scoring(
                self.score_kernel, queries, documents, labels, find=self.find_kernel, **options
            )
            if self.scoring.note:
                self.notes.append(self.scoring.note)
        loss = maxsim_infonce(queries, documents, labels, divisor=queries.rows, kernel=self.scoring.kernel, **options)
        if with_backward:  # a training step: the meter's scoring FLOPs (cembed.train.flops.scoring_flops)
            self.token_counts.scored_pairs += queries.offsets[-1] * documents.offsets[-1]
            loss.backward()
            loss = loss.detach()
        return loss


def build_cached_maxsim(model, cfg: CachedMaxSimLossConfig, settings: LossSettings) -> nn.Module:
    """The ``cached_maxsim`` builder: :class:`CachedMaxSimLoss` at ``cfg.scale`` with ``cfg``'s tiles and
    scoring kernel setting."""
    tiles = Tiles(cfg.score_query_tokens, cfg.score_document_tokens, cfg.score_document_rows)
    return CachedMaxSimLoss(
        model, scale=cfg.scale, tiles=tiles, score_kernel=cfg.score_kernel, **settings.cached_kwargs()
    )


register_loss(CachedMaxSimLossConfig, build_cached_maxsim)
