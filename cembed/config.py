"""YAML config -> validated pydantic model.

``load_config(path, overrides)`` is the only entry point: it parses the YAML (syntax errors name the
line and column), applies ``dotted.key=value`` overrides (values parsed as YAML), validates the
result with pydantic (unknown keys are rejected with a did-you-mean), and resolves every path
relative to the config file. Every failure is a :class:`cembed.errors.UserError` whose message names
the file, line and dotted field.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from cembed.errors import UserError

# Extensions read as local files; anything else that does not exist on disk is taken as a hub id.
LOCAL_EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".tsv", ".parquet", ".csv.gz", ".tsv.gz")

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "warmup_stable_decay",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Which model to fine-tune and how to run it."""

    name_or_path: str = "all-MiniLM-L6-v2"
    max_seq_length: PositiveInt | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"


class DataSource(_Strict):
    """A local file (.jsonl[.gz], .json, .csv, .tsv, .parquet) or a datasets hub id."""

    path: str
    split: str = "train"
    subset: str | None = None

    @property
    def is_local(self) -> bool:
        return Path(self.path).exists() or self.path.lower().endswith(LOCAL_EXTENSIONS)


class ColumnMap(_Strict):
    """Source column names for the roles the loss expects; every other column is dropped."""

    anchor: str = "anchor"
    positive: str = "positive"
    negatives: list[str] = Field(default_factory=list)


class DataConfig(_Strict):
    train: DataSource
    columns: ColumnMap = Field(default_factory=ColumnMap)
    max_samples: PositiveInt | None = None
    drop_invalid_rows: bool = False
    pretokenize: bool = True  # tokenize once, cache on disk, only pad in the collator
    cache_dir: str | None = None  # default $CEMBED_CACHE_DIR or ~/.cache/cembed

    @model_validator(mode="before")
    @classmethod
    def _path_shorthand(cls, data: Any) -> Any:
        # `train: file.jsonl` is shorthand for `train: {path: file.jsonl}`.
        if isinstance(data, dict):
            data = dict(data)
            if isinstance(data.get("train"), str):
                data["train"] = {"path": data["train"]}
        return data


class BatchConfig(_Strict):
    per_device_train_batch_size: PositiveInt = 64
    mini_batch_size: PositiveInt | Literal["auto"] = 32  # auto: `cembed train` probes it first
    gradient_accumulation_steps: PositiveInt = 1
    drop_last: bool = True
    mini_batch_num_tokens: PositiveInt | None = None  # pack mini-batches by non-padding tokens instead
    sort_by_length: bool = True  # sort each column by length before cutting mini-batches

    @field_validator("mini_batch_size", mode="before")
    @classmethod
    def _auto_or_positive(cls, value: Any) -> Any:
        # One clear message instead of pydantic's two union-branch errors.
        if value == "auto":
            return value
        try:
            return TypeAdapter(PositiveInt).validate_python(value)
        except ValidationError as err:
            raise ValueError(f"{err.errors()[0]['msg']}, or auto (run the probe)") from None

    @model_validator(mode="after")
    def _mini_le_batch(self) -> BatchConfig:
        if self.mini_batch_size != "auto" and self.mini_batch_size > self.per_device_train_batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) is larger than per_device_train_batch_size "
                f"({self.per_device_train_batch_size}); set it to at most the batch size"
            )
        return self


class OptimConfig(_Strict):
    learning_rate: PositiveFloat = 2e-5
    base_batch_size: PositiveInt = 32
    lr_scaling: Literal["sqrt", "linear", "none"] = "sqrt"
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.01, ge=0.0)
    lr_scheduler_type: Literal[SCHEDULERS] = "linear"  # type: ignore[valid-type]


class LossConfig(_Strict):
    name: Literal["cached_mnrl", "mnrl"] = "cached_mnrl"
    scale: PositiveFloat = 20.0
    symmetric: bool = False
    # Gather every rank's embeddings so each anchor is contrasted with the whole global batch.
    # None: true when training runs in more than one process.
    gather_across_devices: bool | None = None


class SamplerConfig(_Strict):
    no_duplicates: bool = True


REPORT_TO = ("none", "all", "tensorboard", "trackio", "wandb", "mlflow", "comet_ml", "clearml", "neptune", "dvclive", "swanlab")


class TrainConfig(_Strict):
    num_train_epochs: PositiveFloat | None = None
    max_steps: PositiveInt | None = None
    seed: int = 42
    output_dir: str = "runs/cembed"
    logging_steps: PositiveInt = 10
    save_steps: PositiveInt | None = None
    save_total_limit: PositiveInt | None = None  # keep at most this many checkpoints
    nonfinite_loss: Literal["stop", "skip"] = "stop"  # on a NaN/inf loss: stop, or skip the step and count it
    dataloader_num_workers: int = Field(0, ge=0)
    # Experiment trackers, through the trainer's own integrations (each needs its package installed).
    report_to: list[Literal[REPORT_TO]] = Field(default_factory=lambda: ["none"])  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _report_to_list(cls, data: Any) -> Any:
        # `report_to: tensorboard` is shorthand for `report_to: [tensorboard]`.
        if isinstance(data, dict) and isinstance(data.get("report_to"), str):
            data = {**data, "report_to": [data["report_to"]]}
        return data

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if self.num_train_epochs is None and self.max_steps is None:
            self.__dict__["num_train_epochs"] = 1.0
        return self


class RetrievalEvalSet(_Strict):
    """A BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/<split>.tsv) and the qrels split."""

    path: str
    split: str = "test"
    name: str | None = None  # metric prefix; default <folder name>-<split>


class StsEvalSet(_Strict):
    """An STS file: STS Benchmark TSV, 3-column TSV (sentence1, sentence2, score) or JSONL."""

    path: str
    name: str | None = None  # metric prefix; default the file name without extension


class EvalConfig(_Strict):
    """Evaluation before, during (every ``eval_steps``) and after training."""

    retrieval: list[RetrievalEvalSet] = Field(default_factory=list)
    sts: list[StsEvalSet] = Field(default_factory=list)
    eval_steps: PositiveInt | None = None  # None: evaluate only before and after training
    metric_for_best_model: str | None = None  # e.g. scifact-test_cosine_ndcg@10; keeps the best checkpoint
    greater_is_better: bool | None = None  # default: False for a loss, True otherwise
    save_total_limit: PositiveInt | None = 2  # checkpoints kept; the best one is never deleted
    batch_size: PositiveInt = 32  # encoding batch size

    @model_validator(mode="before")
    @classmethod
    def _path_shorthand(cls, data: Any) -> Any:
        # `retrieval: dir` / `sts: [file, ...]` are shorthand for {path: ...} entries.
        if isinstance(data, dict):
            data = dict(data)
            for key in ("retrieval", "sts"):
                value = data.get(key)
                if isinstance(value, (str, dict)):
                    value = [value]
                if isinstance(value, list):
                    data[key] = [{"path": v} if isinstance(v, str) else v for v in value]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        if not self.retrieval and not self.sts:
            raise ValueError("the eval section needs at least one 'retrieval' folder or 'sts' file")
        if self.metric_for_best_model is not None and self.eval_steps is None:
            raise ValueError("metric_for_best_model needs eval_steps (checkpoints are compared at each evaluation)")
        return self


class CembedConfig(_Strict):
    """The whole config file. Every section has defaults except ``data.train``."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig | None = None


# ----------------------------------------------------------------------------------------------
# Loading


def _line_index(text: str) -> dict[tuple[str, ...], int]:
    """Map each dotted key path in a YAML document to its 1-based line, for error messages."""
    index: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = prefix + (str(key_node.value),)
                index[path] = key_node.start_mark.line + 1
                walk(value_node, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                index[prefix + (str(i),)] = item.start_mark.line + 1
                walk(item, prefix + (str(i),))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return index
    if root is not None:
        walk(root, ())
    return index


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text; a syntax error becomes a UserError naming ``source``, line and column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{where}: YAML syntax error: {problem}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``dotted.key=value`` set (value parsed as YAML).

    Raises:
        UserError: an override without ``=``, or one that descends into a non-mapping value.
    """
    out = yaml.safe_load(yaml.safe_dump(data)) if data else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"override {item!r}: expected section.field=value, e.g. batch.mini_batch_size=64")
        value = parse_yaml(raw, f"override {item!r}")
        parts = key.strip().split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names valid at ``loc`` (the parent of an unknown key), for did-you-mean."""
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        current = next((c for c in candidates if issubclass(c, BaseModel)), None)
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


def _format_validation_error(
    err: ValidationError, source: str, lines: dict[tuple[str, ...], int], overrides: list[str] | None = None
) -> str:
    by_key = {item.partition("=")[0].strip(): item for item in overrides or []}
    messages = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        # pydantic reports union members as extra loc parts (e.g. 'DataSource'); drop them.
        loc = tuple(p for p in loc if not p[:1].isupper())
        dotted = ".".join(loc) or "(top level)"
        line = lines.get(loc) or lines.get(loc[:-1])
        where = f"{source}:{line}" if line else source
        override = next((by_key[k] for k in (".".join(loc[:i]) for i in range(len(loc), 0, -1)) if k in by_key), None)
        if override is not None:  # the value came from the command line, not from the file
            where = f"override {override!r}"
        if e["type"] == "extra_forbidden":
            known = _known_fields(CembedConfig, loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.5)
            hint = f"; did you mean '{'.'.join(loc[:-1] + (close[0],))}'?" if close else ""
            allowed = f" (allowed: {', '.join(known)})" if known and not close else ""
            messages.append(f"{where}: unknown key '{dotted}'{hint}{allowed}")
        elif e["type"] == "missing":
            messages.append(f"{where}: missing required field '{dotted}'")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            shown = e.get("input")
            got = f" (got {shown!r})" if not isinstance(shown, (dict, list)) else ""
            messages.append(f"{where}: {dotted}: {msg}{got}")
    return "\n".join(messages[:3]) + (f"\n... and {len(messages) - 3} more" if len(messages) > 3 else "")


def _resolve_path(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def resolve_paths(cfg: CembedConfig, base: Path) -> CembedConfig:
    """Make local paths absolute relative to ``base`` (the config file's folder)."""
    cfg = cfg.model_copy(deep=True)
    source = cfg.data.train
    if source.is_local or (base / source.path).exists():
        source.path = _resolve_path(source.path, base)
    cfg.train.output_dir = _resolve_path(cfg.train.output_dir, base)
    if cfg.data.cache_dir is not None:
        cfg.data.cache_dir = _resolve_path(cfg.data.cache_dir, base)
    if cfg.eval is not None:
        for item in [*cfg.eval.retrieval, *cfg.eval.sts]:
            item.path = _resolve_path(item.path, base)
    model_path = base / cfg.model.name_or_path
    if not Path(cfg.model.name_or_path).is_absolute() and model_path.exists():
        cfg.model.name_or_path = str(model_path.resolve())
    return cfg


def config_from_dict(
    data: Any, source: str = "<config>", base: Path | None = None, text: str = "", overrides: list[str] | None = None
) -> CembedConfig:
    """Validate a mapping into a :class:`CembedConfig`; errors name ``source``, line and field."""
    if data is None:
        raise UserError(f"{source}: the config is empty; it needs at least a 'data.train' file")
    if not isinstance(data, dict):
        raise UserError(
            f"{source}: the config must be a mapping of sections (model, data, batch, ...), "
            f"not a {type(data).__name__}"
        )
    try:
        cfg = CembedConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation_error(err, source, _line_index(text), overrides)) from None
    return resolve_paths(cfg, base or Path.cwd())


def load_config(path: str | Path, overrides: list[str] | None = None) -> CembedConfig:
    """Read, override, validate and path-resolve a YAML config.

    Args:
        path: the YAML file.
        overrides: ``section.field=value`` strings, values parsed as YAML, applied after the file.

    Returns:
        The validated config with absolute local paths.

    Raises:
        UserError: unreadable file, YAML syntax error (line:column), unknown key (did-you-mean),
            a wrong type or range (dotted field and line).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a folder; give the YAML config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read the config ({err.__class__.__name__}: {err})") from None
    data = parse_yaml(text, str(path))
    if overrides:
        if data is not None and not isinstance(data, dict):
            raise UserError(f"{path}: the config must be a mapping of sections, not a {type(data).__name__}")
        data = apply_overrides(data or {}, overrides)
    return config_from_dict(data, str(path), path.resolve().parent, text, overrides)
