"""The ``data`` config section: training sources (a registry of kinds: file, hub, BEIR) and the column mapping."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ErrorType

from cembed.config.base import Strict as _Strict
from cembed.config.columns import ColumnMap
from cembed.config.prompts import PromptName, PromptsConfig, merged_prompts
from cembed.config.sources import SOURCE_CONFIGS, SourceConfig, infer_source_kind


class SamplingConfig(_Strict):
    """How a run with several training sources picks the source of each batch (every batch holds
    rows of one source only; see :class:`cembed.data.batching.full_table.NoDuplicatesSampler`)."""

    strategy: Literal["proportional", "round_robin", "weighted"] | None = Field(
        None,
        description="proportional (default): every source's batches once per epoch; round_robin: one batch of "
        "each source in turn until one runs out; weighted: shares of batches by `weights`",
    )
    weights: dict[str, PositiveFloat] | None = Field(
        None, description="source name -> share of batches (strategy weighted; implied when given)"
    )

    @model_validator(mode="after")
    def _weights_need_weighted(self) -> SamplingConfig:
        if self.weights is not None and self.strategy not in (None, "weighted"):
            raise ValueError(f"weights are only used by strategy weighted (got strategy {self.strategy}); drop one")
        if self.strategy == "weighted" and not self.weights:
            raise ValueError("strategy weighted needs weights: {<source name>: <share>, ...}")
        return self

    @property
    def resolved_strategy(self) -> str:
        """The strategy in effect: ``weighted`` when weights are given, else ``proportional`` by default."""
        return self.strategy or ("weighted" if self.weights else "proportional")


def source_keys() -> set[str]:
    """The keys that make a mapping under ``data.train`` one source (else it maps names to
    sources): every registered kind's fields and shorthand key."""
    keys = {"kind"}
    for cls in SOURCE_CONFIGS.values():
        keys |= set(cls.model_fields) | ({cls.shorthand} if cls.shorthand else set())
    return keys


def _source_dict(train: Any, base: Path | None, where: str) -> Any:
    """One source as the dict pydantic validates: ``file.jsonl`` -> ``{path: ...}``, a kind's
    shorthand (``{beir: folder}``) -> ``{kind: beir, path: folder}``, ``kind`` inferred
    (:func:`infer_source_kind`) when not given."""
    if isinstance(train, str):
        train = {"path": train}
    for kind, cls in SOURCE_CONFIGS.items():
        key = cls.shorthand
        if key is not None and isinstance(train, dict) and key in train:
            # e.g. `train: {beir: folder, split: ...}`, the BEIR source's YAML form.
            if "path" in train or train.get("kind", kind) != kind:
                raise ValueError(f"{where}: give {cls.shorthand_hint} without `path` or `kind`")
            train = {k: v for k, v in train.items() if k != key} | {"kind": kind, "path": train[key]}
    if isinstance(train, dict) and "kind" not in train:
        path = train.get("path")
        # Without a usable path any kind reports the same error (missing or not a string); a list of
        # paths is a file source's shards.
        kind = infer_source_kind(path, base) if isinstance(path, str) else "file"
        train = {"kind": kind, **train}
    return train


_PYDANTIC_ERROR_TYPES = frozenset(get_args(ErrorType))


def _validated_source(item: Any, loc: tuple[Any, ...], errors: list[dict], named: bool = False) -> Any:
    """``item`` (one source as :func:`_source_dict` leaves it) validated by its kind's class; its
    errors are added to ``errors`` at ``loc``, in the form pydantic gives a discriminated union's.
    ``named``: an entry of a list gets its :meth:`~SourceConfig.default_name` when it sets no name,
    from its fields as written (before paths are resolved), so names stay what the user sees."""
    if isinstance(item, SourceConfig):
        return item
    if not isinstance(item, dict):
        errors.append({"type": "model_attributes_type", "loc": loc, "input": item})
        return None
    kind = item.get("kind")
    cls = SOURCE_CONFIGS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        expected = ", ".join(repr(k) for k in SOURCE_CONFIGS)
        ctx = {"discriminator": "'kind'", "tag": str(kind), "expected_tags": expected}
        errors.append({"type": "union_tag_invalid", "loc": loc, "input": item, "ctx": ctx})
        return None
    try:
        source = cls.model_validate(item)
    except ValidationError as err:
        for e in err.errors():
            # A kind's own PydanticCustomError keeps its type and message (pydantic rebuilds only its own types).
            kind_error = e["type"] not in _PYDANTIC_ERROR_TYPES
            errors.append(
                {**e, "loc": (*loc, *e["loc"])}
                | ({"type": PydanticCustomError(e["type"], e["msg"])} if kind_error else {})
            )
        return None
    if named and source.name is None:
        source.name = source.default_name()
    return source


@dataclass(frozen=True)
class TrainSource:
    """One training source as the run uses it: its name, where it comes from, its column mapping
    and row cap (its own, else ``data.columns`` / ``data.max_samples``)."""

    name: str
    source: SourceConfig
    columns: ColumnMap
    max_samples: int | None
    key: str  # the config field that holds it: data.train or data.train.<name>
    prompts: PromptsConfig | None = None  # its own prompts over data.prompts, role by role (None: data.prompts)
    own_prompts: bool = False  # the source sets prompts of its own (messages name <key>.prompts)
    columns_given: bool = False  # the config maps columns (data.columns or the source's own), not the default


class DataConfig(_Strict):
    """The training data: where it comes from, which columns feed the loss, how it is checked."""

    train: SerializeAsAny[SourceConfig] | list[SerializeAsAny[SourceConfig]] = Field(
        description="a file path (or its shards: a folder, a glob), a hub id, {kind, path, split, subset} or "
        "{beir, split}; or several sources: "
        "a list of them, or a mapping name -> source"
    )
    columns: ColumnMap = Field(default_factory=ColumnMap, description="data column -> loss role")
    prompts: PromptsConfig | None = Field(
        None, description="per-role prompts; unset: the model's own query/document prompts (if any)"
    )
    max_samples: PositiveInt | None = Field(None, description="train on the first N rows only (of each source)")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="several sources: which source each batch comes from"
    )
    drop_invalid_rows: bool = Field(False, description="drop rows with an empty/over-1-MB cell instead of refusing")
    pretokenize: bool = Field(True, description="tokenize once, cache on disk, only pad in the collator")
    cache_dir: str | None = Field(None, description="default $CEMBED_CACHE_DIR or ~/.cache/cembed")
    num_proc: PositiveInt | Literal["auto"] = Field(
        "auto",
        description="processes that pre-tokenize; auto: every core of this node for 50k+ rows, "
        "1 below (starting workers costs more than it saves)",
    )

    @model_validator(mode="before")
    @classmethod
    def _path_shorthand(cls, data: Any, info: ValidationInfo) -> Any:
        # `train: file.jsonl` is shorthand for `train: {path: file.jsonl}`; a `train` without `kind`
        # gets it from infer_source_kind (config_from_dict passes the config's folder as context base).
        # Several sources: a list of sources, or a mapping name -> source (the key becomes `name`).
        if isinstance(data, dict):
            data = dict(data)
            train = data.get("train")
            base = (info.context or {}).get("base")
            if isinstance(train, dict) and train and not (set(train) & source_keys()):
                named = []
                for name, item in train.items():
                    item = _source_dict(item, base, f"data.train.{name}")
                    named.append({**item, "name": name} if isinstance(item, dict) else item)
                train = named
            if isinstance(train, list):
                train = [_source_dict(item, base, f"data.train.{i}") for i, item in enumerate(train)]
            elif train is not None:
                train = _source_dict(train, base, "data.train")
            if train is not None:
                data["train"] = train
        return data

    @field_validator("train", mode="before")
    @classmethod
    def _source_classes(cls, value: Any) -> Any:
        # `kind` picks the registered class, which then validates (only) its own fields; its errors
        # keep their location (data.train.<field>, data.train.<i>.<field>).
        errors: list[dict] = []
        if isinstance(value, list):
            value = [_validated_source(item, (i,), errors, named=True) for i, item in enumerate(value)]
        else:
            value = _validated_source(value, (), errors)
        if errors:
            raise ValidationError.from_exception_data("SourceConfig", errors)
        return value

    @model_validator(mode="after")
    def _names_and_weights(self) -> DataConfig:
        sources = self.sources()
        names = [s.name for s in sources]
        if isinstance(self.train, list) and not sources:
            raise ValueError("train: the list of sources is empty; give at least one")
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"train: two sources are named {dup!r}; give each a distinct `name`")
        _check_kind_rules(self, sources)
        weights = self.sampling.weights
        if weights is not None:
            if set(weights) != set(names):
                raise ValueError(
                    f"sampling.weights: names {sorted(weights)} must be exactly the sources' names {sorted(names)}"
                )
        return self

    def sources(self) -> list[TrainSource]:
        """The training sources in config order, each with its effective columns and ``max_samples``."""
        items = self.train if isinstance(self.train, list) else [self.train]
        out = []
        for item in items:
            name = item.name or item.default_name()
            key = f"data.train.{name}" if isinstance(self.train, list) else "data.train"
            columns = item.columns if item.columns is not None else self.columns
            max_samples = item.max_samples if item.max_samples is not None else self.max_samples
            prompts = merged_prompts(item.prompts, self.prompts)
            given = item.columns is not None or "columns" in self.model_fields_set
            out.append(TrainSource(name, item, columns, max_samples, key, prompts, item.prompts is not None, given))
        return out

    def max_columns(self) -> int:
        """The most columns one source maps (anchor, positive and its negatives): the widest layout,
        the worst case of a step (sources may map different numbers of negatives)."""
        return max(2 + len(s.columns.negatives) for s in self.sources())


def _check_kind_rules(cfg: DataConfig, sources: list[TrainSource]) -> None:
    """What a source's kind declares about the rest of ``data``: a kind that :attr:`~SourceConfig.trains_alone`
    is the only source; one that :attr:`~SourceConfig.is_pretokenized` (token ids, no text: a prepared
    source) needs ``pretokenize`` on. ``data.columns`` may stay (the config that prepared it maps the
    same roles; the data stage checks that they are the manifest's columns)."""
    alone = next((s.source for s in sources if s.source.trains_alone), None)
    if alone is not None and len(sources) > 1:
        hint = " (prepare the others into it)" if alone.is_pretokenized else ""
        raise ValueError(f"train: a {alone.kind} source trains alone; give it as the only source{hint}")
    ids = next((s.source for s in sources if s.source.is_pretokenized), None)
    if ids is not None and not cfg.pretokenize:
        raise ValueError(
            f"pretokenize: false, but a {ids.kind} source holds token ids only (no text to tokenize); remove it"
        )


def streaming_conflict(
    data: DataConfig, max_steps: int | None, workers: int | str, no_duplicates: bool, rule: str = "no_duplicates"
) -> str | None:
    """Why ``data`` cannot train from its streamed source (``data.train.streaming``) with the rest of
    the config (``train.max_steps``, ``train.dataloader_num_workers``, ``sampler.no_duplicates``,
    ``sampler.rule``), as one line naming the field and the fix; None when nothing streams or nothing
    conflicts."""
    streamed = [s for s in data.sources() if s.source.stream_options() is not None]
    if not streamed:
        return None
    key = f"{streamed[0].key}.streaming"
    if len(data.sources()) > 1:
        return f"{key}: a streaming source must be the only training source; train it alone or drop streaming"
    if max_steps is None:
        return f"{key}: a stream has no length; set train.max_steps (instead of train.num_train_epochs)"
    prompts = streamed[0].prompts
    for role in PromptsConfig.model_fields if prompts is not None else ():
        value = getattr(prompts, role)
        if isinstance(value, PromptName) or (value and (value if isinstance(value, str) else value.text)):
            where = f"{streamed[0].key}.prompts" if streamed[0].own_prompts else "data.prompts"
            return (
                f"{where}.{role}: a streaming source is tokenized without prompts; remove it (or set it to '') "
                "or drop streaming"
            )
    if data.drop_invalid_rows:
        return (
            f"data.drop_invalid_rows: a streaming source checks only its first {streamed[0].source.stream_options().check_rows} "
            "rows and cannot drop rows later; set it to false or drop streaming"
        )
    if not no_duplicates:
        return (
            f"sampler.no_duplicates: false: a streaming source always batches without duplicates (over "
            f"{key}.window_batches batches); remove it or drop streaming"
        )
    if rule != "no_duplicates":
        return (
            f"sampler.rule: {rule}: a streaming source always batches by the windowed no-duplicates rule; "
            "remove it or drop streaming"
        )
    if workers != "auto" and int(workers) > 1:
        return (
            f"train.dataloader_num_workers: {workers}: a stream is read by one data-loader process (each worker would "
            "read the whole stream); set it to 0 or 1"
        )
    return None
