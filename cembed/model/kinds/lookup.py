"""Which model kind: of a name (``model.kind``), of a loaded model, of a saved folder. The built-in kinds
are imported here, so that they are registered whenever a kind is looked up (a plugin's kind registers
when the plugins load, before any config validates).

A saved folder says what it is in ``config_sentence_transformers.json`` (``model_type``:
``SentenceTransformer``, ``SparseEncoder``, ``MultiVectorEncoder``, ``CrossEncoder``; PyLate and
Stanford ColBERT checkpoints are ``MultiVectorEncoder`` as sentence-transformers reads them). A kind
trains the folder types its config class lists (``model_types``); any other is refused naming the type,
so a folder is never silently loaded as another kind (sentence-transformers would convert it: a
``SparseEncoder`` loaded as a ``SentenceTransformer`` drops its MLM head and mean-pools).
"""

from __future__ import annotations

import json
from pathlib import Path

import cembed.model.kinds.dense  # noqa: F401 - registers dense
import cembed.model.kinds.multi_vector  # noqa: F401 - registers multi_vector
from cembed.errors import ModelRefused
from cembed.model.kinds.registry import MODEL_KINDS, ModelKind

# sentence-transformers' model types, for messages about a folder no kind trains.
_TYPE_WORDS = {
    "SentenceTransformer": "a dense embedding model",
    "SparseEncoder": "a learned-sparse (SPLADE-style) model",
    "MultiVectorEncoder": "a multi-vector (late-interaction, ColBERT-style) model",
    "CrossEncoder": "a reranker scoring text pairs, not an embedding model",
}


def model_kind(name: str) -> ModelKind:
    """The registered kind called ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    kind = MODEL_KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"unknown model kind {name!r}; known: {', '.join(MODEL_KINDS)}")
    return kind


# The attribute load_model sets on a model: the kind it was loaded as (two kinds may share a model class).
KIND_ATTRIBUTE = "cembed_model_kind"


def kind_of(model, default: str | None = None) -> ModelKind:
    """The kind ``model`` was loaded as (:data:`KIND_ATTRIBUTE`, set by ``load_model``), else the
    registered kind whose model class it is (the most derived one that matches); a DDP- or
    compile-wrapped model is looked through.

    Args:
        default: the kind of a model no registered kind's class matches (any object with the methods
            the caller uses, e.g. a stand-in model in a test); None: refuse it.

    Raises:
        ValueError: no registered kind's model class matches and no ``default`` is given.
    """
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    loaded_as = MODEL_KINDS.get(getattr(model, KIND_ATTRIBUTE, None) or "")
    if loaded_as is not None:
        return loaded_as
    best, depth = None, -1
    for kind in MODEL_KINDS.values():
        cls = kind.trainer_classes().model
        if isinstance(model, cls) and len(cls.__mro__) > depth:
            best, depth = kind, len(cls.__mro__)
    if best is None and default is not None:
        return model_kind(default)
    if best is None:
        raise ValueError(f"{type(model).__name__} is not the model of any registered kind ({', '.join(MODEL_KINDS)})")
    return best


def _read_json(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def saved_model_type(path: str, revision: str | None = None) -> str | None:
    """The sentence-transformers model type of the saved model at ``path`` (a folder or a hub id), as
    sentence-transformers reads it; None for a plain transformers checkpoint (no ``modules.json``) or a
    hub id that cannot be read here (offline, not cached)."""
    folder = Path(path)
    if folder.is_dir():
        files = {name: folder / name for name in ("modules.json", "config_sentence_transformers.json", "config.json")}
        files = {name: (p if p.is_file() else None) for name, p in files.items()}
    else:
        try:
            from sentence_transformers.util import load_file_path

            files = {
                name: (Path(found) if (found := load_file_path(path, name, revision=revision)) else None)
                for name in ("modules.json", "config_sentence_transformers.json", "config.json")
            }
        except Exception:  # noqa: BLE001 - unreadable hub id: sentence-transformers decides when it loads
            return None
    st_type = _read_json(files["config_sentence_transformers.json"]).get("model_type")
    if st_type == "ColBERT":  # PyLate v3
        return "MultiVectorEncoder"
    if st_type is not None:
        return str(st_type)
    if "HF_ColBERT" in (_read_json(files["config.json"]).get("architectures") or []):  # Stanford ColBERT
        return "MultiVectorEncoder"
    return "SentenceTransformer" if files["modules.json"] is not None else None


def owner_of(model_type: str) -> ModelKind | None:
    """The registered kind whose own folders are of ``model_type`` (listed first in its ``model_types``)."""
    return next((k for k in MODEL_KINDS.values() if k.config_class.model_types[:1] == (model_type,)), None)


def check_folder_kind(model_type: str | None, kind: ModelKind, name: str, field: str = "model.name_or_path") -> None:
    """Refuse to train the saved model ``name`` of ``model_type`` (:func:`saved_model_type`) as ``kind``
    unless the kind trains that type (a plain checkpoint, None, any kind builds from).

    Raises:
        ModelRefused: one line naming the folder's type and what to do: the ``model.kind`` that trains
            it, or that no kind of cembed does.
    """
    if model_type is None or model_type in kind.config_class.model_types:
        return
    what = _TYPE_WORDS.get(model_type, "another model type")
    owner = owner_of(model_type)
    fix = (
        f"set model.kind: {owner.name} to train it as one"
        if owner is not None
        else f"cembed has no model kind for it (its kinds: {', '.join(MODEL_KINDS)}); train it with "
        "sentence-transformers directly, or give a model of one of those kinds"
    )
    raise ModelRefused(
        f"{field}: {name!r} is a sentence-transformers {model_type} folder ({what}), not one model.kind "
        f"{kind.name} trains (loaded as {kind.name} it would lose what makes it one); {fix}"
    )


def kind_of_folder(model_type: str | None, name: str, field: str = "--model") -> ModelKind:
    """The kind a saved model of ``model_type`` is loaded as when no config names one (``cembed eval``):
    the kind that owns the type, the dense kind for a plain checkpoint.

    Raises:
        ModelRefused: no registered kind owns ``model_type`` (naming it, and ``field``).
    """
    if model_type is None:
        return model_kind("dense")
    owner = owner_of(model_type)
    if owner is None:
        raise ModelRefused(
            f"{field}: {name!r} is a sentence-transformers {model_type} folder "
            f"({_TYPE_WORDS.get(model_type, 'another model type')}); cembed has no model kind for it (its kinds: "
            f"{', '.join(MODEL_KINDS)}); use sentence-transformers directly for it"
        )
    return owner
