"""``model.kind: dense``, the default: one vector per text, a sentence-transformers ``SentenceTransformer``
(``Transformer`` + ``Pooling`` + optional ``Dense`` / ``Normalize``). A plain transformers checkpoint is
built as ``Transformer + Pooling(model.pooling)``. Registered here."""

from __future__ import annotations

from cembed.config.model import DenseModelConfig, ModelConfig
from cembed.model.kinds.registry import ModelKind, TrainerClasses, register_model_kind


def plain_checkpoint(path: str, cfg: ModelConfig, device: str, model_kwargs: dict):
    """A plain transformers checkpoint as Transformer + Pooling(``cfg.pooling``)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    shared = {"trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision}
    transformer = Transformer(
        path,
        model_kwargs={**shared, **model_kwargs},
        processor_kwargs={**shared, **cfg.tokenizer_kwargs},
        config_kwargs=shared,
    )
    pooling = Pooling(transformer.get_embedding_dimension(), cfg.pooling)
    return SentenceTransformer(modules=[transformer, pooling], device=device)


class DenseKind(ModelKind):
    """One vector per text: the ``sentence_embedding`` of a ``SentenceTransformer``."""

    def trainer_classes(self) -> TrainerClasses:
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainingArguments
        from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
        from sentence_transformers.sentence_transformer.model_card import (
            SentenceTransformerModelCardCallback,
            SentenceTransformerModelCardData,
        )

        return TrainerClasses(
            SentenceTransformer,
            SentenceTransformerTrainingArguments,
            SentenceTransformerDataCollator,
            SentenceTransformerModelCardData,
            SentenceTransformerModelCardCallback,
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
        from sentence_transformers import SentenceTransformer

        if not saved:
            return plain_checkpoint(path, cfg, device, model_kwargs)
        return SentenceTransformer(
            path,
            device=device,
            trust_remote_code=cfg.trust_remote_code,
            revision=cfg.revision,
            model_kwargs=model_kwargs or None,
            processor_kwargs=cfg.tokenizer_kwargs or None,
        )

    def prepare_training(self, model) -> None:
        """Score ``model`` by the cosine the dense losses train (sentence-transformers' cached losses and GIST
        score by cosine): a folder saved with another similarity (``dot``, ``euclidean``, ``manhattan``) is
        trained, evaluated during training and saved as cosine, and ``validate`` says it was replaced; kept,
        the saved model would rank by what the loss never trained (a dot product's vector norms)."""
        if model.similarity_fn_name != "cosine":
            model.cembed_similarity_replaced = str(model.similarity_fn_name)
            model.similarity_fn_name = "cosine"

    def similarity_name(self, model) -> str:
        """The model's own ``similarity_fn_name`` (cosine, or the dot / euclidean / manhattan a folder was saved
        with, when it is evaluated rather than trained), as sentence-transformers' ``model.similarity`` and its
        retrieval evaluator score it."""
        return str(getattr(model, "similarity_fn_name", None) or "cosine")

    def describe(self, model, cfg: ModelConfig, saved: bool) -> str:
        modes = [m.pooling_mode for m in model if hasattr(m, "pooling_mode")]
        mode = "none (no Pooling module)" if not modes else str(modes[0])
        replaced = getattr(model, "cembed_similarity_replaced", None)
        similarity = f"; its {replaced} similarity replaced by cosine (what the loss trains)" if replaced else ""
        if saved:
            return f"{mode} (the model's sentence-transformers config; model.pooling is not used){similarity}"
        return f"{mode} (model.pooling; plain transformers checkpoint){similarity}"

    def text_outputs(self, outputs: dict) -> list:
        return list(outputs["sentence_embedding"])


register_model_kind(DenseModelConfig, DenseKind())
