"""The ``loss`` config section: the base class every loss config extends, and the registry by name."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator

from cembed.config.base import Strict as _Strict
from cembed.config.base import register_by_literal, registered

DEFAULT_LOSS = "cached_mnrl"

# CachedMultipleNegativesRankingLoss's similarity terms (sentence-transformers 6.2).
Direction = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]


class MatryoshkaConfig(_Strict):
    """``matryoshka``: also train truncated embeddings (Matryoshka Representation Learning,
    Kusupati et al. 2022, arXiv:2205.13147) through sentence-transformers' ``MatryoshkaLoss``: the
    loss is the weighted sum of the wrapped loss on the first ``d`` dimensions (re-normalized) for
    every ``d`` in ``dims``."""

    dims: list[PositiveInt] = Field(min_length=1)
    weights: list[PositiveFloat] | None = None  # one per dim; default 1 each

    @model_validator(mode="after")
    def _consistent(self) -> MatryoshkaConfig:
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"dims {self.dims} repeats a dimension; list each once")
        if self.weights is not None and len(self.weights) != len(self.dims):
            raise ValueError(
                f"weights has {len(self.weights)} values for {len(self.dims)} dims; give one weight "
                "per dim or leave weights out (1 each)"
            )
        return self


def matryoshka_dims_problem(dims: list[int], size: int | None) -> str | None:
    """Why ``loss.matryoshka.dims`` cannot train a model whose embeddings have ``size`` dimensions (a
    dim above it: truncating to it would keep the whole embedding); None when they fit or ``size`` is
    unknown. The one line ``validate`` and ``train`` say after ``loss.matryoshka.dims: ``."""
    if size is None or max(dims) <= size:
        return None
    return f"{list(dims)}: the model's embeddings have {size} dimensions; use dims up to {size}"


class FalseNegativeFilter(_Strict):
    """``false_negative_filter``: self-guided false-negative filtering. An in-batch candidate
    that the model itself (its no-grad embeddings of the step) scores above the anchor's positive
    minus a margin is left out of the anchor's softmax (positive-aware filtering, NV-Retriever,
    Moreira et al. 2024, arXiv:2407.15831; the masking rule of GISTEmbed, Solatorio 2024,
    arXiv:2402.16829, with the model as its own guide).

    ``absolute``: masked when ``s(a, c) > s(a, p) - margin``; ``relative``: when
    ``s(a, c) > s(a, p) - |s(a, p)| * margin`` (cosine scores).
    """

    margin: NonNegativeFloat = 0.0
    strategy: Literal["absolute", "relative"] = "absolute"


class LossConfig(_Strict):
    """The ``loss`` section: the fields every loss has, plus ``name``, which picks the concrete class.

    Each loss is a subclass with ``name: Literal["<name>"] = "<name>"``, its own fields, and the
    ``uses_gradient_cache`` capability (True: the loss embeds in mini-batches of
    ``batch.mini_batch_size`` rows, GradCache style, so the probe can measure it) and ``consumes``, what
    a text must become for it to train (:attr:`cembed.config.model.ModelConfig.output`: ``vector`` by
    default, the dense kind's; a config whose ``model.kind`` makes something else is refused). Subclasses are
    registered by name in :data:`LOSS_CONFIGS` (:func:`register_loss_config`, or
    ``cembed.losses.registry.register_loss`` with its builder); :func:`loss_config` builds the registered
    class for a ``name``.
    """

    uses_gradient_cache: ClassVar[bool] = False
    # Fields naming a model the loss loads besides the one trained (a guide): validate checks each loads.
    model_paths: ClassVar[tuple[str, ...]] = ()
    # Those of them whose model must be a transformer with a transformers tokenizer (GIST's guide, whose
    # vocabulary sentence-transformers compares with the trained model's): validate checks its modules.
    transformer_paths: ClassVar[tuple[str, ...]] = ()
    consumes: ClassVar[frozenset[str]] = frozenset({"vector"})

    name: str = DEFAULT_LOSS
    scale: PositiveFloat = 20.0
    symmetric: bool = False
    # Gather every rank's embeddings so each anchor is contrasted with the whole global batch.
    # None: true when training runs in more than one process.
    gather_across_devices: bool | None = None
    matryoshka: MatryoshkaConfig | None = None  # also train truncated embeddings (any loss)

    def describe(self) -> str | None:
        """What ``validate`` adds to its loss line about how this loss trains (a few words), or None."""
        return None

    def scoring_memory(self, longest_query: int, queries: int) -> tuple[int, str] | None:
        """The most bytes the loss's scoring holds at once, whatever the batch, for ``queries`` query rows of
        at most ``longest_query`` tokens (besides the cached embeddings and their gradients), and how it
        is bounded; None: the loss states no bound (a dense loss's ``(rows, candidates)`` score matrix
        grows with the batch)."""
        return None


class MNRLOptionsConfig(LossConfig):
    """The options of sentence-transformers' (Cached)MultipleNegativesRankingLoss, shared by
    ``cached_mnrl`` and ``mnrl`` (not a loss by itself).

    * ``directions``: the similarity terms in each row's softmax: ``query_to_doc`` (InfoNCE, always
      needed), ``doc_to_query`` (symmetric), ``query_to_query`` and ``doc_to_doc`` (GTE's improved
      contrastive loss, Li et al. 2023, arXiv:2308.03281). Unset: from ``symmetric``.
    * ``partition_mode``: ``joint`` (one softmax over all terms) or ``per_direction`` (one per
      direction, averaged; needs every direction to hold the positive, so not with
      ``query_to_query``/``doc_to_doc``).
    * ``hardness_mode`` / ``hardness_strength``: add ``strength * stop_grad(cos)`` to negative logits
      (Lan et al. 2025, arXiv:2503.04812; EmbeddingGemma, arXiv:2509.20354): ``in_batch_negatives``,
      ``hard_negatives`` or ``all_negatives``.

    Raises (at validation, naming the fields): conflicting settings, e.g. ``symmetric: true`` with
    ``directions`` lacking ``doc_to_query``, or a hardness mode without a strength.
    """

    directions: tuple[Direction, ...] | None = None
    partition_mode: Literal["joint", "per_direction"] = "joint"
    hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None
    hardness_strength: NonNegativeFloat = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> MNRLOptionsConfig:
        d = self.directions
        if d is not None:
            if not d or "query_to_doc" not in d:
                raise ValueError(f"directions {list(d)} must include query_to_doc (it holds the positive pair)")
            if len(set(d)) != len(d):
                raise ValueError(f"directions {list(d)} repeats a direction; list each once")
            if "symmetric" in self.model_fields_set and self.symmetric != ("doc_to_query" in d):
                fix = "add doc_to_query to directions" if self.symmetric else "remove doc_to_query"
                raise ValueError(
                    f"symmetric: {str(self.symmetric).lower()} conflicts with directions {list(d)}: "
                    f"drop symmetric (directions say it all) or {fix}"
                )
            # Normalized, so that a dumped and reloaded config says the same.
            self.__dict__["symmetric"] = "doc_to_query" in d
        dirs = self.resolved_directions()
        if self.partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(dirs):
            raise ValueError(
                f"partition_mode: per_direction needs the positive in every direction's softmax, but "
                f"directions {list(dirs)} has query_to_query/doc_to_doc: use partition_mode joint"
            )
        if self.hardness_mode is not None and self.hardness_strength == 0.0:
            raise ValueError(
                f"hardness_mode: {self.hardness_mode} has no effect with hardness_strength 0: "
                "set a strength (e.g. 5 or 9) or drop hardness_mode"
            )
        if self.hardness_mode is None and self.hardness_strength > 0.0:
            raise ValueError(
                f"hardness_strength {self.hardness_strength:g} is ignored without hardness_mode: set "
                "hardness_mode (in_batch_negatives, hard_negatives or all_negatives) or drop hardness_strength"
            )
        return self

    def resolved_directions(self) -> tuple[str, ...]:
        """``directions`` if set, else ``query_to_doc`` plus ``doc_to_query`` when ``symmetric``."""
        if self.directions is not None:
            return tuple(self.directions)
        return ("query_to_doc", "doc_to_query") if self.symmetric else ("query_to_doc",)


class CachedGISTLossConfig(LossConfig):
    """``cached_gist``: GISTEmbed (Solatorio 2024, arXiv:2402.16829) with GradCache, through
    sentence-transformers' ``CachedGISTEmbedLoss``: a frozen ``guide`` model scores every in-batch
    candidate, and a candidate the guide scores above the anchor's positive (minus ``margin``) is left
    out of the softmax. ``guide`` is any model cembed loads (a folder, a hub id, a packaged short name
    such as all-MiniLM-L6-v2) whose first module is a transformer (a StaticEmbedding model has no
    transformers tokenizer, which the library needs); with a different tokenizer the texts are
    re-tokenized for it.

    ``temperature``: the softmax temperature (default 0.01, the library's and the paper's); giving
    ``scale`` instead means ``temperature = 1 / scale`` (both are stored, resolved). ``contrast_anchors`` / ``contrast_positives``
    add the anchor-anchor / positive-positive terms of the paper (library default on).
    """

    uses_gradient_cache: ClassVar[bool] = True
    model_paths: ClassVar[tuple[str, ...]] = ("guide",)
    transformer_paths: ClassVar[tuple[str, ...]] = ("guide",)

    name: Literal["cached_gist"] = "cached_gist"
    guide: str
    guide_max_seq_length: PositiveInt | None = None  # tokens for the guide; default its own
    margin_strategy: Literal["absolute", "relative"] = "absolute"
    margin: float = 0.0
    temperature: PositiveFloat | None = None
    contrast_anchors: bool = True
    contrast_positives: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> CachedGISTLossConfig:
        if self.symmetric:
            raise ValueError("symmetric is not an option of cached_gist: use contrast_anchors / contrast_positives")
        scale_set = "scale" in self.model_fields_set
        if self.temperature is not None and scale_set and abs(self.temperature * self.scale - 1) > 1e-9:
            raise ValueError(
                f"temperature ({self.temperature:g}) and scale ({self.scale:g}) are both set and disagree; "
                "temperature = 1 / scale: keep one"
            )
        # Resolved once, both stored: a dumped and reloaded config says the same.
        temperature = self.temperature or (1.0 / self.scale if scale_set else 0.01)
        self.__dict__["temperature"] = temperature
        self.__dict__["scale"] = 1.0 / temperature
        return self


class CachedMNRLLossConfig(MNRLOptionsConfig):
    """``cached_mnrl``: in-batch negatives InfoNCE with GradCache (memory set by ``mini_batch_size``)."""

    uses_gradient_cache: ClassVar[bool] = True

    name: Literal["cached_mnrl"] = "cached_mnrl"
    # Self-guided filtering from the no-grad pass's embeddings (so only with the cached loss).
    false_negative_filter: FalseNegativeFilter | None = None

    @model_validator(mode="after")
    def _filter_directions(self) -> CachedMNRLLossConfig:
        dirs = self.resolved_directions()
        if self.false_negative_filter is not None and (dirs != ("query_to_doc",) or self.hardness_mode):
            raise ValueError(
                "false_negative_filter works with directions [query_to_doc] only and no hardness_mode "
                f"(got directions {list(dirs)}, hardness_mode {self.hardness_mode}): drop one of them"
            )
        return self


class MNRLLossConfig(MNRLOptionsConfig):
    """``mnrl``: plain in-batch negatives InfoNCE, the whole batch embedded at once."""

    name: Literal["mnrl"] = "mnrl"


def maxsim_scoring_bytes(
    query_tokens: int, document_tokens: int, document_rows: int, longest_query: int, queries: int
) -> int:
    """The scoring memory bound of tiled MaxSim (:mod:`cembed.model.maxsim`), in bytes:
    ``4 x (3 Sq Td + 5 Sq Rd) + 32 x queries`` with ``Sq = max(query_tokens, longest_query)`` (a query
    tile holds whole queries), ``Td = document_tokens``, ``Rd = document_rows``: a tile's similarities, one
    gathered copy of a per-(query token, document) array and their product; the running max per (query
    token, document), its gradient, the hits found so far and in the tile, and the scores; four numbers
    per query (the largest logit, the log-sum, the label, the row offset). Pure arithmetic."""
    sq = max(query_tokens, longest_query)
    return 4 * (3 * sq * document_tokens + 5 * sq * document_rows) + 32 * queries


class CachedMaxSimLossConfig(LossConfig):
    """``cached_maxsim``: in-batch negatives InfoNCE over MaxSim scores for a multi-vector model
    (``model.kind: multi_vector``), with GradCache: sentence-transformers'
    ``CachedMultiVectorMultipleNegativesRankingLoss`` (same loss and gradients), its token vectors cached
    ragged (no padding) and MaxSim computed in tiles of at most `score_query_tokens` query tokens by
    `score_document_tokens` document tokens (`score_document_rows` documents at a time), so the scoring
    memory is bounded by the tiles, not the batch (:mod:`cembed.model.maxsim`). The tiles change memory
    and speed only, never the result. `scale`: ``1 / temperature``; MaxSim sums over query tokens, so
    the library's default is 1, not the cosine losses' 20. `score_kernel`: ``auto`` scores with a fused
    CUDA kernel (the ``late-interaction-kernels`` package) where it imports and agrees with the tiled path
    on the run's first batch, else with the tiled torch path; ``tiled`` always with the tiled path
    (:mod:`cembed.model.maxsim_kernel`)."""

    uses_gradient_cache: ClassVar[bool] = True
    consumes: ClassVar[frozenset[str]] = frozenset({"token_vectors"})

    name: Literal["cached_maxsim"] = "cached_maxsim"
    scale: PositiveFloat = 1.0
    score_query_tokens: PositiveInt = 1024
    score_document_tokens: PositiveInt = 8192
    score_document_rows: PositiveInt = 1024
    score_kernel: Literal["auto", "tiled"] = "auto"

    def scoring_memory(self, longest_query: int, queries: int) -> tuple[int, str]:
        """:func:`maxsim_scoring_bytes` of the tiles, and the tiles in words."""
        bound = maxsim_scoring_bytes(
            self.score_query_tokens, self.score_document_tokens, self.score_document_rows, longest_query, queries
        )
        return bound, (
            f"MaxSim in tiles of {self.score_query_tokens} query x {self.score_document_tokens} document tokens, "
            f"{self.score_document_rows} documents at a time"
        )

    @model_validator(mode="after")
    def _maxsim_options(self) -> CachedMaxSimLossConfig:
        if self.symmetric:
            raise ValueError("symmetric is not an option of cached_maxsim (queries and documents are encoded apart)")
        if self.matryoshka is not None:
            raise ValueError(
                "matryoshka is not an option of cached_maxsim (a multi-vector model's tokens keep their size)"
            )
        return self


class CachedSpladeLossConfig(MNRLOptionsConfig):
    """``cached_splade``: SPLADE's training loss for a sparse model (``model.kind: sparse``) with GradCache:
    sentence-transformers' ``CachedSpladeLoss`` around ``SparseMultipleNegativesRankingLoss`` (InfoNCE on
    dot products at ``scale``, default 1 as the library's; ``directions`` / ``partition_mode`` as
    ``cached_mnrl``) plus the FLOPS regularizer (Paria et al. 2020, arXiv:2004.05665) on the documents
    (``document_regularizer_weight``, lambda_d) and, with ``query_regularizer_weight`` (lambda_q), the queries;
    a ``*_threshold`` leaves rows with at most that many active dimensions out of it (arXiv:2504.14839).
    The weights ramp up from 0 over the first ``regularizer_warmup_ratio`` of the steps
    (``regularizer_schedule``, sentence-transformers' ``SpladeRegularizerWeightSchedulerCallback``).

    cembed's form (:class:`cembed.losses.cached_splade.SparseCachedSpladeLoss`): the cache keeps each row's
    active coordinates only (exact), the score matrix is computed ``mini_batch_size`` anchors at a time, and
    the FLOPS term is taken over the global batch (the same sparsity whatever the process count).
    ``cache_form``: ``auto`` (sparse where it takes fewer bytes, per mini-batch), ``sparse`` or ``dense``."""

    uses_gradient_cache: ClassVar[bool] = True
    consumes: ClassVar[frozenset[str]] = frozenset({"sparse_vector"})

    name: Literal["cached_splade"] = "cached_splade"
    scale: PositiveFloat = 1.0
    document_regularizer_weight: NonNegativeFloat = 3e-5
    query_regularizer_weight: NonNegativeFloat | None = 5e-5
    document_regularizer_threshold: PositiveInt | None = None
    query_regularizer_threshold: PositiveInt | None = None
    use_document_regularizer_only: bool = False
    regularizer_warmup_ratio: float = Field(1 / 3, gt=0.0, le=1.0)
    regularizer_schedule: Literal["quadratic", "linear"] = "quadratic"
    cache_form: Literal["auto", "sparse", "dense"] = "auto"

    def describe(self) -> str:
        """The cache form, and the FLOPS regularizers' weights and warm-up."""
        form = {
            "auto": "each row's active coordinates (a mini-batch too dense for that kept dense)",
            "sparse": "each row's active coordinates",
            "dense": "dense rows",
        }[self.cache_form]
        weights = {"documents": self.document_regularizer_weight}
        if self.query_regularizer_weight is not None and not self.use_document_regularizer_only:
            weights["queries"] = self.query_regularizer_weight
        if not any(weights.values()):
            return f"cache of {form}; no FLOPS regularizer (its weights are 0)"
        shown = ", ".join(f"{k} {v:g}" for k, v in weights.items())
        return (
            f"cache of {form}; FLOPS over the global batch ({shown}), weights ramped from 0 over the first "
            f"{self.regularizer_warmup_ratio:.0%} of the steps ({self.regularizer_schedule})"
        )

    @model_validator(mode="after")
    def _splade_options(self) -> CachedSpladeLossConfig:
        if self.hardness_mode is not None:
            raise ValueError("hardness_mode is not an option of cached_splade")
        if self.matryoshka is not None:
            raise ValueError("matryoshka is not an option of cached_splade (a sparse vector is not truncated)")
        if self.query_regularizer_threshold is not None and self.query_regularizer_weight is None:
            raise ValueError("query_regularizer_threshold needs query_regularizer_weight (queries are not regularized)")
        return self


# name -> LossConfig subclass; `loss.name` in a config picks one.
LOSS_CONFIGS: dict[str, type[LossConfig]] = {}


def register_loss_config(cls: type[LossConfig]) -> type[LossConfig]:
    """Register a :class:`LossConfig` subclass under its ``name`` default (usable as a decorator).

    Raises:
        TypeError: ``cls`` is not a LossConfig subclass with a one-value ``Literal`` name.
        ValueError: the name is already registered to another class.
    """
    return register_by_literal(LOSS_CONFIGS, cls, LossConfig, "name", "loss")


def loss_config_class(name: Any) -> type[LossConfig]:
    """The registered :class:`LossConfig` subclass for ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    return registered(LOSS_CONFIGS, name, "loss")


def loss_config(**fields: Any) -> LossConfig:
    """The registered loss config for ``fields["name"]`` (default ``cached_mnrl``), validated.

    Raises:
        ValueError: unknown name (listing the known ones); pydantic's ValidationError for bad fields.
    """
    return loss_config_class(fields.get("name", DEFAULT_LOSS)).model_validate(fields)


register_loss_config(CachedMNRLLossConfig)
register_loss_config(MNRLLossConfig)
register_loss_config(CachedGISTLossConfig)
register_loss_config(CachedMaxSimLossConfig)
register_loss_config(CachedSpladeLossConfig)
