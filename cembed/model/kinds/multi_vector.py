"""``model.kind: multi_vector``: one vector per token, scored by MaxSim (late interaction), a
sentence-transformers ``MultiVectorEncoder``. Registered here.

Loading. A ``MultiVectorEncoder`` folder (PyLate v3 and Stanford ColBERT folders too, as
sentence-transformers reads them) is loaded as it is. Any other model is turned into one by
``MultiVectorEncoder(path)`` itself, so exactly as sentence-transformers 6.3 does: a dense
``SentenceTransformer`` loses its ``Pooling`` and sentence-level ``Normalize``, its ``Dense`` head (if
any) is kept and moved to token level, else a bias-free projection ``hidden -> 128`` is appended; then
a ``MultiVectorMask`` (the scoring mask: query expansion, skiplist) and a token-level ``Normalize``.
What cembed adds, from the config (:class:`cembed.config.model.MultiVectorModelConfig`): ``model.dim`` for
the new projection (seeded with ``train.seed``), the query / document lengths, query expansion and the
skiplist, set on the modules sentence-transformers reads them from (the ``Transformer``, the
``MultiVectorMask``), so the saved folder carries them.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from cembed.config.model import ModelConfig, MultiVectorModelConfig
from cembed.errors import ModelRefused
from cembed.model.kinds.registry import Expansion, ModelKind, TokenLayout, TrainerClasses, register_model_kind

DEFAULT_DIM = 128  # sentence-transformers' projection when it makes one


def _has_own_projection(path: str, model_type: str | None, revision: str | None) -> bool:
    """Whether the model at ``path`` brings its own projection: a ``MultiVectorEncoder`` (always), a
    ``SentenceTransformer`` whose ``modules.json`` lists a ``Dense`` module (redirected to token level)."""
    if model_type == "MultiVectorEncoder":
        return True
    if model_type != "SentenceTransformer":
        return False
    modules = Path(path) / "modules.json"
    if not modules.is_file():
        from sentence_transformers.util import load_file_path

        found = load_file_path(path, "modules.json", revision=revision)
        modules = Path(found) if found else None
    try:
        entries = json.loads(modules.read_text()) if modules is not None else []
    except (OSError, ValueError):
        return False
    return any(str(m.get("type", "")).endswith(".Dense") for m in entries if isinstance(m, dict))


def _projection(model):
    """The last ``Dense`` module of ``model`` (its token projection), or None."""
    from sentence_transformers.base.modules.dense import Dense

    return next((m for m in reversed(list(model)) if isinstance(m, Dense)), None)


def _mask(model):
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    return next((m for m in model if isinstance(m, MultiVectorMask)), None)


class MultiVectorKind(ModelKind):
    """One vector per token: the ``token_embeddings`` a ``MultiVectorEncoder`` returns, under its
    scoring mask (the ``attention_mask`` its ``MultiVectorMask`` writes)."""

    def trainer_classes(self) -> TrainerClasses:
        from sentence_transformers.multi_vector_encoder import (
            MultiVectorEncoder,
            MultiVectorEncoderDataCollator,
            MultiVectorEncoderModelCardData,
            MultiVectorEncoderTrainingArguments,
        )
        from sentence_transformers.multi_vector_encoder.model_card import MultiVectorEncoderModelCardCallback

        return TrainerClasses(
            MultiVectorEncoder,
            MultiVectorEncoderTrainingArguments,
            MultiVectorEncoderDataCollator,
            MultiVectorEncoderModelCardData,
            MultiVectorEncoderModelCardCallback,
        )

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
        """Load a ``MultiVectorEncoder`` folder or build one (see the module docstring).

        Raises:
            ModelRefused: ``model.dim`` differs from the size of the model's own projection.
        """
        import torch
        from sentence_transformers.base.modules.dense import Dense
        from sentence_transformers.multi_vector_encoder import MultiVectorEncoder

        own = _has_own_projection(path, model_type, cfg.revision)
        with torch.random.fork_rng(devices=[]):  # the new projection, the same on every rank
            torch.manual_seed(seed)
            model = MultiVectorEncoder(
                path,
                device=device,
                trust_remote_code=cfg.trust_remote_code,
                revision=cfg.revision,
                model_kwargs=model_kwargs or None,
                processor_kwargs=cfg.tokenizer_kwargs or None,
            )
            projection = _projection(model)
            dim = getattr(cfg, "dim", None)
            if projection is not None and dim is not None and dim != projection.out_features:
                if own:
                    raise ModelRefused(
                        f"model.dim: {dim}, but {cfg.name_or_path!r} has its own projection to "
                        f"{projection.out_features} dimensions; drop model.dim (or set it to {projection.out_features})"
                    )
                index = list(model).index(projection)
                model[index] = Dense(
                    projection.in_features,
                    dim,
                    bias=False,
                    activation_function=torch.nn.Identity(),
                    module_input_name="token_embeddings",
                ).to(model.device)
        self._apply_options(model, cfg)
        model.cembed_multi_vector_source = (
            "the model's MultiVectorEncoder config"
            if model_type == "MultiVectorEncoder"
            else f"built from a {'SentenceTransformer' if model_type else 'plain transformers checkpoint'}"
            + ("" if own else f": new projection {_projection(model).in_features} -> {_projection(model).out_features}")
        )
        return model

    @staticmethod
    def _apply_options(model, cfg: ModelConfig) -> None:
        """Set the config's lengths, query expansion and skiplist on the modules that read them."""
        transformer = model[0]
        for name in ("query_length", "document_length"):
            value = getattr(cfg, name, None)
            if value is not None:
                setattr(transformer, name, value)
        expansion = getattr(cfg, "query_expansion", None)
        if expansion is not None:
            transformer.query_expansion = {"strategy": "fixed", "attend": False, "length": expansion}
        skiplist = getattr(cfg, "skiplist", None)
        mask = _mask(model)
        if skiplist is not None and mask is not None:
            mask.skiplist_words = list(string.punctuation) if skiplist == "punctuation" else list(skiplist)
            mask.resolve_with_tokenizer(model.tokenizer)

    def describe(self, model, cfg: ModelConfig, saved: bool) -> str:
        transformer, mask = model[0], _mask(model)
        lengths = (
            f"query {transformer.query_length or 'max_seq_length'} / document "
            f"{transformer.document_length or 'max_seq_length'} tokens"
        )
        expansion = getattr(transformer, "query_expansion", None)
        if expansion:
            lengths += f", queries expanded to {expansion['length']} with [MASK]"
        skip = f", skiplist of {len(mask.skiplist_words)} words" if mask is not None and mask.skiplist_words else ""
        source = getattr(model, "cembed_multi_vector_source", "")
        return (
            f"none: one {model.get_embedding_dimension()}-dim vector per token, {model.similarity_fn_name} "
            f"({lengths}{skip}; {source})"
        )

    def text_outputs(self, outputs: dict) -> list:
        mask = outputs["attention_mask"].bool()
        return [tokens[keep] for tokens, keep in zip(outputs["token_embeddings"], mask)]

    def preprocess_kwargs(self, column: int) -> dict:
        # The first column is the query, the others documents (sentence-transformers' collator and loss).
        return {"task": "query" if column == 0 else "document"}

    def token_layout(self, model, column: int) -> TokenLayout | None:
        """A query: truncated to ``query_length`` (else ``max_seq_length``), or with query expansion
        (``fixed``) to its length and padded to it with the expansion token; a document: truncated to
        ``document_length`` (else ``max_seq_length``), as ``Transformer.preprocess`` does per task."""
        transformer = model[0]
        query = self.preprocess_kwargs(column)["task"] == "query"
        expansion = getattr(transformer, "query_expansion", None) if query else None
        if expansion is not None:
            if expansion["strategy"] != "fixed":  # 'min' widens per batch: the collator tokenizes
                return None
            tokenizer = model.tokenizer
            token = expansion.get("token")
            token_id = tokenizer.convert_tokens_to_ids(token) if token else tokenizer.mask_token_id
            if token_id is None:
                token_id = tokenizer.eos_token_id
            return TokenLayout(expansion["length"], Expansion(expansion["length"], int(token_id), expansion["attend"]))
        length = transformer.query_length if query else transformer.document_length
        return TokenLayout(int(length or model.max_seq_length))

    def embedding_dimension(self, model) -> int | None:
        return model.get_embedding_dimension()

    def head_flops_per_token(self, model) -> float:
        # Every Dense module acts per token (a dense model's head may have several, all kept at token
        # level): 2 x in x out each.
        from sentence_transformers.base.modules.dense import Dense

        return sum(2.0 * m.in_features * m.out_features for m in model if isinstance(m, Dense))

    def scoring_flops(self, model, query_tokens: float, document_tokens: float) -> float:
        # MaxSim: one dot product of dim numbers per (query token, document token) pair.
        return 2.0 * int(model.get_embedding_dimension()) * query_tokens * document_tokens

    def cache_bytes_per_row(self, model, tokens: int, element_bytes: int) -> int:
        # A row's scored token vectors end to end, and its offset (int64).
        return tokens * int(model.get_embedding_dimension()) * element_bytes + 8


register_model_kind(MultiVectorModelConfig, MultiVectorKind())
