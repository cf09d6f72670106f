"""The trainer of a model kind: cembed's :class:`~cembed.train.trainer.CembedTrainer` with the
sentence-transformers classes the kind trains with (:class:`cembed.model.kinds.registry.TrainerClasses`):
its model, arguments, card data and card callback, and cembed's text collator on top of the kind's
collator (for ``MultiVectorEncoder``: each column's task, query first). sentence-transformers' one
``BaseTrainer`` reads only these class attributes, so a kind needs no trainer of its own; the dense
kind's are ``SentenceTransformerTrainer``'s, so a dense run trains with ``CembedTrainer`` itself."""

from __future__ import annotations

from cembed.data.tokens.collator import TextCollator


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
