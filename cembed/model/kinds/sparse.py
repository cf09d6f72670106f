"""``model.kind: sparse``: one sparse vector per text, trained by dot product, a sentence-transformers
``SparseEncoder``. Registered here.

Loading. A ``SparseEncoder`` folder is loaded as it is (its own architecture; ``model.architecture``, if
set, must name it) and scored by its own similarity (``cembed eval``, ``mine-negatives``); to train, by dot
product (:meth:`SparseKind.prepare_training`: a saved ``cosine`` is replaced, the loss trains dot). Any other model is built as ``model.architecture`` says
(:class:`cembed.config.model.SparseModelConfig`), with sentence-transformers' own modules:

* ``splade``: ``Transformer(transformer_task="fill-mask")`` + ``SpladePooling`` (what ``SparseEncoder(path)``
  builds from a ``...ForMaskedLM`` checkpoint), pooling and activation from the config;
* ``inference_free_splade``: a ``Router`` whose query route is a ``SparseStaticEmbedding`` (one trainable
  weight per vocabulary token, starting at 1) and whose document route is the SPLADE stack above;
* ``csr``: a dense embedding (a ``SentenceTransformer``'s, or ``Transformer`` + mean ``Pooling`` of a plain
  checkpoint) through a new ``SparseAutoEncoder`` (top-k, sentence-transformers' sizes unless
  ``csr_k`` / ``csr_hidden_dim`` say otherwise), seeded with ``train.seed``.

What the cached loss relies on: a coordinate that is 0 carries no gradient to the model (SPLADE's ReLU
before the pooling, the autoencoder's top-k and ReLU), so a cache of the non-zero coordinates is exact
(:mod:`cembed.losses.sparse_rows`). The static query weights are the one exception: a present query token
whose weight is exactly 0 would get a gradient the cache drops (a measure-zero case; the weights start at 1).
"""

from __future__ import annotations

import json
from pathlib import Path

from cembed.config.model import ModelConfig, SparseModelConfig
from cembed.errors import ModelRefused
from cembed.model.kinds.registry import ModelKind, TokenLayout, TrainerClasses, register_model_kind

# A tokenizer's model_max_length above this is transformers' "no limit" (VERY_LARGE_INTEGER): nothing is cut.
UNLIMITED_LENGTH = 10**9


def _json_file(path: str, name: str, revision: str | None = None) -> dict:
    """The JSON file ``name`` of the model at ``path`` (a folder or a hub id); {} where it is absent or unreadable."""
    found = Path(path) / name
    if not found.is_file():
        try:
            from sentence_transformers.util import load_file_path

            hub = load_file_path(path, name, revision=revision)
        except Exception:  # noqa: BLE001 - unreadable: nothing known
            return {}
        found = Path(hub) if hub else None
    try:
        loaded = json.loads(found.read_text()) if found else {}
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def is_masked_lm(path: str, revision: str | None = None) -> bool:
    """Whether the transformers checkpoint at ``path`` (a folder or a hub id) is a masked-language model
    (``config.json`` ``architectures`` ending in ``ForMaskedLM``), as ``SparseEncoder`` decides."""
    architectures = _json_file(path, "config.json", revision).get("architectures") or []
    return any(str(a).endswith("ForMaskedLM") for a in architectures)


def _modules_of(model) -> list:
    """Every module of ``model`` in order, a ``Router``'s routes included."""
    from sentence_transformers.base.modules import Router

    out = []
    for module in model:
        if isinstance(module, Router):
            for route in module.sub_modules.values():
                out += list(route)
        else:
            out.append(module)
    return out


def route_of(router, task: str) -> str:
    """The route a ``Router`` sends a text of ``task`` to (sentence-transformers' own resolution, a text
    modality)."""
    return router._resolve_route(task=task, modality="text")  # the library's rule: mappings, then the default


def architecture_of(model) -> str:
    """``splade``, ``inference_free_splade`` or ``csr``: what a ``SparseEncoder`` is, read from its modules.

    Raises:
        ModelRefused: none of them (a sparse model of modules cembed does not know).
    """
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder, SparseStaticEmbedding, SpladePooling

    modules = _modules_of(model)
    if any(isinstance(m, SparseAutoEncoder) for m in modules):
        return "csr"
    if any(isinstance(m, SpladePooling) for m in modules):
        static = any(isinstance(m, SparseStaticEmbedding) for m in modules)
        return "inference_free_splade" if static and isinstance(model[0], Router) else "splade"
    raise ModelRefused(
        f"a SparseEncoder of modules {[type(m).__name__ for m in modules]}: cembed trains SPLADE (SpladePooling), "
        "inference-free SPLADE (Router + SparseStaticEmbedding) and CSR (SparseAutoEncoder) models"
    )


def special_tokens_around(tokenizer) -> tuple[int, int] | None:
    """``(leading, trailing)``: how many special tokens ``tokenizer`` puts before and after a text's own ids
    (BERT: ``(1, 1)``, [CLS] and [SEP]); None when its ids with special tokens are not the plain ids with
    tokens around them."""
    found = set()
    for text in ("a", "a b"):
        plain = tokenizer(text, add_special_tokens=False)["input_ids"]
        full = tokenizer(text, add_special_tokens=True)["input_ids"]
        lead = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        if lead is None or not plain:
            return None
        found.add((lead, len(full) - lead - len(plain)))
    return found.pop() if len(found) == 1 else None


def _mlm_config(model):
    """The (text) config of a SPLADE model's masked-language transformer; None for CSR."""
    from sentence_transformers.base.modules import Transformer

    if architecture_of(model) == "csr":
        return None
    transformer = next((m for m in _modules_of(model) if isinstance(m, Transformer)), None)
    if transformer is None:
        return None
    config = transformer.auto_model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _splade_stack(path: str, cfg: ModelConfig, transformer_kwargs: dict) -> list:
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    transformer = Transformer(path, transformer_task="fill-mask", **transformer_kwargs)
    return [transformer, SpladePooling(cfg.splade_pooling, activation_function=cfg.splade_activation)]


def _autoencoder(input_dim: int, cfg: ModelConfig, default_k: int):
    from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder

    hidden = cfg.csr_hidden_dim or 4 * input_dim
    k = min(cfg.csr_k or default_k, hidden // 4)  # a training forward also takes the top 4k
    return SparseAutoEncoder(input_dim=input_dim, hidden_dim=hidden, k=k, k_aux=min(2 * k, hidden))


class SparseKind(ModelKind):
    """One sparse vector per text: the ``sentence_embedding`` of a ``SparseEncoder`` (vocabulary-wide for
    SPLADE, the autoencoder's width for CSR), trained by dot product, evaluated by the model's own similarity."""

    def trainer_classes(self) -> TrainerClasses:
        from sentence_transformers.sparse_encoder import (
            SparseEncoder,
            SparseEncoderTrainingArguments,
        )
        from sentence_transformers.sparse_encoder.data_collator import SparseEncoderDataCollator
        from sentence_transformers.sparse_encoder.model_card import (
            SparseEncoderModelCardCallback,
            SparseEncoderModelCardData,
        )

        return TrainerClasses(
            SparseEncoder,
            SparseEncoderTrainingArguments,
            SparseEncoderDataCollator,
            SparseEncoderModelCardData,
            SparseEncoderModelCardCallback,
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
        """Load a ``SparseEncoder`` folder or build one (see the module docstring).

        Raises:
            ModelRefused: ``model.architecture`` contradicts the folder, or ``splade`` /
                ``inference_free_splade`` from a model without a masked-language head.
        """
        import torch
        from sentence_transformers.sparse_encoder import SparseEncoder

        shared = {"trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision}
        loading = {
            "device": device,
            "model_kwargs": model_kwargs or None,
            "processor_kwargs": cfg.tokenizer_kwargs or None,
            **shared,
        }
        wanted = getattr(cfg, "architecture", None)
        if model_type == "SparseEncoder":
            model = SparseEncoder(path, **loading)
            own = architecture_of(model)
            if wanted is not None and wanted != own:
                raise ModelRefused(
                    f"model.architecture: {wanted}, but {cfg.name_or_path!r} is a {own} SparseEncoder; "
                    f"drop model.architecture (or set it to {own})"
                )
            # Its own similarity, as sentence-transformers scores it (cembed eval, mine-negatives);
            # prepare_training makes it the dot product the loss trains.
            model.cembed_sparse_source = "the model's SparseEncoder config"
            saved_cap = "max_active_dims" in _json_file(path, "config_sentence_transformers.json", cfg.revision)
            model.cembed_cap_source = "the folder's config" if saved_cap else "the autoencoder's k"
            return model
        mlm = model_type is None and is_masked_lm(path, cfg.revision)
        architecture = wanted or ("splade" if mlm else "csr")
        if architecture != "csr" and not mlm:
            raise ModelRefused(
                f"model.architecture: {architecture} needs a masked-language checkpoint (config.json architectures "
                f"...ForMaskedLM), but {cfg.name_or_path!r} is "
                + ("a SentenceTransformer folder" if model_type else "not one")
                + "; use architecture csr (a sparse autoencoder on its dense embedding) or an MLM checkpoint"
            )
        transformer_kwargs = {
            "model_kwargs": {**shared, **model_kwargs},
            "processor_kwargs": {**shared, **cfg.tokenizer_kwargs},
            "config_kwargs": shared,
        }
        with torch.random.fork_rng(devices=[]):  # new weights, the same on every rank
            torch.manual_seed(seed)
            model = self._build(architecture, path, cfg, device, loading, transformer_kwargs, model_type)
        model.similarity_fn_name = "dot"  # what the sparse loss trains (a dense model's cosine is not kept)
        source = "SentenceTransformer" if model_type else "plain transformers checkpoint"
        model.cembed_sparse_source = f"built from a {source}"
        model.cembed_cap_source = "the autoencoder's k"  # SparseEncoder sets max_active_dims only for CSR
        return model

    @staticmethod
    def _build(architecture, path, cfg, device, loading, transformer_kwargs, model_type):
        from sentence_transformers.base.modules import Router, Transformer
        from sentence_transformers.models import Pooling
        from sentence_transformers.sparse_encoder import SparseEncoder
        from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

        if architecture == "splade":
            return SparseEncoder(modules=_splade_stack(path, cfg, transformer_kwargs), device=device)
        if architecture == "inference_free_splade":
            document = _splade_stack(path, cfg, transformer_kwargs)
            query = SparseStaticEmbedding(tokenizer=document[0].tokenizer, frozen=False)
            router = Router.for_query_document(query_modules=[query], document_modules=document)
            return SparseEncoder(modules=[router], device=device, similarity_fn_name="dot")
        if model_type == "SentenceTransformer":  # CSR on a dense model, as SparseEncoder(path) converts it
            model = SparseEncoder(path, **loading)
            dim = model[-1].input_dim
            if cfg.csr_k is not None or cfg.csr_hidden_dim is not None:
                model[len(model) - 1] = sae = _autoencoder(dim, cfg, dim // 4).to(model.device)
                model.max_active_dims = sae.k  # SparseEncoder read the replaced autoencoder's k at init
            return model
        transformer = Transformer(path, transformer_task="feature-extraction", **transformer_kwargs)
        pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
        sae = _autoencoder(pooling.get_embedding_dimension(), cfg, 256)
        return SparseEncoder(modules=[transformer, pooling, sae], device=device)

    def check_trainable(self, model, name: str) -> None:
        """A SPLADE or CSR model whose first module is a transformer, or an inference-free SPLADE ``Router``
        whose routes start with a transformer (documents) and a ``SparseStaticEmbedding`` (queries).

        Raises:
            ModelRefused: another layout (naming it).
        """
        from sentence_transformers.base.modules import Router, Transformer
        from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

        architecture_of(model)
        first = model[0] if len(model) else None
        if isinstance(first, Router):
            heads = [route[0] for route in first.sub_modules.values() if len(route)]
            if all(isinstance(h, (Transformer, SparseStaticEmbedding)) for h in heads):
                return
            raise ModelRefused(
                f"model.name_or_path: {name!r} routes texts to {[type(h).__name__ for h in heads]}; cembed trains a "
                "Router whose routes start with a Transformer or a SparseStaticEmbedding (inference-free SPLADE)"
            )
        super().check_trainable(model, name)

    def prepare_training(self, model) -> None:
        """Score ``model`` by the dot product the sparse loss trains (InfoNCE on dot products): a folder saved with
        another similarity (cosine) is trained, evaluated during training and saved as dot, and ``validate``
        says it was replaced."""
        if model.similarity_fn_name != "dot":
            model.cembed_sparse_source += f"; its {model.similarity_fn_name} similarity replaced by dot"
            model.similarity_fn_name = "dot"

    def similarity_name(self, model) -> str:
        """The model's own ``similarity_fn_name`` (dot, or the cosine a folder was saved with), as
        sentence-transformers' ``SparseEncoder.similarity`` and its evaluator score it."""
        return str(model.similarity_fn_name)

    def encoder_module(self, model):
        """The first module, or for an inference-free model the ``Transformer`` of its document route (its
        query side is a static weight per token, no encoder)."""
        from sentence_transformers.base.modules import Router, Transformer

        first = model[0]
        if isinstance(first, Router):
            return next(m for m in _modules_of(model) if isinstance(m, Transformer))
        return first

    def describe(self, model, cfg: ModelConfig, saved: bool) -> str:
        from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder, SpladePooling

        modules = _modules_of(model)
        architecture = architecture_of(model)
        if architecture == "csr":
            sae = next(m for m in modules if isinstance(m, SparseAutoEncoder))
            how = f"CSR: a dense {sae.input_dim}-dim embedding through a top-{sae.k} sparse autoencoder of {sae.hidden_dim}"
        else:
            pool = next(m for m in modules if isinstance(m, SpladePooling))
            twice = pool.activation_function == "log1p_relu"
            value = "log1p(log1p(relu(MLM logits)))" if twice else "log1p(relu(MLM logits))"
            how = f"SPLADE: {pool.pooling_strategy} of {value} over a text's tokens"
            if architecture == "inference_free_splade":
                how = "inference-free SPLADE: queries a static weight per token, documents " + how.split(": ", 1)[1]
        source = getattr(model, "cembed_sparse_source", "")
        text = f"{how}; {self.embedding_dimension(model):,}-dim sparse vectors, {model.similarity_fn_name} ({source})"
        cap = model.max_active_dims
        if cap is not None:  # applied by encode only: sentence-transformers' training forward is not capped
            where = getattr(model, "cembed_cap_source", "the model")
            text += (
                f"; max_active_dims {cap} ({where}): encoding keeps each text's {cap} largest coordinates "
                "(retrieval and cembed eval; the loss trains on every active one)"
            )
        return text

    def encode_settings(self, model) -> dict:
        """``max_active_dims``: the cap ``SparseEncoder.encode`` applies to each vector's active coordinates (the
        folder's ``config_sentence_transformers.json``, or a CSR autoencoder's k), None where there is none."""
        return {"max_active_dims": model.max_active_dims}

    def text_outputs(self, outputs: dict) -> list:
        return list(outputs["sentence_embedding"])

    def preprocess_kwargs(self, column: int) -> dict:
        # The first column is the query, the others documents: an inference-free model routes by it, and
        # sentence-transformers' SparseEncoder.encode_query / encode_document pass the same task.
        return {"task": "query" if column == 0 else "document"}

    def token_layout(self, model, column: int) -> TokenLayout | None:
        """As the column's route tokenizes it. An inference-free model's static query side
        (``SparseStaticEmbedding.preprocess``) tokenizes without special tokens, cut at its tokenizer's
        ``model_max_length``: stored with the special tokens around (cut that many tokens later), the
        collator drops them (:class:`TokenLayout`'s ``strip``); None (the collator tokenizes) where that
        is not exact (a tokenizer without a length limit, special tokens not around the text). Any other
        route or model: cut at the route's ``max_seq_length``."""
        from sentence_transformers.base.modules import Router
        from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

        first = model[0] if len(model) else None
        if not isinstance(first, Router):
            return super().token_layout(model, column)
        route = first.sub_modules[route_of(first, self.preprocess_kwargs(column)["task"])]
        head = route[0]
        if not isinstance(head, SparseStaticEmbedding):
            return TokenLayout(int(getattr(head, "max_seq_length", None) or model.max_seq_length))
        length = int(head.tokenizer.model_max_length)
        around = special_tokens_around(head.tokenizer)
        if length >= UNLIMITED_LENGTH or around is None:
            return None
        return TokenLayout(length + sum(around), strip=around)

    def embedding_dimension(self, model) -> int | None:
        """The width of a text's sparse vector: the MLM vocabulary (SPLADE; sentence-transformers knows it only
        after a forward), the autoencoder's hidden size (CSR)."""
        from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder

        modules = _modules_of(model)
        sae = next((m for m in modules if isinstance(m, SparseAutoEncoder)), None)
        if sae is not None:
            return int(sae.hidden_dim)
        config = _mlm_config(model)
        return int(config.vocab_size) if config is not None else model.get_embedding_dimension()

    def head_flops_per_token(self, model) -> float:
        """SPLADE's vocabulary projection, ``2 x hidden x vocab`` per token: transformers ties the decoder to
        the word embeddings, so ``num_parameters(exclude_embeddings=True)`` leaves it out of the encoder's
        N (about a fifth of a BERT-base's FLOPs). CSR: the autoencoder's encoder, once per text (counted
        per token it is small; 0 here)."""
        config = _mlm_config(model)
        if config is None:
            return 0.0
        hidden, vocab = int(getattr(config, "hidden_size", 0) or 0), int(getattr(config, "vocab_size", 0) or 0)
        return 2.0 * hidden * vocab

    def cache_bytes_per_row(self, model, tokens: int, element_bytes: int) -> int:
        # The dense worst case (a fresh MLM activates most of the vocabulary, and the cache falls back to
        # dense rows): the whole width. The measured density is the probe's and the meter's.
        return int(self.embedding_dimension(model) or 0) * element_bytes

    def measured_cache(self, model, columns: list[list[str]], element_bytes: int) -> tuple[list[float], str] | None:
        """Per column, the cache's bytes per row at the density the model has on the sample texts (the query
        column through ``encode_query``, the others ``encode_document``): each active coordinate's value and
        int32 index, and a row offset, as :mod:`cembed.losses.sparse_rows` keeps a sparse mini-batch; at
        most the dense row (the dense fallback)."""
        import torch

        width = int(self.embedding_dimension(model) or 0)
        per_row, active = [], []
        with torch.no_grad():
            for index, texts in enumerate(columns):
                encode = model.encode_query if index == 0 else model.encode_document
                rows = encode(list(texts), convert_to_tensor=True, batch_size=16, show_progress_bar=False)
                dims = float((rows.to_dense() != 0).sum()) / max(len(texts), 1)
                active.append(dims)
                per_row.append(min(dims * (element_bytes + 4) + 4, float(width * element_bytes)))
        shown = "/".join(f"{a:.0f}" for a in active)
        return per_row, f"the model's measured density: mean active dims {shown} of {width:,} per column"

    def corpus_encode_kwargs(self) -> dict:
        # A sparse tensor on the CPU (the embedding cache stores it as CSR): a dense corpus of 30,522-wide
        # rows would take 122 KB per document.
        return {"convert_to_tensor": True, "convert_to_sparse_tensor": True, "save_to_cpu": True}


register_model_kind(SparseModelConfig, SparseKind())
