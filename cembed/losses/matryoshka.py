"""``loss.matryoshka``: any cembed loss also trained on truncated embeddings, through
sentence-transformers' ``MatryoshkaLoss`` (Matryoshka Representation Learning, Kusupati et al. 2022,
arXiv:2205.13147).

The loss is ``sum_d w_d * L(first d dimensions of every embedding, re-normalized)``. With a cached
loss the library decorates the loss stage (``calculate_loss``), so every dimension reuses the same two
embedding passes; with a plain loss it patches the model's forward so the batch is embedded once.
"""

from __future__ import annotations

from collections.abc import Sequence

from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss
from torch import nn

from cembed.config.loss import matryoshka_dims_problem
from cembed.errors import UserError


class CountingMatryoshkaLoss(MatryoshkaLoss):
    """``MatryoshkaLoss`` that keeps the wrapped loss's ``token_counts`` / ``filter_counts`` (the meter
    reads them) and counts each text's tokens once per step, not once per dimension.

    Args:
        model: the SentenceTransformer being trained.
        loss: a cembed loss module (cached or plain), with ``token_counts``.
        dims: embedding sizes to train, each at most the model's embedding size.
        weights: one per dim (default 1 each).

    Raises:
        UserError: a dim larger than the model's embedding size (naming ``loss.matryoshka.dims``).
    """

    def __init__(self, model, loss: nn.Module, dims: Sequence[int], weights: Sequence[float] | None = None) -> None:
        problem = matryoshka_dims_problem(list(dims), model.get_embedding_dimension())
        if problem is not None:
            raise UserError(f"loss.matryoshka.dims: {problem}")
        super().__init__(model, loss, list(dims), None if weights is None else list(weights))
        self.token_counts = getattr(loss, "token_counts", None)
        self.filter_counts = getattr(loss, "filter_counts", None)
        self.unpadding = getattr(loss, "unpadding", None)

    def forward(self, sentence_features, labels):
        """The weighted sum over ``dims`` of the wrapped loss on truncated embeddings."""
        counts = self.token_counts
        if self.uses_gradient_cache or counts is None:  # the cached loss runs (and counts) once
            return super().forward(sentence_features, labels)
        # The plain loss is called once per dim on the same texts: keep one call's counts.
        real, processed = counts.real, counts.processed
        loss = super().forward(sentence_features, labels)
        calls = len(self.matryoshka_dims)
        counts.real = real + (counts.real - real) // calls
        counts.processed = processed + (counts.processed - processed) // calls
        return loss
