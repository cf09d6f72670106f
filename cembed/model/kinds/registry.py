"""The seam a model kind plugs into: :class:`ModelKind` (what the rest of cembed asks a kind) and
:func:`register_model_kind`.

The contract. A kind is two halves registered under one name, and nothing else in cembed names it:

* its config class (:class:`cembed.config.model.ModelConfig` subclass with ``kind: Literal[...]``)
  declaring what a text becomes (``output``), its default loss, the saved-folder types it trains and the
  options it does not take;
* a :class:`ModelKind` instance answering, at run time: the sentence-transformers model class and the
  trainer / arguments / collator / card classes it builds on (:meth:`ModelKind.trainer_classes`), how it
  loads or builds a model (:meth:`ModelKind.load`), what the forward returns for each text
  (:meth:`ModelKind.text_outputs`), how a column is tokenized (:meth:`ModelKind.preprocess_kwargs`,
  :meth:`ModelKind.token_layout`), what
  ``validate`` says about it (:meth:`ModelKind.describe`), what training it changes on a loaded model
  (:meth:`ModelKind.prepare_training`), the similarity a loaded model scores by (:meth:`ModelKind.similarity_name`), the settings beyond its
  weights that change what it encodes (:meth:`ModelKind.encode_settings`), its FLOPs per token beyond the encoder
  (:meth:`ModelKind.head_flops_per_token`), its scoring FLOPs (:meth:`ModelKind.scoring_flops`), its
  cached bytes per row (:meth:`ModelKind.cache_bytes_per_row`) and how its evaluation corpus is encoded
  (:meth:`ModelKind.corpus_encode_kwargs`).

:func:`register_model_kind` registers both; :mod:`cembed.model.kinds.lookup` answers which kind a name,
a loaded model or a saved folder is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from cembed.config.model import ModelConfig, register_model_config
from cembed.errors import ModelRefused


@dataclass(frozen=True)
class TrainerClasses:
    """The sentence-transformers classes a kind trains with: the model, the trainer's arguments, its
    collator (cembed tokenizes with its own, :mod:`cembed.data.tokens.collator`, when this is the
    stock one), the model card's data and callback. The trainer is cembed's ``CembedTrainer`` with
    these set (sentence-transformers' ``BaseTrainer`` reads only them)."""

    model: type
    training_args: type
    data_collator: type
    model_card_data: type
    model_card_callback: type


@dataclass(frozen=True)
class Expansion:
    """Query expansion as the model applies it: rows padded to ``length`` tokens with ``token_id``,
    those positions scored (``query_expansion_positions``) and attended to when ``attend``."""

    length: int
    token_id: int
    attend: bool


@dataclass(frozen=True)
class TokenLayout:
    """How a column's texts become token ids for the model: truncated to ``max_length`` tokens, then
    (``expansion``) padded as the model pads them. Pre-tokenized ids are stored truncated; the
    collator applies the expansion.

    ``strip``: the ``(leading, trailing)`` special tokens a column is tokenized without (an inference-free
    SPLADE's static query side tokenizes with ``add_special_tokens=False``). Stored ids always carry the
    tokenizer's special tokens, so a text has one identity in every column (the duplicate checks hash the
    ids); the collator drops them. ``max_length`` counts them: the stored ids are cut at ``max_length``,
    the model's at ``max_length - leading - trailing``."""

    max_length: int
    expansion: Expansion | None = None
    strip: tuple[int, int] = (0, 0)


class ModelKind:
    """What a model kind does at run time. Subclass it per kind and register an instance
    (:func:`register_model_kind`); ``name`` and ``config_class`` are set there.

    The defaults are the dense kind's where a default is safe; what every kind must say raises.
    """

    name: str = ""
    config_class: type[ModelConfig] = ModelConfig

    def trainer_classes(self) -> TrainerClasses:
        """The sentence-transformers classes this kind trains with."""
        raise NotImplementedError

    def load(
        self,
        path: str,
        cfg: ModelConfig,
        device: str,
        model_kwargs: dict,
        saved: bool,
        model_type: str | None = None,
        seed: int = 0,
    ):
        """Load (``saved``: ``path`` is a sentence-transformers folder or hub id with ``modules.json``)
        or build (a plain transformers checkpoint) this kind's model on ``device``.

        Args:
            path: the resolved folder or hub id.
            cfg: the ``model`` section (this kind's config class).
            model_kwargs: for the transformers model (``dtype`` set for training).
            model_type: the saved folder's sentence-transformers model type (one of the kind's
                ``model_types``; None: a plain checkpoint, or a hub id not readable here).
            seed: seeds the weights the kind makes new (a projection), the run's ``train.seed``.

        Returns:
            The model (an instance of :attr:`TrainerClasses.model`). Errors propagate; the caller turns
            them into one line naming ``model.name_or_path``.
        """
        raise NotImplementedError

    def check_trainable(self, model, name: str) -> None:
        """Refuse a loaded model cembed cannot train as this kind. Default: a model whose first module is
        not a transformer (a StaticEmbedding, a bag of words, CLIP, ...): cembed's mini-batches are token
        sequences with an attention mask, sorted by length and padded, which such a module does not take.

        Raises:
            ModelRefused: naming the module type and why (exit 2).
        """
        from sentence_transformers import models
        from sentence_transformers.models import Transformer

        first = model[0] if len(model) else None
        if first is None or isinstance(first, Transformer):
            return
        name_ = type(first).__name__
        kind = (
            f"sentence_transformers.models.{name_}"
            if getattr(models, name_, None) is type(first)
            else type(first).__module__ + "." + name_
        )
        raise ModelRefused(
            f"model.name_or_path: {name!r} is a {name_} model ({kind}); cembed cannot train it: it "
            "takes no token-level mini-batches with an attention mask, so cembed cannot length-sort, pad or "
            "pre-tokenize its batches; use a transformer model (or train this one with sentence-transformers directly)"
        )

    def prepare_training(self, model) -> None:
        """Set on a model loaded to train (``load_model(..., for_training=True)``) what training it as this kind
        changes, before ``validate`` describes it; a model loaded to evaluate or mine is left as it was saved.
        Default: nothing."""

    def encode_settings(self, model) -> dict[str, Any]:
        """Settings of the loaded ``model``, beyond its modules and weights, that change what it encodes (a
        ``SparseEncoder``'s ``max_active_dims``), by name: ``validate --json`` reports them under ``model``,
        :func:`cembed.model.fingerprint.model_fingerprint` hashes them (cached embeddings follow them).
        Default: none."""
        return {}

    def similarity_name(self, model) -> str:
        """The similarity the loaded ``model`` scores a query and a document by, which names its retrieval
        metrics (``<set>_<name>_ndcg@10``). Default: the kind's (``ModelConfig.similarity``)."""
        return self.config_class.similarity

    def encoder_module(self, model):
        """The sentence-transformers module that holds the transformers encoder a run trains (its
        ``auto_model``: what LoRA adapts, FSDP wraps layer by layer and the FLOP model counts). Default:
        the first module."""
        return model[0]

    def describe(self, model, cfg: ModelConfig, saved: bool) -> str:
        """What ``validate`` prints after ``pooling:`` for the loaded ``model``: how a text becomes
        its output and where that comes from (``saved``: from the model's own sentence-transformers
        config, else built from a plain checkpoint by ``cfg``)."""
        raise NotImplementedError

    def text_outputs(self, outputs: dict) -> list:
        """What each text of a forward became, one tensor per row (in row order), from the model's
        output dict: the packing check compares them packed vs alone, the unused-parameter search sums them."""
        raise NotImplementedError

    def preprocess_kwargs(self, column: int) -> dict[str, Any]:
        """Keywords of ``model.preprocess`` for the texts of training column ``column`` (0: the anchor /
        query, the rest documents), so that pre-tokenized ids equal the model's own; default none."""
        return {}

    def token_layout(self, model, column: int) -> TokenLayout | None:
        """How training column ``column``'s texts are tokenized by ``model.preprocess`` with
        :meth:`preprocess_kwargs`; None when cembed cannot store ids that equal it (the collator then
        tokenizes). Default: truncated to ``model.max_seq_length``."""
        return TokenLayout(int(model.max_seq_length))

    def embedding_dimension(self, model) -> int | None:
        """The size of one output vector (a token's for a multi-vector model)."""
        get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return get()

    def head_flops_per_token(self, model) -> float:
        """Forward FLOPs per token beyond the transformer encoder (a projection head), for the meter
        and ``estimate``; default 0."""
        return 0.0

    def scoring_flops(self, model, query_tokens: float, document_tokens: float) -> float:
        """Forward FLOPs of scoring ``query_tokens`` query tokens against ``document_tokens`` document
        tokens (every candidate a rank scores), beyond the encoder; default 0 (one dot product per
        (query, document) pair is negligible next to the encoder). Bilinear in the two counts: the meter
        multiplies its value at one pair by the pairs a step scored (:func:`cembed.train.flops.scoring_flops`
        adds the backward's passes)."""
        return 0.0

    def cache_bytes_per_row(self, model, tokens: int, element_bytes: int) -> int:
        """Bytes a cached loss holds per row between its passes: the row's output, for a row of
        ``tokens`` tokens, at ``element_bytes`` per number. Default: one vector."""
        return int(self.embedding_dimension(model) or 0) * element_bytes

    def measured_cache(self, model, columns: list[list[str]], element_bytes: int) -> tuple[list[float], str] | None:
        """The bytes a cached loss holds per row of each training column (0: the query), measured on sample
        texts ``columns`` of each, for a kind whose cache depends on what the model outputs (a sparse
        model's active coordinates), and how (a phrase); None (the default) where
        :meth:`cache_bytes_per_row` is exact."""
        return None

    def corpus_encode_kwargs(self) -> dict[str, Any]:
        """Keywords of ``model.encode_document`` for an evaluation corpus (the embedding cache,
        :mod:`cembed.eval.embedding_cache`, stores what they return). Default: numpy arrays (one
        ``(texts, dim)`` array, or a multi-vector model's one ``(tokens, dim)`` array per text)."""
        return {"convert_to_numpy": True}


# kind name -> ModelKind; filled by register_model_kind.
MODEL_KINDS: dict[str, ModelKind] = {}


def register_model_kind(config_cls: type[ModelConfig], kind: ModelKind) -> ModelKind:
    """Make ``model.kind: <kind>`` usable: register ``config_cls`` (see
    :func:`cembed.config.model.register_model_config`) and ``kind`` under the config's ``kind``.

    Returns:
        ``kind``, with ``name`` and ``config_class`` set.

    Raises:
        TypeError: ``kind`` is not a :class:`ModelKind`; see also ``register_model_config``.
        ValueError: see ``register_model_config``.
    """
    if not isinstance(kind, ModelKind):
        raise TypeError(f"{kind!r}: a model kind must be an instance of {__name__}.ModelKind")
    register_model_config(config_cls)
    (name,) = get_args(config_cls.model_fields["kind"].annotation)
    kind.name, kind.config_class = name, config_cls
    MODEL_KINDS[name] = kind
    return kind
