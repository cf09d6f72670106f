"""A fused MaxSim kernel for the cached MaxSim loss on CUDA, and the check that picks it.

The tiled torch path (:mod:`cembed.model.maxsim`) runs everywhere and is the default. On CUDA, a fused
kernel from a package scores each (query tile, document chunk) block in one launch instead, when the
package imports and the kernel agrees with the tiled path on the run's first batch:

* the kernel: ``late-interaction-kernels``' ``maxsim_varlen`` (hcompai/late-interaction-kernels, Apache-2.0;
  the kernel PyLate and colpali-engine dispatch to, illuin-tech/colpali#412): Triton, autograd-aware,
  over packed token vectors with row offsets (FlashAttention's varlen layout), which is the ragged cache
  as it is, so nothing is padded. It keeps an int32 argmax per (query, document, query position) for its
  backward, so the blocks it scores are cut by :func:`cembed.model.maxsim.fused_tiles` (queries x the
  longest of them within ``loss.score_query_tokens``; whole documents within ``score_document_rows`` and
  ``score_document_tokens``), and its backward runs block by block. It computes the dot products in half
  precision with fp32 accumulation (fp16 for fp32 inputs, the precision of a TF32 matmul), so it agrees with
  the tiled path to that precision, not bit for bit. sentence-transformers' own kernel (its
  ``late-interaction-kernels`` hub repository, through the ``kernels`` package) loads from the hub at run
  time and is not used; flash-maxsim has no varlen training entry point.
* the check (:func:`check_agreement`, once, on the first batch's first :data:`CHECK_QUERIES` queries
  against their positives and the first :data:`CHECK_DOCUMENTS` documents, so it costs little time and
  memory whatever the batch): the loss within :data:`LOSS_TOLERANCE` relative and the gradient of every
  cached token vector within :data:`GRADIENT_TOLERANCE` relative L2 of the tiled path's; else the run keeps
  the tiled path and says why in one line.

``loss.score_kernel: tiled`` keeps the tiled path on CUDA too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cembed.model.maxsim import RaggedTokens, Tiles, maxsim_infonce

PACKAGE = "late-interaction-kernels"
CHECK_QUERIES = 256  # queries of the first batch the check scores
CHECK_DOCUMENTS = 2048  # documents it scores them against (besides their positives)
LOSS_TOLERANCE = 1e-3  # relative: a half-precision dot product with fp32 accumulation
GRADIENT_TOLERANCE = 2e-2  # relative L2 over the query and document token gradients


@dataclass(frozen=True)
class FusedMaxSim:
    """A fused MaxSim kernel.

    Attributes:
        name: what it is, for the run's note and summary (package, version, function).
        scores: ``(q (Tq, D), d (Td, D), q_cu (nq + 1,) int32, d_cu (nd + 1,) int32, max_q, max_d) -> (nq, nd)``:
            each (query, document) pair's sum over the query's tokens of the largest dot product with a
            document token (0 for a document or a query without tokens), differentiable with respect to
            ``q`` and ``d``; ``q_cu`` / ``d_cu`` the row offsets on the device, ``max_q`` / ``max_d`` the
            longest row (host ints).
    """

    name: str
    scores: Callable[..., torch.Tensor]


def find_fused_maxsim(device: torch.device | str) -> tuple[FusedMaxSim | None, str]:
    """The fused kernel for ``device``, or None and why not: not CUDA (nothing to say: ``""``), or the
    package does not import (its install command)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, ""
    try:
        import late_interaction_kernels
        import triton  # noqa: F401 - the kernel's compiler; without it the package's functions raise
        from late_interaction_kernels.varlen import maxsim_varlen
    except Exception as err:  # noqa: BLE001 - any failure to import means: no kernel
        first = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
        return None, f"{PACKAGE} is not importable ({first}); pip install {PACKAGE} for the fused kernel"

    def scores(q, d, q_cu, d_cu, max_q, max_d):
        return maxsim_varlen(q, d, q_cu, d_cu, max_q, max_d)

    version = getattr(late_interaction_kernels, "__version__", "?")
    return FusedMaxSim(f"{PACKAGE} {version} maxsim_varlen", scores), ""


@dataclass(frozen=True)
class Agreement:
    """The fused kernel against the tiled path on the same batch: ``loss_rel`` (relative difference of
    the losses), ``gradient_rel`` (relative L2 difference of the token gradients, queries and documents
    together), ``ok`` (both within tolerance, and finite)."""

    ok: bool
    loss_rel: float
    gradient_rel: float

    def describe(self) -> str:
        return (
            f"loss {self.loss_rel:.1e} relative (tolerance {LOSS_TOLERANCE:.0e}), token gradients "
            f"{self.gradient_rel:.1e} relative L2 (tolerance {GRADIENT_TOLERANCE:.0e})"
        )


def check_batch(
    queries: RaggedTokens, documents: RaggedTokens, labels: torch.Tensor, n_queries: int, n_documents: int
) -> tuple[RaggedTokens, RaggedTokens, torch.Tensor]:
    """The part of a batch the check scores: the first ``n_queries`` queries, and the first ``n_documents``
    documents with those queries' positives (in document order), the labels pointing into them."""
    n = min(n_queries, queries.rows)
    head = RaggedTokens(queries.values[: queries.offsets[n]], queries.offsets[: n + 1])
    labels = labels[:n]
    keep = sorted(set(range(min(n_documents, documents.rows))) | set(labels.tolist()))
    where = {row: i for i, row in enumerate(keep)}
    off = documents.offsets
    values = torch.cat([documents.values[off[j] : off[j + 1]] for j in keep]) if keep else documents.values[:0]
    picked = RaggedTokens.from_lengths(values, [off[j + 1] - off[j] for j in keep])
    return head, picked, torch.tensor([where[j] for j in labels.tolist()], device=labels.device, dtype=labels.dtype)


def _loss_and_gradients(queries, documents, labels, kernel, **options) -> tuple[torch.Tensor, torch.Tensor]:
    q = queries.values.detach().requires_grad_()  # new leaves over the same storage: no copy
    d = documents.values.detach().requires_grad_()
    with torch.enable_grad():
        loss = maxsim_infonce(
            RaggedTokens(q, queries.offsets), RaggedTokens(d, documents.offsets), labels, kernel=kernel, **options
        )
        gq, gd = torch.autograd.grad(loss, (q, d))
    return loss.detach().double(), torch.cat([gq.flatten(), gd.flatten()]).double()


def check_agreement(
    kernel: FusedMaxSim,
    queries: RaggedTokens,
    documents: RaggedTokens,
    labels: torch.Tensor,
    scale: float = 1.0,
    length_normalize: bool = False,
    tiles: Tiles = Tiles(),
    check_queries: int = CHECK_QUERIES,
    check_documents: int = CHECK_DOCUMENTS,
) -> Agreement:
    """InfoNCE (:func:`cembed.model.maxsim.maxsim_infonce`) of the first ``check_queries`` queries against
    their positives and the first ``check_documents`` documents (:func:`check_batch`), by the tiled path
    and by ``kernel``: the loss and the gradients of every query and document token vector compared (see
    :class:`Agreement`). Changes nothing: the inputs' own gradients are not touched.
    """
    queries, documents, labels = check_batch(queries, documents, labels, check_queries, check_documents)
    options = dict(scale=scale, length_normalize=length_normalize, tiles=tiles)
    loss_ref, grad_ref = _loss_and_gradients(queries, documents, labels, None, **options)
    loss, grad = _loss_and_gradients(queries, documents, labels, kernel, **options)
    loss_rel = float((loss - loss_ref).abs() / loss_ref.abs().clamp_min(1e-30))
    gradient_rel = float((grad - grad_ref).norm() / grad_ref.norm().clamp_min(1e-30))
    finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad).all())
    ok = finite and loss_rel <= LOSS_TOLERANCE and gradient_rel <= GRADIENT_TOLERANCE
    return Agreement(ok, loss_rel if finite else float("nan"), gradient_rel if finite else float("nan"))


@dataclass(frozen=True)
class ScoringChoice:
    """How a cached MaxSim loss scores: ``kernel`` (None: the tiled torch path), ``path`` (in words, for
    the run summary) and ``note`` (the one line a run shows about it, or None where there is nothing to
    say: a CPU run, ``loss.score_kernel: tiled``)."""

    kernel: FusedMaxSim | None
    path: str
    note: str | None = None


TILED = "tiled (torch)"


def choose_scoring(
    setting: str,
    queries: RaggedTokens,
    documents: RaggedTokens,
    labels: torch.Tensor,
    find: Callable[[torch.device], tuple[FusedMaxSim | None, str]] = find_fused_maxsim,
    **options,
) -> ScoringChoice:
    """Pick the scoring path for a run from its first batch.

    Args:
        setting: ``loss.score_kernel``: ``auto`` (the fused kernel where :func:`find_fused_maxsim` finds
            one and it agrees, :func:`check_agreement`) or ``tiled`` (always the tiled path).
        queries, documents, labels: the first batch's cache, as the loss scores it.
        find: where the kernel comes from (tests pass a fake one).
        **options: ``scale``, ``length_normalize``, ``tiles`` of the loss.
    """
    if setting == "tiled":
        return ScoringChoice(None, TILED)
    kernel, why = find(queries.values.device)
    if kernel is None:
        return ScoringChoice(None, TILED, f"MaxSim: the tiled path; {why}" if why else None)
    agreement = check_agreement(kernel, queries, documents, labels, **options)
    if not agreement.ok:
        return ScoringChoice(
            None,
            TILED,
            f"MaxSim: the tiled path; {kernel.name} differs from it on the first batch: {agreement.describe()}",
        )
    return ScoringChoice(
        kernel,
        f"fused: {kernel.name}",
        f"MaxSim: fused kernel {kernel.name}; agrees with the tiled path on the first batch: {agreement.describe()}",
    )
