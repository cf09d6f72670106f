"""The trainer of a model kind: cembed's :class:`~cembed.train.trainer.CembedTrainer` with the
sentence-transformers classes the kind trains with (:class:`cembed.model.kinds.registry.TrainerClasses`):
its model, arguments, card data and card callback, and cembed's text collator on top of the kind's
collator (for ``MultiVectorEncoder``: each column's task, query first). sentence-transformers' one
``BaseTrainer`` reads only these class attributes, so a kind needs no trainer of its own; the dense
kind's are ``SentenceTransformerTrainer``'s, so a dense run trains with ``CembedTrainer`` itself.

A model with a ``Router`` (an inference-free sparse model: a static query side, a SPLADE document side)
is routed per column as sentence-transformers routes it, by the ``router_mapping`` training argument
(:func:`router_mapping`), with each column's task as the kind tokenizes it
(:meth:`cembed.model.kinds.registry.ModelKind.preprocess_kwargs`: the first column the query)."""

from __future__ import annotations

from cembed.data.tokens.collator import TextCollator
from cembed.model.kinds.lookup import kind_of


def column_tasks(model, columns: list[str]) -> dict[str, str]:
    """``{column: task}``: the task ``model``'s kind tokenizes (and a Router routes) each training column with
    (:meth:`cembed.model.kinds.registry.ModelKind.preprocess_kwargs`, columns in loss order), for the
    columns that have one (none for a dense model)."""
    kind = kind_of(model, default="dense")
    tasks = {c: kind.preprocess_kwargs(i).get("task") for i, c in enumerate(columns)}
    return {c: t for c, t in tasks.items() if t is not None}


def router_mapping(model, columns: list[str]) -> dict[str, str]:
    """sentence-transformers' ``router_mapping`` (column -> route task) for a model whose modules include a
    ``Router``: :func:`column_tasks`; ``{}`` for any other model (sentence-transformers refuses to train a
    Router without one, and routes every column to the default route with an empty one)."""
    from sentence_transformers.base.modules import Router

    unwrapped = getattr(model, "module", model)
    if not any(isinstance(m, Router) for m in unwrapped.modules()):
        return {}
    return column_tasks(unwrapped, columns)


def trainer_for_kind(trainer_cls: type, kind) -> type:
    """``trainer_cls`` (a ``CembedTrainer`` subclass) with ``kind``'s classes, or ``trainer_cls`` itself
    when they are the ones it has."""
    classes = kind.trainer_classes()
    collator = TextCollator
    if not issubclass(TextCollator, classes.data_collator):  # the kind's task rules, cembed's null columns
        collator = type(f"Text{classes.data_collator.__name__}", (TextCollator, classes.data_collator), {})
    attributes = {
        "model_class": classes.model,
        "training_args_class": classes.training_args,
        "model_card_data_class": classes.model_card_data,
        "model_card_callback_class": classes.model_card_callback,
        "data_collator_class": collator,
    }
    if all(getattr(trainer_cls, name) is value for name, value in attributes.items()):
        return trainer_cls
    return type(f"{trainer_cls.__name__}For{classes.model.__name__}", (trainer_cls,), attributes)
