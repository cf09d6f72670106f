"""The ``model`` config section and the model kinds' registry by name (``model.kind``).

A model kind is what a text becomes and everything that follows from it: one vector (``dense``, the
default), one vector per token (``multi_vector``, late interaction), ... Its config half lives here: a
:class:`ModelConfig` subclass with ``kind: Literal["<kind>"] = "<kind>"``, its own fields and the
class-level declarations every layer above reads instead of asking which kind it is:

* ``output``: what one text becomes, the contract with a loss (``LossConfig.consumes``):
  ``vector`` (one ``(dim,)`` vector), ``token_vectors`` (a ragged set of ``(dim,)`` vectors, one per
  scored token), ``sparse_vector`` (one vocabulary-wide vector);
* ``similarity``: how retrieval scores a query and a document (``cosine``, ``maxsim``): the evaluator
  used and the metric keys (``<set>_<similarity>_ndcg@10``);
* ``default_loss``: the ``loss.name`` a config that names none trains with;
* ``model_types``: the sentence-transformers model types (``config_sentence_transformers.json``
  ``model_type``) of the saved folders it trains, its own first (a folder of a type no kind of the
  config lists is refused naming the type, never loaded as another kind);
* ``not_options``: ``{"section.field": why}``, fields of any section it does not take: a config that
  sets one is refused in one line naming the field and the kind (:meth:`ModelConfig.conflicts`).

The model layer's half (loading, what the forward returns, packing, scoring, the trainer's and the
card's classes) is :mod:`cembed.model.kinds`; a kind registers both halves with
``cembed.model.kinds.registry.register_model_kind`` (a plugin too), or only this one with
:func:`register_model_config`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from cembed.config.base import Strict as _Strict
from cembed.config.base import register_by_literal, registered

DEFAULT_KIND = "dense"
# What one text becomes (ModelConfig.output), the names a loss's `consumes` uses, and how messages say it.
OUTPUT_WORDS = {
    "vector": "one vector per text",
    "token_vectors": "one vector per token",
    "sparse_vector": "one vocabulary-wide sparse vector per text",
}
OUTPUTS = tuple(OUTPUT_WORDS)


class LoraOptions(_Strict):
    """``model.lora``: train LoRA adapters instead of every weight (Hu et al. 2021, arXiv:2106.09685),
    through ``peft`` (``pip install 'cembed[lora]'``)."""

    r: PositiveInt = Field(16, description="adapter rank")
    alpha: PositiveFloat = Field(32.0, description="scaling numerator: the update is (alpha / r) * B @ A")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="dropout on the adapter's input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, v_proj]) or all-linear"
    )
    merge: bool = Field(
        True, description="save the final model with the adapters merged into the weights (false: adapter only)"
    )


class ModelConfig(_Strict):
    """Which model to fine-tune and how to run it: the fields every kind has, plus `kind`, which
    picks the concrete class (the dense kind's declarations are the defaults here)."""

    output: ClassVar[str] = "vector"
    similarity: ClassVar[str] = "cosine"
    default_loss: ClassVar[str] = "cached_mnrl"
    model_types: ClassVar[tuple[str, ...]] = ("SentenceTransformer",)
    not_options: ClassVar[dict[str, str]] = {}

    kind: str = Field(
        DEFAULT_KIND,
        description="what a text becomes: dense (one vector), multi_vector (one vector per token, late interaction) "
        "or a kind a plugin registers",
    )
    name_or_path: str = "all-MiniLM-L6-v2"  # a local folder, a hub id, or a packaged short name
    max_seq_length: PositiveInt | None = None  # tokens per text; longer texts are truncated (None: the model's)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when a GPU is visible, else cpu
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="compute dtype: bf16/fp16 autocast over fp32 master weights (whatever the stored dtype); "
        "auto: bf16 on a GPU with bf16, fp32 on CPU (cembed.plan.precision)",
    )
    save_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="dtype of the saved model's weights; unset: the training dtype (fp32 master weights)"
    )
    trust_remote_code: bool = Field(False, description="run the model's own code (config.json auto_map); never implied")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) to pin")
    model_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="passed to the transformers model, e.g. attn_implementation, torch_dtype"
    )
    tokenizer_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to the tokenizer")
    pooling: Literal["mean", "cls", "lasttoken"] = Field(
        "mean",
        description="pooling for a plain transformers checkpoint (no modules.json); ignored otherwise (dense kind only)",
    )
    lora: LoraOptions | None = Field(None, description="train LoRA adapters only (needs peft)")
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory per mini-batch, more compute"
    )

    def query_tokens(self, max_seq_length: int) -> int:
        """The most tokens a query (the first column) is given, under ``max_seq_length``."""
        return max_seq_length

    def length_fields(self) -> dict[str, int]:
        """The token lengths this config sets besides ``max_seq_length`` (``{dotted field: tokens}``): each
        must fit the model's position table as ``max_seq_length`` must (``cembed validate`` checks both).
        None here; a kind with lengths of its own overrides it."""
        return {}

    def conflicts(self, config: Any) -> list[tuple[str, str]]:
        """The options of ``config`` (a :class:`cembed.config.schema.CembedConfig`) that this kind does
        not take: ``[(dotted field, why)]``, from :attr:`not_options`. A field counts when the config
        sets it to a value other than its default (so a dumped and reloaded config, which sets every
        field to what it was, is not refused). A kind with other rules overrides this and extends the list.
        """
        out = []
        for dotted, why in type(self).not_options.items():
            section, _, name = dotted.partition(".")
            part = getattr(config, section, None)
            info = getattr(type(part), "model_fields", {}).get(name)
            if info is None or name not in part.model_fields_set:
                continue
            if getattr(part, name) != info.get_default(call_default_factory=True):
                out.append((dotted, f"not an option of model.kind {self.kind}: {why}"))
        return out


class DenseModelConfig(ModelConfig):
    """``model.kind: dense`` (the default): one vector per text, a sentence-transformers
    ``SentenceTransformer`` (a plain transformers checkpoint gets ``Transformer + Pooling(model.pooling)``)."""

    kind: Literal["dense"] = "dense"


# kind -> ModelConfig subclass; `model.kind` in a config picks one.
MODEL_CONFIGS: dict[str, type[ModelConfig]] = {}


def register_model_config(cls: type[ModelConfig]) -> type[ModelConfig]:
    """Register a :class:`ModelConfig` subclass under its ``kind`` default (usable as a decorator).

    Raises:
        TypeError: ``cls`` is not a ModelConfig subclass with a one-value ``Literal`` kind, or its
            ``output`` is not one of :data:`OUTPUTS`.
        ValueError: the kind is already registered to another class.
    """
    if isinstance(cls, type) and issubclass(cls, ModelConfig) and cls.output not in OUTPUTS:
        raise TypeError(f"{cls.__name__}.output {cls.output!r}: declare one of {', '.join(OUTPUTS)}")
    return register_by_literal(MODEL_CONFIGS, cls, ModelConfig, "kind", "model kind")


def model_config_class(kind: Any) -> type[ModelConfig]:
    """The registered :class:`ModelConfig` subclass for ``kind``.

    Raises:
        ValueError: an unknown kind; the message lists the known ones.
    """
    return registered(MODEL_CONFIGS, kind, "model kind")


def model_config(**fields: Any) -> ModelConfig:
    """The registered model config for ``fields["kind"]`` (default ``dense``), validated: a dumped
    ``model`` section read back as the class it was.

    Raises:
        ValueError: unknown kind (listing the known ones); pydantic's ValidationError for bad fields.
    """
    return model_config_class(fields.get("kind", DEFAULT_KIND)).model_validate(fields)


class MultiVectorModelConfig(ModelConfig):
    """``model.kind: multi_vector``: one vector per token, scored by MaxSim (late interaction, ColBERT:
    Khattab & Zaharia 2020, arXiv:2004.12832), a sentence-transformers ``MultiVectorEncoder``. A
    ``MultiVectorEncoder`` folder (also PyLate's and Stanford ColBERT's) is loaded as it is; any other
    encoder or dense ``SentenceTransformer`` is turned into one as sentence-transformers 6.3 does
    (pooling and sentence-level normalisation dropped, a dense model's ``Dense`` head kept at token level,
    else a new bias-free projection to `dim`; a ``MultiVectorMask``; token L2-normalisation). Query and
    document markers (e.g. ``[Q] ``, ``[D] ``) are the `query` / `document` prompts (`data.prompts`)."""

    output: ClassVar[str] = "token_vectors"
    similarity: ClassVar[str] = "maxsim"
    default_loss: ClassVar[str] = "cached_maxsim"
    model_types: ClassVar[tuple[str, ...]] = ("MultiVectorEncoder", "SentenceTransformer")
    not_options: ClassVar[dict[str, str]] = {
        "model.pooling": "a multi-vector model keeps one vector per token (no pooling)",
        "eval.sts": "STS scores one vector per text; evaluate a multi-vector model by retrieval (eval.retrieval)",
    }

    kind: Literal["multi_vector"] = "multi_vector"
    dim: PositiveInt | None = Field(
        None,
        description="size of a token vector when cembed makes the projection (unset: 128, as sentence-transformers); "
        "a model with its own projection must match it",
    )
    query_length: PositiveInt | None = Field(
        None, description="tokens per query (unset: the model's, else max_seq_length)"
    )
    document_length: PositiveInt | None = Field(
        None, description="tokens per document (unset: the model's, else max_seq_length)"
    )
    query_expansion: PositiveInt | None = Field(
        None,
        description="pad each query with [MASK] tokens to this many tokens, scored but not attended to (ColBERT's "
        "query augmentation); unset: the model's own setting",
    )
    skiplist: Literal["punctuation"] | list[str] | None = Field(
        None, description="document tokens left out of MaxSim (punctuation: string.punctuation); unset: the model's"
    )

    def conflicts(self, config: Any) -> list[tuple[str, str]]:
        """:meth:`ModelConfig.conflicts`, and a streamed source: a stream is tokenized batch by batch
        with one length and no task, not per column as a multi-vector model tokenizes its queries and
        documents."""
        out = super().conflicts(config)
        for item in config.data.sources():
            if item.source.stream_options() is not None:
                out.append(
                    (
                        f"{item.key}.streaming",
                        "not an option of model.kind multi_vector: a stream is tokenized without the query / "
                        "document tasks; train from the files (or a prepared folder: cembed prepare-data)",
                    )
                )
        return out

    def query_tokens(self, max_seq_length: int) -> int:
        """``query_expansion`` (an expanded query's exact width), else ``query_length``, else ``max_seq_length``."""
        return self.query_expansion or self.query_length or max_seq_length

    def length_fields(self) -> dict[str, int]:
        """``query_length``, ``document_length`` and ``query_expansion``, where set."""
        names = ("query_length", "document_length", "query_expansion")
        return {f"model.{n}": getattr(self, n) for n in names if getattr(self, n) is not None}

    @model_validator(mode="after")
    def _expansion_fits(self) -> MultiVectorModelConfig:
        if (
            self.query_expansion is not None
            and self.query_length is not None
            and self.query_length < self.query_expansion
        ):
            raise ValueError(
                f"query_length ({self.query_length}) is smaller than query_expansion ({self.query_expansion}): an expanded "
                "query is exactly query_expansion tokens long; drop query_length or raise it to query_expansion"
            )
        return self


register_model_config(DenseModelConfig)
register_model_config(MultiVectorModelConfig)
