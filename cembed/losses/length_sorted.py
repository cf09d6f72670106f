"""Length-sorted cached-loss mini-batches: :class:`LengthSortedMixin`, the piece cembed adds in
front of a sentence-transformers ``CachedLossMixin`` loss (sorting, the token budget's ranges,
packed rows, device-side token counts). The built-in losses (:mod:`cembed.losses.mnrl`,
:mod:`cembed.losses.gist`) are built from it.
"""

from __future__ import annotations

import torch
from sentence_transformers.base.losses.gradcache import _get_batch_size
from sentence_transformers.base.losses.gradcache import _minibatch_ranges as _library_ranges
from torch import nn

from cembed.losses.counts import TokenCounts, count_tokens
from cembed.losses.token_budget import token_budget_ranges
from cembed.model.unpad import PackRegistry, Unpadding, UnpadSetting, packed_encoder, resolve_unpad


def minibatch_ranges(
    feature: dict, mini_batch_size: int, mini_batch_num_tokens: int | None = None
) -> list[tuple[int, int]]:
    """sentence-transformers' own cut of one column into mini-batches (its ``_minibatch_ranges``).

    Args:
        feature: a column's tokenized inputs (``input_ids`` / ``attention_mask`` of shape
            ``(rows, seq_len)``).
        mini_batch_size: rows per mini-batch.
        mini_batch_num_tokens: if set, the library's budget of *non-padding* tokens per mini-batch
            (not cembed's padded budget, :mod:`cembed.losses.token_budget`).

    Returns:
        Consecutive ``(begin, end)`` row ranges covering the column.
    """
    return _library_ranges(feature, mini_batch_size, mini_batch_num_tokens)


def take_rows(feature: dict, order: torch.Tensor) -> dict:
    """The rows ``order`` of a column's features, in that order.

    Args:
        feature: a column's tokenized inputs; every tensor with ``len(order)`` rows is indexed
            (``index_select`` on dim 0: a copy), anything else is passed through.
        order: ``(rows,)`` int64 row indices (moved to each tensor's device).

    Returns:
        A new dict with the same keys.
    """
    n = order.numel()
    return {
        k: (
            v.index_select(0, order.to(v.device))
            if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == n
            else v
        )
        for k, v in feature.items()
    }


class LengthSortedMixin:
    """Sorts each column's rows by token length (longest first) before a cached loss cuts them
    into mini-batches, and counts real vs processed token positions (``token_counts``).

    Put it before a sentence-transformers ``CachedLossMixin`` loss in the bases, e.g.
    ``class LengthSortedCachedGIST(LengthSortedMixin, CachedGISTEmbedLoss): pass``; the constructor
    takes ``sort_by_length`` (default True) on top of the loss's own arguments.

    The embeddings are put back in the original row order before the loss, so loss and gradients
    equal the unsorted loss's (the positive of row i stays on the diagonal) while mini-batches of
    similar lengths carry little padding. Longest first also makes the first mini-batch the
    memory worst case.

    ``mini_batch_num_tokens`` is cembed's token budget (:mod:`cembed.losses.token_budget`): mini-batches
    are cut on the sorted rows so that rows x padded width stays within it. It is kept as
    ``token_budget``; the library's own ``mini_batch_num_tokens`` (which counts non-padding tokens)
    stays None, and :meth:`embed_minibatch_iter` hands the library's passes the budget's ranges.

    With ``unpad`` (``auto``: where the model supports it, see :func:`cembed.model.unpad.resolve_unpad`)
    each mini-batch's rows are packed without padding (:mod:`cembed.model.unpad`); the plans are made once
    per column in :meth:`forward` and replayed by the second (gradient) pass, so both passes pack
    alike and draw the same dropout masks. ``unpadding`` says which path runs. One place decides it:
    :meth:`embed_minibatch_iter`, the library's only way into the mini-batches in both passes, runs
    each mini-batch's ``embed_minibatch`` (whichever class defines it) with the model's encoder on the
    packs, and a step whose planned mini-batches did not all run packed fails instead of reporting
    packed rows (a subclass that reaches the model some other way is caught, not misreported).

    The step's state (sorted copies, plans, row orders) lives only as long as the step: the row
    orders until :meth:`forward` returns, the plans until the GradCache backward ends.
    """

    mini_batch_size: int
    model: nn.Module

    def __init__(
        self,
        *args,
        sort_by_length: bool = True,
        mini_batch_num_tokens: int | None = None,
        unpad: UnpadSetting = "auto",
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if mini_batch_num_tokens is not None and mini_batch_num_tokens < 1:
            raise ValueError(f"mini_batch_num_tokens must be at least 1, got {mini_batch_num_tokens}")
        self.sort_by_length = sort_by_length
        self.token_budget = mini_batch_num_tokens
        self.token_counts = TokenCounts()
        self._inverse: list[torch.Tensor | None] = []
        # id(feature dict) -> (rows, ranges) of the current forward: its no-grad pass and the
        # backward's replay must cut the same mini-batches (a module may edit the mask in between).
        self._budget_ranges: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        self.unpadding: Unpadding = resolve_unpad(self.model, unpad)
        self._packs = PackRegistry(self.unpadding)
        self._step = 0  # forwards so far: a step's release leaves a later step's state alone
        self._packed_runs = 0  # mini-batches embedded on packs (embed_minibatch_iter)

    def forward(self, sentence_features, labels):
        """Sort each column by length, count its tokens per mini-batch, then run the cached loss.

        Raises:
            RuntimeError: a mini-batch planned (and counted) packed reached the model without the
                packing (a subclass that does not embed through :meth:`embed_minibatch_iter`).
        """
        features = list(sentence_features)
        self._step += 1
        step = self._step
        self._inverse = []
        if self.sort_by_length:
            features = self.sort_rows(features)
        self._budget_ranges = {}
        self._packs.reset()
        for feature in features:
            ranges = self._ranges(feature)
            plans = self._packs.plan_column(feature, ranges) if self.unpadding.enabled else None
            if plans is None:
                count_tokens(feature, ranges, self.token_counts, longest_first=self.sort_by_length)
            else:  # the encoder runs on the packs' positions (host ints: the plans are made on the host)
                lengths = feature["attention_mask"].sum(dim=1, dtype=torch.int64)
                processed = sum(p.processed for p in plans)
                self.token_counts.add(sum(p.real for p in plans), processed, (lengths * lengths).sum())
        planned, self._packed_runs = self._packs.planned(), 0
        try:
            loss = super().forward(features, labels)
        finally:
            self._inverse = []  # this forward's row order: never applied to other embeddings
        if self._packed_runs != planned:
            self._release(step)
            raise RuntimeError(
                f"{type(self).__name__}: {planned} mini-batches planned packed (and counted so) but "
                f"{self._packed_runs} ran on packs: its mini-batches reach the model without "
                "LengthSortedMixin.embed_minibatch_iter"
            )
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            # The GradCache backward replays the plans: release them after it. This hook runs after
            # the library's backward hook on the same tensor (a tensor's hooks run in registration order).
            loss.register_hook(lambda grad: self._release(step))
        else:  # no backward (evaluation): nothing replays this step
            self._release(step)
        return loss

    def _release(self, step: int) -> None:
        """Drop step ``step``'s packing plans (and the features they hold) and mini-batch ranges,
        unless a later forward has replaced them."""
        if step == self._step:
            self._packs.reset()
            self._budget_ranges = {}

    def sort_rows(self, features: list[dict]) -> list[dict]:
        """Sort each column's rows by token length, longest first (stable), and remember the order,
        so that :meth:`calculate_loss` puts the embeddings back in the original row order.

        :meth:`forward` calls it when ``sort_by_length``; the probe calls it to hold what training
        holds (the sorted copies, and the restored-order leaves of the loss stage).

        Args:
            features: one dict per column; a column without a 2-D ``attention_mask`` stays as it is.

        Returns:
            The sorted copies (:func:`take_rows`), one per column, in column order.
        """
        self._inverse = []
        sorted_features = []
        for feature in features:
            mask = feature.get("attention_mask")
            if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
                sorted_features.append(feature)
                self._inverse.append(None)
                continue
            order = torch.argsort(mask.sum(dim=1), descending=True, stable=True)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            sorted_features.append(take_rows(feature, order))
            self._inverse.append(inverse)
        return sorted_features

    def _ranges(self, feature: dict) -> list[tuple[int, int]]:
        """The mini-batches of one column: by ``token_budget`` (computed once per forward), else
        the library's cut by ``mini_batch_size`` rows."""
        if self.token_budget is None:
            return minibatch_ranges(feature, self.mini_batch_size, None)
        rows = _get_batch_size(feature)
        known = self._budget_ranges.get(id(feature))
        if known is not None and known[0] == rows:
            return known[1]
        ranges = token_budget_ranges(feature, self.token_budget)
        if ranges is None:  # no attention mask: no widths to budget
            return minibatch_ranges(feature, self.mini_batch_size, None)
        self._budget_ranges[id(feature)] = (rows, ranges)
        return ranges

    def embed_minibatch_iter(self, sentence_feature, with_grad, copy_random_state, random_states=None, ranges=None):
        """The library's mini-batch iterator (same arguments and items: each item starts with the
        embeddings ``(rows, dim)``), over the token budget's ranges when a budget is set, with the
        model's encoder on the packs for every packed mini-batch.

        The library cuts ``mini_batch_size`` rows (its ``mini_batch_num_tokens`` is None); with a
        budget both its no-grad pass and its backward replay come here with that cut and get the
        budget's ranges instead, the same ones in both passes, so the cached gradients and RNG
        states line up with the mini-batches they belong to. (The library's DDP flush of a frozen
        last mini-batch indexes its own cut; cembed trains every column through the whole model,
        so no mini-batch is frozen.)

        Packing is decided here, around each mini-batch's whole ``embed_minibatch`` (the library's,
        GIST's, or a mixin's such as the self-guided filter's), not inside one of them: whatever
        embeds the mini-batch, the model's encoder runs on its packs
        (:func:`cembed.model.unpad.packed_encoder`).

        Raises:
            RuntimeError: a packed mini-batch was embedded without the model running on its packs.
        """
        if self.token_budget is not None or ranges is None:
            ranges = self._ranges(sentence_feature)
        items = super().embed_minibatch_iter(sentence_feature, with_grad, copy_random_state, random_states, ranges)
        for begin, end in ranges:
            plan = self._packs.plan_for(sentence_feature, begin, end) if self.unpadding.enabled else None
            if plan is None:
                yield next(items)
                continue
            with packed_encoder(self.model, plan, self.unpadding) as ran:
                item = next(items)
            if ran.count == 0:
                raise RuntimeError(
                    f"{type(self).__name__}: mini-batch {begin}:{end} was planned packed but embedded "
                    "without the model's encoder running on its packs"
                )
            self._packed_runs += 1
            yield item

    def replicate_minibatch(self, outputs: tuple, sizes: list[int]) -> list[list]:
        """One mini-batch's embedding outputs (:meth:`embed_minibatch_iter`'s item without its RNG
        state: the embeddings ``(rows, dim)``, a guide's) cut to mini-batches of ``sizes`` rows, fp32
        (views: the probe copies them per column): what the probe caches for a whole batch of rows alike
        (:mod:`cembed.probe.worst_case`). A loss whose items are laid out otherwise (ragged token
        vectors) overrides this."""
        return [[full[:n] for n in sizes] for full in (e.detach().float() for e in outputs)]

    def calculate_loss(self, reps, labels=None, *, with_backward: bool = False):
        """Run the parent's loss on the embeddings in original row order.

        The parent may back-propagate chunk by chunk, so the reordering cannot be a shared autograd
        graph: each column is reordered into a fresh leaf, and the leaf's gradient is scattered
        back onto the sorted mini-batch embeddings whose ``.grad`` is the GradCache cache.

        The order is the one :meth:`sort_rows` made in the running :meth:`forward` (or an explicit
        :meth:`sort_rows` call, as the probe makes); :meth:`forward` forgets it when it returns, so
        embeddings given after a step are taken in the order given.

        Raises:
            ValueError: a column's embeddings are not as many as the rows of its order.
        """
        if not any(inv is not None for inv in self._inverse):
            return super().calculate_loss(reps, labels, with_backward=with_backward)
        for index, (col, inv) in enumerate(zip(reps, self._inverse)):
            rows = sum(r.shape[0] for r in col)
            if inv is not None and inv.numel() != rows:
                raise ValueError(
                    f"column {index}: {rows} embeddings but a row order of {inv.numel()} rows; "
                    "calculate_loss reorders only the rows sort_rows sorted"
                )
        leaves: list[torch.Tensor | None] = []
        ordered = []
        for col, inv in zip(reps, self._inverse):
            if inv is None:
                leaves.append(None)
                ordered.append(col)
                continue
            # leaf[j] = embedding of original row j = sorted row inv[j]
            leaf = torch.cat([r.detach() for r in col]).index_select(0, inv.to(col[0].device))
            if with_backward:
                leaf.requires_grad_()
            leaves.append(leaf)
            ordered.append([leaf])
        loss = super().calculate_loss(ordered, labels, with_backward=with_backward)
        if with_backward:
            for col, inv, leaf in zip(reps, self._inverse, leaves):
                if leaf is None or leaf.grad is None:
                    continue
                grad_sorted = torch.empty_like(leaf.grad)
                grad_sorted[inv.to(leaf.device)] = leaf.grad
                for rep, grad in zip(col, grad_sorted.split([r.shape[0] for r in col])):
                    rep.grad = grad if rep.grad is None else rep.grad + grad
        return loss
