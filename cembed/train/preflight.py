"""Pre-flight checks: everything about a run that can be known before training starts.

``cembed validate`` and the start of ``cembed train`` both run :func:`preflight` (through
``cembed.train.recipe.check_run_inputs``), so a config that validates does not crash later on something
knowable up front:

- the model's position table against ``model.max_seq_length`` (a longer text would crash in the
  position embeddings at the first long batch);
- the LR scheduler: its arguments (``optim.lr_scheduler_kwargs``) are tried on a one-parameter
  optimizer at the effective LR, so a missing argument or an end LR above the effective LR is found;
- the tokenizer can pad (the collator pads every batch);
- ``batch.pad_to_multiple_of`` is at most the texts' length (``model.max_seq_length`` or the model's
  own): above it, no width is a multiple and every batch would be padded to the full length;
- what the model's files say of its shape (:mod:`cembed.model.shape`, no weights read): each
  ``loss.matryoshka.dims`` within its embedding size, each LoRA ``target_modules`` entry naming a
  module of its backbone (peft would skip one that names none);
- each model the loss loads besides the one trained (``cached_gist``'s ``loss.guide``) can be found;
- each ``train.report_to`` tracker's package is installed (transformers' own availability check,
  the one its trainer callbacks run at step 0);
- ``train.push_to_hub``: the hub is reachable (not offline; a token that the hub answers to);
- the folders a run writes (``train.output_dir``, the cache root of ``data.cache_dir``) can be
  created: not a file, not under a file, writable.

Each problem is a :class:`Finding` whose text is one line naming the field and the fix.

Resuming: :func:`training_record` is what a checkpoint records about the run that wrote it, and
:func:`resume_differences` compares it with the config of a resume (see ``cembed.train.checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from cembed.config.schema import CembedConfig, ModelConfig, OptimConfig
from cembed.errors import UserError, first_line
from cembed.files import cache_root, display_path
from cembed.model.shape import model_file, read_json, transformer_folder
from cembed.plan.resolve import per_device_batch

# Models whose positions come from a learned absolute table (a longer input crashes); RoBERTa-style
# tables reserve the first pad_token_id + 1 entries.
ABSOLUTE_POSITIONS = {"bert", "distilbert", "electra", "albert", "mpnet", "roberta", "xlm-roberta", "camembert"}
PADDING_OFFSET = {"roberta", "xlm-roberta", "camembert", "mpnet"}


@dataclass(frozen=True)
class Finding:
    """One pre-flight problem: ``field`` (dotted config field) and a one-line ``message`` with the fix."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def preflight(cfg: CembedConfig, learning_rate: float) -> list[Finding]:
    """Every pre-flight finding for ``cfg`` run at the effective ``learning_rate`` (empty: none).

    A model that cannot be reached (a hub id offline) skips the model checks; loading it later says why.
    """
    return (
        check_scheduler(cfg.optim, learning_rate, cfg.train.max_steps)
        + check_model(cfg.model)
        + check_pad_multiple(cfg.batch.pad_to_multiple_of, cfg.model)
        + check_pad_tokenized(cfg)
        + check_model_shape(cfg)
        + check_loss_models(cfg.loss)
        + check_trackers(cfg.train.report_to)
        + check_hub(cfg.train)
        + check_writable_folders(cfg)
    )


def raise_findings(findings: list[Finding]) -> None:
    """Raise the first finding as a :class:`UserError` (naming how many more there are).

    Raises:
        UserError: ``findings`` is not empty.
    """
    if findings:
        more = f" (and {len(findings) - 1} more problem(s); fix this first)" if len(findings) > 1 else ""
        raise UserError(f"{findings[0]}{more}")


def check_scheduler(optim: OptimConfig, learning_rate: float, max_steps: int | None) -> list[Finding]:
    """Build ``optim.lr_scheduler_type`` with ``optim.lr_scheduler_kwargs`` on a one-parameter optimizer
    at ``learning_rate`` (``max_steps`` steps, or 100 when the run is counted in epochs)."""
    import torch
    from transformers import get_scheduler

    name, kwargs = optim.lr_scheduler_type, dict(optim.lr_scheduler_kwargs)
    steps = max_steps or 100
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=learning_rate)
    field = "optim.lr_scheduler_kwargs"
    if name == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        return [
            Finding(
                field,
                f"lr_scheduler_type warmup_stable_decay needs num_decay_steps (steps of the final decay); "
                f"set e.g. optim.lr_scheduler_kwargs={{num_decay_steps: {max(1, steps // 10)}}}",
            )
        ]
    warmup = math.ceil(optim.warmup_ratio * steps)  # as TrainingArguments.get_warmup_steps rounds it
    try:
        scheduler = get_scheduler(
            name, opt, num_warmup_steps=warmup, num_training_steps=steps, scheduler_specific_kwargs=kwargs
        )
        # the schedule's own edges: transformers' polynomial decay divides by (steps - warmup) unguarded
        for lr_at in getattr(scheduler, "lr_lambdas", ()):
            for step in sorted({0, warmup, warmup + 1, steps - 1, steps}):
                lr_at(step)
    except ZeroDivisionError:
        return [
            Finding(
                "optim.warmup_ratio",
                f"{name}: the warmup ({warmup} step(s) = ceil({optim.warmup_ratio:g} x {steps})) leaves no step to "
                "decay over; lower optim.warmup_ratio or train more steps",
            )
        ]
    except ValueError as err:
        if name == "polynomial" and "lr_end" in str(err):
            end = kwargs.get("lr_end", 1e-7)
            return [
                Finding(
                    "optim.learning_rate",
                    f"the effective LR {learning_rate:.3e} is not above the polynomial schedule's end LR {end:g}; "
                    f"set optim.lr_scheduler_kwargs={{lr_end: {learning_rate / 10:.1e}}} or raise the LR",
                )
            ]
        return [Finding(field, f"{name}: {first_line(err)}")]
    except TypeError as err:
        return [Finding(field, f"{name} does not accept these arguments ({first_line(err)}); fix or remove them")]
    return []


# The pip package each tracker of train.report_to needs (transformers' integration names).
TRACKER_PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "comet_ml": "comet-ml",
    "clearml": "clearml",
    "neptune": "neptune",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}


def check_trackers(report_to: list[str]) -> list[Finding]:
    """Each ``train.report_to`` tracker whose package transformers cannot find
    (``transformers.integrations.get_available_reporting_integrations``: the check its callbacks
    make when the trainer is built, which would stop the run at step 0). ``none`` and ``all`` (every
    installed tracker, possibly none) need nothing."""
    from transformers.integrations import get_available_reporting_integrations

    available = set(get_available_reporting_integrations())
    missing = [name for name in report_to if name not in ("none", "all") and name not in available]
    if not missing:
        return []
    install = " ".join(TRACKER_PACKAGES.get(name, name) for name in missing)
    return [
        Finding(
            "train.report_to",
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
            f"pip install {install}, or remove {'it' if len(missing) == 1 else 'them'} from train.report_to",
        )
    ]


def folder_problem(path: str | Path) -> str | None:
    """Why a run could not create or write the folder ``path`` (None: it can): it is a file, one of
    its parents is a file, or the folder (or the nearest existing parent, where it will be created)
    is not writable."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        return f"{display_path(path)} is a file, not a folder"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{display_path(path)} cannot be created: {display_path(existing)} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{display_path(existing)} is not writable"
    return None


def check_writable_folders(cfg: CembedConfig) -> list[Finding]:
    """``train.output_dir`` and the cache root (``data.cache_dir``, else ``$CEMBED_CACHE_DIR`` or
    ``~/.cache/cembed``) where the run writes there: pre-tokenized data or retrieval embeddings."""
    findings = []
    problem = folder_problem(cfg.train.output_dir)
    if problem:
        findings.append(Finding("train.output_dir", f"{problem}; choose another train.output_dir"))
    if cfg.data.pretokenize or (cfg.eval is not None and cfg.eval.retrieval):
        problem = folder_problem(cache_root("tokenized", cfg.data.cache_dir))
        if problem:
            field = "data.cache_dir" if cfg.data.cache_dir is not None else "data.cache_dir (unset: the default cache)"
            findings.append(Finding(field, f"{problem}; set data.cache_dir to a writable folder"))
    return findings


def check_model(cfg: ModelConfig) -> list[Finding]:
    """The position table against ``model.max_seq_length`` (or the model's own) and the kind's own
    lengths (:meth:`cembed.config.model.ModelConfig.length_fields`: a multi-vector model's
    ``query_length``, ``document_length``, ``query_expansion``), and a pad token."""
    try:
        base, own = transformer_folder(cfg)
        hf = read_json(model_file(base, "config.json", cfg.revision))
    except Exception:  # an unreachable or odd model: loading it reports the problem
        return []
    findings = []
    kind, positions = hf.get("model_type"), hf.get("max_position_embeddings")
    absolute = kind in ABSOLUTE_POSITIONS or hf.get("position_embedding_type") == "absolute"
    length = cfg.max_seq_length or own
    if absolute and isinstance(positions, int):
        limit = positions - ((hf.get("pad_token_id") or 0) + 1 if kind in PADDING_OFFSET else 0)
        if length and length > limit:
            what = f"{length}" if cfg.max_seq_length else f"unset (the model's own {length})"
            findings.append(
                Finding(
                    "model.max_seq_length",
                    f"{what} is longer than the model's position table ({limit} positions, {kind}); "
                    f"set model.max_seq_length to at most {limit}",
                )
            )
        findings += [
            Finding(
                field,
                f"{tokens} is longer than the model's position table ({limit} positions, {kind}); "
                f"set {field} to at most {limit}",
            )
            for field, tokens in cfg.length_fields().items()
            if tokens > limit
        ]
    if hf and not cfg.trust_remote_code:
        findings += _check_padding(base, cfg)
    return findings


def check_pad_multiple(multiple: int | None, cfg: ModelConfig) -> list[Finding]:
    """``batch.pad_to_multiple_of`` against ``model.max_seq_length`` (or the model's own, when it
    sets one): the collator bounds each padded width by that length, so a larger multiple is never
    reached and every batch is padded to the full length instead."""
    if multiple is None:
        return []
    length = cfg.max_seq_length
    if length is None:
        try:
            length = transformer_folder(cfg)[1]
        except Exception:  # an unreachable or odd model: loading it reports the problem
            return []
    if not isinstance(length, int) or multiple <= length:
        return []
    what = f"model.max_seq_length {length}" if cfg.max_seq_length else f"the model's max_seq_length {length}"
    return [
        Finding(
            "batch.pad_to_multiple_of",
            f"{multiple} is above {what}: no batch width can be a multiple of it (every batch would be padded "
            f"to {length}); set it to at most {length} or leave it unset",
        )
    ]


def check_pad_tokenized(cfg: CembedConfig) -> list[Finding]:
    """``batch.pad_to_multiple_of`` with ``data.pretokenize: false``: sentence-transformers' collator then
    tokenizes each batch and pads it to its longest row; it has no such setting, so the multiple would be
    silently ignored (a streamed source is padded by cembed's collator and keeps it)."""
    if cfg.batch.pad_to_multiple_of is None or cfg.data.pretokenize:
        return []
    if any(s.source.stream_options() is not None for s in cfg.data.sources()):
        return []
    return [
        Finding(
            "batch.pad_to_multiple_of",
            f"{cfg.batch.pad_to_multiple_of} has no effect with data.pretokenize: false (sentence-transformers' "
            "collator tokenizes each batch and pads it to its longest row); set data.pretokenize: true or leave "
            "batch.pad_to_multiple_of unset",
        )
    ]


def check_model_shape(cfg: CembedConfig) -> list[Finding]:
    """``loss.matryoshka.dims`` against the model's embedding size and ``model.lora.target_modules``
    against its backbone's modules, both read from its files (:mod:`cembed.model.shape`); nothing when
    the files do not say (loading the model then says the same, in the same words)."""
    from cembed.config.loss import matryoshka_dims_problem
    from cembed.model.lora import target_modules_problem
    from cembed.model.shape import backbone_modules, embedding_dimension

    findings = []
    try:
        if cfg.loss.matryoshka is not None:
            problem = matryoshka_dims_problem(cfg.loss.matryoshka.dims, embedding_dimension(cfg.model))
            if problem is not None:
                findings.append(Finding("loss.matryoshka.dims", problem))
        lora = cfg.model.lora
        if lora is not None and not isinstance(lora.target_modules, str):
            modules = backbone_modules(cfg.model)
            problem = target_modules_problem(modules, lora.target_modules) if modules else None
            if problem is not None:
                findings.append(Finding("model.lora.target_modules", problem))
    except UserError:  # an unknown packaged name: loading the model reports it
        return findings
    return findings


def check_loss_models(loss) -> list[Finding]:
    """Each model the loss loads besides the one trained (its config's ``model_paths``: ``cached_gist``'s
    ``guide``) can be found: a folder with a model, a packaged short name, a hub id in the cache (or
    reachable), without its own code. One that cannot is loaded here, which fails at once with the
    one line ``train`` would give when it builds the loss. One that must be a transformer (the loss
    config's ``transformer_paths``: GIST's guide) and whose first module is not (a StaticEmbedding
    model) is refused with ``train``'s line (:func:`cembed.model.load.guide_problem`)."""
    from cembed.model.load import guide_problem, load_model, remote_code_entries, resolve_model_path
    from cembed.model.shape import first_module_type

    findings = []
    for name in type(loss).model_paths:
        value = getattr(loss, name)
        if not isinstance(value, str):
            continue
        try:
            path = resolve_model_path(value)
            found = any(model_file(path, f, None) for f in ("modules.json", "config.json"))
            if not found or remote_code_entries(path):
                load_model(ModelConfig(name_or_path=value), "cpu", for_training=False)
        except UserError as err:
            field, _, message = str(err).replace("model.name_or_path", f"loss.{name}", 1).partition(": ")
            findings.append(Finding(field, message))
            continue
        first = first_module_type(ModelConfig(name_or_path=value)) if name in type(loss).transformer_paths else None
        if first is not None and first != "Transformer":
            findings.append(Finding(f"loss.{name}", guide_problem(value, first)))
    return findings


def check_hub(train) -> list[Finding]:
    """With ``train.push_to_hub``: the hub can be reached as it will be at the start of training
    (the trainer creates the repo there): not in offline mode (``HF_HUB_OFFLINE`` /
    ``TRANSFORMERS_OFFLINE``), with a token, which the hub answers to (``whoami``)."""
    if not train.push_to_hub:
        return []
    from huggingface_hub import constants

    fix = "or set train.push_to_hub: false (the model is saved in train.output_dir either way)"
    if constants.HF_HUB_OFFLINE:
        return [
            Finding(
                "train.push_to_hub",
                f"the hub is unreachable: offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); run with "
                f"network access and offline mode off, {fix}",
            )
        ]
    from huggingface_hub import get_token, whoami

    if get_token() is None:
        return [
            Finding(
                "train.push_to_hub",
                f"no hub token to create {train.hub_model_id} with: log in (hf auth login) or set HF_TOKEN, {fix}",
            )
        ]
    try:
        whoami()
    except Exception as err:  # noqa: BLE001 - no network, a revoked token: the hub's own words
        return [
            Finding(
                "train.push_to_hub",
                f"the hub does not answer to your token ({first_line(err)}); {fix.removeprefix('or ')}",
            )
        ]
    return []


def _check_padding(base: str, cfg: ModelConfig) -> list[Finding]:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base, revision=cfg.revision, **cfg.tokenizer_kwargs)
    except Exception:
        return []
    if getattr(tok, "pad_token", None) is None:
        eos = getattr(tok, "eos_token", None)
        hint = f"{{pad_token: {json.dumps(eos)}}}" if eos else "{pad_token: <a token of its vocabulary>}"
        return [
            Finding(
                "model.tokenizer_kwargs",
                f"the tokenizer has no padding token, and every batch is padded; set model.tokenizer_kwargs={hint}",
            )
        ]
    return []


# --- resuming: what a checkpoint's run was, and what a resume changes -------------------------------

# Fields a resume may change: they affect logging, saving, evaluation, memory or speed, not what is trained.
SAFE_TO_CHANGE = (
    "train.logging_steps",
    "train.save_steps",
    "train.save_total_limit",
    "train.save_every_minutes",
    "train.stop_grace_seconds",
    "train.output_dir",
    "train.report_to",
    "train.dataloader_num_workers",
    "train.torch_compile",
    "train.nonfinite_loss",
    "train.push_to_hub",
    "train.hub_model_id",
    "train.hub_private_repo",
    "eval",
    "data.pretokenize",
    "data.columns.ignore",  # columns declared not trained were not trained before either
    "data.train.columns.ignore",
    "data.cache_dir",
    "distributed",
    "batch.mini_batch_size",
    "batch.mini_batch_num_tokens",
    "batch.sort_by_length",
    "batch.pad_to_multiple_of",
    "batch.unpad",
    "model.device",
    "model.save_dtype",
    "model.gradient_checkpointing",  # exact (the recomputation replays the RNG), memory and speed only
)

# Fields added after checkpoints were written: a record without one ran as this value runs, so a resume
# that keeps it is no change (a different value still is).
ADDED_FIELDS = {"config.sampler.rule": "no_duplicates"}


def data_fingerprint(dataset) -> str:
    """Row count and a hash of up to 1,000 evenly spaced rows (the texts as trained)."""
    n = len(dataset)
    digest = hashlib.sha256(str(n).encode())
    for i in range(0, n, max(1, n // 1000)):
        digest.update(json.dumps(dataset[i], sort_keys=True, default=str).encode())
    return f"{n} rows, {digest.hexdigest()[:16]}"


def training_record(
    cfg: CembedConfig,
    samples_per_step: int,
    learning_rate: float,
    dataset,
    precision: str | None = None,
    world_size: int = 1,
    contrast_rows: int | None = None,
) -> dict:
    """What a checkpoint records about its run: the config (JSON) as run, the samples per step, the
    effective LR, the training data's fingerprint and how a step was split over processes. The
    config's ``batch.per_device_train_batch_size`` is the rows each process trains (derived from
    ``batch.global_batch_size`` when that is set), so a resume names the per-device batch that changed.

    Args:
        precision: the resolved precision (``Plan.precision``), recorded as the config's
            ``model.precision`` so that ``auto`` and the precision it resolved to compare equal on
            resume; None records ``cfg.model.precision`` as written.
        world_size: the processes the run trains on (``Plan.world_size``).
        contrast_rows: the rows an anchor is contrasted with (``Plan.contrast_rows``; None: not recorded).
    """
    config = cfg.model_dump(mode="json")
    # the rows each process trains: with batch.global_batch_size, derived (not the schema's unused default)
    config["batch"]["per_device_train_batch_size"] = per_device_batch(cfg.batch, world_size)
    if precision is not None:
        config["model"]["precision"] = precision
    return {
        "config": config,
        "samples_per_step": samples_per_step,
        "effective_learning_rate": learning_rate,
        "data_fingerprint": data_fingerprint(dataset),
        "world_size": world_size,
        "contrast_rows": contrast_rows,
    }


def flatten(value, prefix: str = "") -> dict:
    """A nested dict (a config dump) as ``{"section.field": value}``; lists stay values."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def resume_differences(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """Compare two :func:`training_record` s.

    How a step is split over processes may change when what is trained does not: the world size, and
    :data:`SPLIT_FIELDS` while ``samples_per_step`` stays. The per-device batch is named only where a
    record set it (``batch.per_device_train_batch_size``): two ``batch.global_batch_size`` runs derive
    it from the world size, whose change is named. The split does change training when the
    rows an anchor is contrasted with change (``loss.gather_across_devices: false`` with several
    processes): refused. A new world size re-seeds the per-process RNG streams (:func:`rng_reseeded`).

    Returns:
        ``(refused, safe)``: each difference as ``"field old -> new"``; ``refused`` changes what is
        trained (batch, LR, schedule, loss, data, seed, model ...), ``safe`` only how it is logged,
        saved, evaluated, run or split over processes (:data:`SAFE_TO_CHANGE`).
    """
    a, b = _per_device_as_run(flatten(old)), _per_device_as_run(flatten(new))
    a |= {key: value for key, value in ADDED_FIELDS.items() if key not in a and key in b}
    same_samples = a.get("samples_per_step") == b.get("samples_per_step")
    refused, safe = [], []
    for key in sorted(set(a) | set(b)):
        if key in CARRIED or a.get(key) == b.get(key):
            continue
        if key == PER_DEVICE and a.get(GLOBAL) is not None and b.get(GLOBAL) is not None:
            continue  # derived from the global batch by the world size on both sides: the world size's change
        if key in SPLIT_RECORD and (a.get(key) is None or b.get(key) is None):
            continue  # (a record from before the split was recorded: nothing to compare it with)
        field = key.removeprefix("config.")
        if key == "contrast_rows":
            if same_samples:  # else the samples' change is the refusal
                refused.append(_contrast_change(a, b))
            continue
        text = f"{field} {a.get(key)!r} -> {b.get(key)!r}"
        ok = any(field == s or field.startswith(s + ".") for s in SAFE_TO_CHANGE)
        ok = ok or key == "world_size" or (field in SPLIT_FIELDS and same_samples)
        (safe if ok else refused).append(text)
    if a.get("world_size") and b.get("world_size") and a["world_size"] != b["world_size"]:
        safe.append(rng_reseeded(a["world_size"], b["world_size"]))
    return refused, safe


def _per_device_as_run(record: dict) -> dict:
    """A flattened record whose config set ``batch.global_batch_size`` with the per-device batch its
    run derived (``global / (world_size x accumulation)``): records written before the derived value
    was recorded hold the schema's unused default there, which a resume would name as a change."""
    total, world = record.get(GLOBAL), record.get("world_size")
    accumulation = record.get("config.batch.gradient_accumulation_steps") or 1
    if total is None or not world:
        return record
    return {**record, PER_DEVICE: total // (world * accumulation)}


def freezes_unused(old: dict | None, world_size: int) -> bool:
    """Whether the run freezes the parameters that get no gradient (the pooler under mean pooling):
    a run that began on several processes does (DDP needs no unused-parameter search then), one that
    began on one process does not; a resume keeps the checkpoint's choice, so the optimizer state
    (which then holds those parameters or not) loads on any world size.

    Args:
        old: the checkpoint's :func:`training_record` (None: a fresh run).
        world_size: this run's processes.
    """
    if old is None:
        return world_size > 1
    if "frozen_unused_parameters" in old:
        return bool(old["frozen_unused_parameters"])
    return (old.get("world_size") or world_size) > 1  # older records: the world size decided it


# How a step's samples are split over the processes: a resume may change them when samples_per_step stays.
SPLIT_FIELDS = ("batch.per_device_train_batch_size", "batch.global_batch_size")
PER_DEVICE, GLOBAL = (f"config.{f}" for f in SPLIT_FIELDS)
# Record keys older checkpoints lack.
SPLIT_RECORD = ("world_size", "contrast_rows")
# Record keys a resume carries over from its checkpoint (:func:`freezes_unused`), never a change.
CARRIED = ("frozen_unused_parameters",)


def rng_reseeded(old_world: int, new_world: int) -> str:
    """The resume change a new world size brings: each process's RNG stream (dropout masks) is re-seeded."""
    return (
        f"RNG streams (dropout) re-seeded per rank: the checkpoint holds {old_world} process(es)' RNG states, "
        f"this run has {new_world}"
    )


def _contrast_change(old: dict, new: dict) -> str:
    return (
        f"loss.gather_across_devices: each process contrasts only its own rows, so the split over "
        f"{old.get('world_size')} -> {new.get('world_size')} process(es) changes the rows an anchor is contrasted "
        f"with ({old['contrast_rows']} -> {new['contrast_rows']}); resume on {old.get('world_size')} process(es), "
        "or set loss.gather_across_devices: true for a fresh run"
    )


def check_resume(checkpoint: str, old: dict | None, new: dict) -> list[str]:
    """Refuse a resume whose config changes what is trained; return the safe changes it applies.

    Args:
        old: the checkpoint's :func:`training_record` (None: an older checkpoint, nothing to compare).
        new: this run's record.

    Raises:
        UserError: naming every change to batch, LR, schedule, loss, data, seed, model or length.
    """
    if old is None:
        return []
    refused, safe = resume_differences(old, new)
    if refused:
        raise UserError(
            f"cannot resume {checkpoint} with a changed config: {'; '.join(refused)}. Its optimizer, LR schedule "
            "and sampler order belong to the checkpoint's values: resume without these changes, or start fresh "
            "with --overwrite"
        )
    return safe
