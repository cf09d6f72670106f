"""What a model's files say of its shape, without loading its weights: where its transformer lives,
its embedding dimension (the module stack's own configs) and its backbone's modules (the
architecture built on torch's meta device). ``cembed validate`` and the start of ``cembed train`` read
these (``cembed.train.preflight``), so a config the model cannot run is refused before any weight is read.

Every answer may be None (unknown: an unreachable hub id, a module type whose config is not read
here, a model with its own code); the check that needs it is then left to loading, which says the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from cembed.config.schema import ModelConfig
from cembed.model.load import resolve_model_path

# sentence-transformers modules that keep the width of what they are given.
_SAME_WIDTH = ("Normalize", "LayerNorm", "Dropout", "Transformer")
# config.json keys that hold a transformer's hidden size, by model family.
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "dim")


def model_file(name: str, filename: str, revision: str | None) -> Path | None:
    """``filename`` from a model folder or (cached) hub id; None when it is not there or unreachable."""
    if Path(name).is_dir():
        path = Path(name) / filename
        return path if path.is_file() else None
    try:
        from sentence_transformers.util import load_file_path

        found = load_file_path(name, filename, revision=revision)
        return Path(found) if found else None
    except Exception:
        return None


def read_json(path: Path | None) -> dict | list:
    """A JSON file's content; ``{}`` when there is no file or it cannot be read."""
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}


# transformers' VERY_LARGE_INTEGER marks a tokenizer saved without a length limit
_NO_LIMIT = 10**12


def transformer_folder(cfg: ModelConfig) -> tuple[str, int | None]:
    """Where the model's transformer (config.json, tokenizer) lives and the model's own
    max_seq_length: ``sentence_bert_config.json``'s, else (sentence-transformers >= 6 keeps it in
    the tokenizer) ``tokenizer_config.json``'s ``model_max_length`` capped at ``config.json``'s
    ``max_position_embeddings``, as sentence-transformers' Transformer module reads it; None when
    none is set."""
    name = resolve_model_path(cfg.name_or_path)
    modules = read_json(model_file(name, "modules.json", cfg.revision))
    sub = next((m.get("path", "") for m in modules if "Transformer" in m.get("type", "")), "") if modules else ""
    base = str(Path(name) / sub) if sub and Path(name).is_dir() else name
    own = read_json(model_file(base, "sentence_bert_config.json", cfg.revision)).get("max_seq_length")
    if own is None:
        limit = read_json(model_file(base, "tokenizer_config.json", cfg.revision)).get("model_max_length")
        positions = read_json(model_file(base, "config.json", cfg.revision)).get("max_position_embeddings")
        if isinstance(limit, int) and 0 < limit < _NO_LIMIT:
            own = min(limit, positions) if isinstance(positions, int) and positions > 0 else limit
    return base, own


def first_module_type(cfg: ModelConfig) -> str | None:
    """The class name of the model's first module as its files say (``Transformer``,
    ``StaticEmbedding``, ...): ``modules.json``'s first entry, ``Transformer`` for a plain transformers
    checkpoint (a ``config.json``, no ``modules.json``); None when the files say neither."""
    name = resolve_model_path(cfg.name_or_path)
    modules = read_json(model_file(name, "modules.json", cfg.revision))
    if isinstance(modules, list) and modules:
        first = min(modules, key=lambda m: m.get("idx", 0)) if all(isinstance(m, dict) for m in modules) else {}
        return first.get("type", "").rsplit(".", 1)[-1] or None
    return "Transformer" if read_json(model_file(name, "config.json", cfg.revision)) else None


def _hidden_size(config: dict) -> int | None:
    return next((config[k] for k in _HIDDEN_KEYS if isinstance(config.get(k), int)), None)


def _pooled_width(config: dict) -> int | None:
    """A Pooling module's output width: its token width times its pooling modes (sentence-transformers
    6's ``embedding_dimension`` and ``pooling_mode``, or the older ``word_embedding_dimension`` and
    ``pooling_mode_*`` flags); None when the config says neither."""
    width = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if not isinstance(width, int):
        return None
    mode = config.get("pooling_mode")
    if mode is not None:
        return width * (len(mode) if isinstance(mode, list) else 1)
    flags = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    return width * max(1, len(flags))


def embedding_dimension(cfg: ModelConfig) -> int | None:
    """The size of the model's embeddings (``SentenceTransformer.get_embedding_dimension``) read from
    its files: the last Pooling or Dense module's width in ``modules.json`` order (Normalize and the
    like keep it); a plain transformers checkpoint (no ``modules.json``, pooled by ``model.pooling``)
    its hidden size. None: unknown (unreachable, or a module type not read here)."""
    name = resolve_model_path(cfg.name_or_path)
    modules = read_json(model_file(name, "modules.json", cfg.revision))
    if not modules:
        base, _ = transformer_folder(cfg)
        return _hidden_size(read_json(model_file(base, "config.json", cfg.revision)))
    width = None
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        config = (
            read_json(model_file(name, f"{module['path']}/config.json", cfg.revision)) if module.get("path") else {}
        )
        if kind == "Pooling":
            width = _pooled_width(config)
        elif kind == "Dense":
            width = config.get("out_features") if isinstance(config.get("out_features"), int) else None
        elif kind not in _SAME_WIDTH:
            return None  # a module whose width is not read here: loading says
        if kind in ("Pooling", "Dense") and width is None:
            return None
    return width


def backbone_modules(cfg: ModelConfig) -> dict[str, str] | None:
    """The transformer's modules, name -> class name (``named_modules()`` of the backbone
    sentence-transformers loads, ``transformers.AutoModel``), its architecture built from
    ``config.json`` on the meta device (no weights read); None when unknown (no config, a model with
    its own code, an architecture AutoModel does not build)."""
    if cfg.trust_remote_code:
        return None
    base, _ = transformer_folder(cfg)
    if not read_json(model_file(base, "config.json", cfg.revision)):
        return None
    try:
        import torch
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(base, revision=cfg.revision)
        with torch.device("meta"):
            backbone = AutoModel.from_config(config)
    except Exception:  # noqa: BLE001 - loading the model names what is wrong with it
        return None
    return {name: type(module).__name__ for name, module in backbone.named_modules() if name}
