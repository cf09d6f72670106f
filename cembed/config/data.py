"""The ``data`` config section: training sources (a registry of kinds: file, hub, BEIR) and the column mapping."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from pydantic import (
    Field,
    NonNegativeInt,
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
from cembed.config.base import register_by_literal, registered
from cembed.samples import is_sample

# Extensions read as local files; anything else that does not exist on disk is taken as a hub id.
LOCAL_EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".tsv", ".parquet", ".csv.gz", ".tsv.gz")
# A file source's path holding one of these is a glob pattern (a hub id never holds them).
GLOB_CHARACTERS = "*?["


def is_glob(path: str) -> bool:
    """Whether a data path is a glob pattern (``data/*.jsonl.gz``, ``shards/**/*.parquet``)."""
    return any(c in path for c in GLOB_CHARACTERS)


class ColumnMap(_Strict):
    """Source column names for the roles the loss expects; every other column is dropped."""

    anchor: str = Field("anchor", description="column holding the anchor (query) text")
    positive: str = Field("positive", description="column holding the positive text for the anchor")
    negatives: list[str] = Field(
        default_factory=list, description="columns holding hard negatives, one role (negative_1..k) each"
    )
    # None, not []: a checkpoint recorded before this field compares equal on resume.
    ignore: list[str] | None = Field(
        None, description="columns known not to be text for training (ids, labels): dropped without a warning"
    )

    @model_validator(mode="after")
    def _ignored_not_mapped(self) -> ColumnMap:
        roles = {self.anchor: "anchor", self.positive: "positive"} | {n: "a negative" for n in self.negatives}
        mapped = next((n for n in self.ignore or () if n in roles), None)
        if mapped is not None:
            raise ValueError(f"ignore: column {mapped!r} is mapped as {roles[mapped]}; remove it from ignore")
        return self


class PromptName(_Strict):
    """A prompt of the model, by name: a key of its ``prompts`` (``config_sentence_transformers.json``)."""

    name: str = Field(min_length=1, description="the model's prompt name, e.g. query or document")


class PromptText(_Strict):
    """A literal prompt; the YAML ``{text: ...}`` form forces literal text where a plain string
    would be refused for equalling one of the model's prompt names."""

    text: str = Field(description="prepended verbatim to every text of the role")


# A plain string is literal text; {name: ...} names a model prompt; {text: ...} is literal text.
Prompt = str | PromptName | PromptText


class PromptsConfig(_Strict):
    """Per-role prompts prepended to every text before tokenization (sentence-transformers' prompts).

    An unset role uses the model's own prompt: ``query`` for the anchor, the first non-empty of
    ``document`` / ``passage`` / ``corpus`` for positives and negatives, else the model's
    ``default_prompt_name``, else none (see :func:`cembed.model.prompts.resolve_prompts`).
    """

    anchor: Prompt | None = Field(None, description="the anchor's (query's) prompt: text, {name: ...} or {text: ...}")
    positive: Prompt | None = Field(None, description="the positive's (document's) prompt")
    negatives: Prompt | None = Field(None, description="the hard negatives' prompt (default: the positive's)")


class SourceOptions(_Strict):
    """What every training source may set for itself (with several sources, each its own)."""

    name: str | None = Field(
        None, description="how summaries and messages name the source (default: from its path; a mapping's key)"
    )
    columns: ColumnMap | None = Field(None, description="this source's column mapping (default: data.columns)")
    max_samples: PositiveInt | None = Field(
        None, description="this source's first N rows only (default: data.max_samples)"
    )
    prompts: PromptsConfig | None = Field(
        None,
        description="this source's prompts (e.g. its task instruction); a role it leaves unset takes data.prompts', "
        "then the model's own",
    )


class SourceConfig(SourceOptions):
    """A kind of training source: the base every source config extends. A kind answers its own
    questions, so a new kind is one subclass here (registered with :func:`register_source_config`)
    plus one loader (``cembed.data.sources.register_source_loader``), nothing else.

    A subclass declares ``kind: Literal["<kind>"] = "<kind>"``, its own fields, and answers:

    * :attr:`label`: how messages and the run summary name the source;
    * :meth:`default_name`: the source's name when it sets none;
    * :attr:`path_fields`: the fields that hold local paths, resolved against the config file's
      folder (``cembed:<name>`` -> the packaged data) by ``cembed.config.file.resolve_paths``;
    * :attr:`generated_columns`: the columns its loader adds itself (not the user's data, so not
      reported as unmapped);
    * :attr:`shorthand` / :attr:`shorthand_hint`, optionally: a YAML key that names the kind and
      holds its path (``{beir: folder}`` -> ``{kind: beir, path: folder}``).
    """

    kind: str = Field(description="source kind")

    path_fields: ClassVar[tuple[str, ...]] = ()
    generated_columns: ClassVar[frozenset[str]] = frozenset()
    shorthand: ClassVar[str | None] = None
    shorthand_hint: ClassVar[str] = ""  # the shorthand's form, for the message when it is mixed up

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        raise NotImplementedError(f"{type(self).__name__} must define label")

    def default_name(self) -> str:
        """The source's name when it sets none (from its fields as written, before paths are resolved)."""
        raise NotImplementedError(f"{type(self).__name__} must define default_name")


def _strip_extension(name: str) -> str:
    for ext in sorted(LOCAL_EXTENSIONS, key=len, reverse=True):
        if name.lower().endswith(ext):
            return name[: -len(ext)]
    return name


class StreamingOptions(_Strict):
    """A file source read as a stream (datasets' streaming loader, each rank its own part), for corpora
    past what a node can memory-map: tokenized and batched as it is read, a batch never holding two rows
    that share a text, over a window of batches (see docs/multi-gpu.md); rows are not counted nor
    cached. Needs `train.max_steps`; refuses prompts, several sources, `data.drop_invalid_rows`,
    `sampler.no_duplicates: false` and more than 1 data-loader worker. The run reads pass after pass
    (each reshuffled) until `train.max_steps`; `--resume` re-reads the stream up to where it stopped."""

    window_batches: NonNegativeInt = Field(
        4,
        description="a row refused for sharing a text with its batch may join the next W batches, else it is "
        "dropped (counted in run_summary.json); 0: dropped at once",
    )
    shuffle_buffer: NonNegativeInt = Field(
        0,
        description="rows of datasets' shuffle buffer (shards shuffled too), reseeded every pass; 0: file order, "
        "no shuffle (a sorted file then drops many rows: set e.g. 100000)",
    )
    check_rows: PositiveInt = Field(
        1000, description="rows read first (validate and train) to check the columns and cells; the rest is not checked"
    )


class FileSource(SourceConfig):
    """A local data file: .jsonl[.gz], .json[.gz], .csv[.gz], .tsv[.gz] or .parquet; or a sharded one:
    a folder, a glob or a list of files of one format and the same columns, read as one source."""

    kind: Literal["file"] = Field("file", description="source kind; inferred from path when not given")
    path: str | list[str] = Field(
        description="the file; or its shards, read as one source in path order: a folder (every data file in "
        "it, recursively), a glob (`data/*.jsonl.gz`, `shards/**/*.parquet`) or a list of files; a relative path "
        "resolves against the config file's folder",
    )
    split: str = Field("train", description="accepted for symmetry with hub sources; a file is one split")
    subset: str | None = Field(None, description="accepted for symmetry with hub sources; ignored for a file")
    streaming: StreamingOptions | None = Field(
        None,
        description="read the files as a stream (`streaming: true` or {window_batches, shuffle_buffer, check_rows}); "
        "needs train.max_steps",
    )

    path_fields: ClassVar[tuple[str, ...]] = ("path",)

    @field_validator("streaming", mode="before")
    @classmethod
    def _streaming_flag(cls, value: Any) -> Any:
        # `streaming: true` takes the defaults; `streaming: false` is no stream.
        if value is True:
            return {}
        return None if value is False else value

    @field_validator("path")
    @classmethod
    def _some_files(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("the list of files is empty; give at least one file")
        return value

    @property
    def label(self) -> str:
        """How messages and the run summary name this source: its path, folder or glob; a list of
        files by its first file and how many more."""
        if isinstance(self.path, list):
            more = len(self.path) - 1
            return self.path[0] + (f" (+{more} more file{'s' if more > 1 else ''})" if more else "")
        return self.path

    def default_name(self) -> str:
        """The file name without its extensions (``cembed:coco-captions`` -> ``coco-captions``); a
        folder's name; a glob's last folder without a pattern (``data/*.jsonl.gz`` -> ``data``); a
        list's first file's name."""
        path = self.path[0] if isinstance(self.path, list) else self.path
        if path.startswith("cembed:"):
            return _strip_extension(path.split(":", 1)[1])
        if is_glob(path):
            fixed = list(Path(path).parts[:-1])
            fixed = fixed[: next((i for i, part in enumerate(fixed) if is_glob(part)), len(fixed))]
            return Path(*fixed).name if fixed and Path(*fixed).name else _strip_extension(Path(path).name)
        return _strip_extension(Path(path).name)


class HubSource(SourceConfig):
    """A dataset on the datasets hub (or any id ``datasets.load_dataset`` accepts)."""

    kind: Literal["hub"] = Field("hub", description="source kind; inferred from path when not given")
    path: str = Field(description="the dataset id, e.g. sentence-transformers/all-nli")
    split: str = Field("train", description="the split to train on")
    subset: str | None = Field(None, description="the dataset's configuration (subset) name, if it has several")

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        return self.path

    def default_name(self) -> str:
        """The hub id's last part, with its subset (``org/all-nli`` + ``pair`` -> ``all-nli-pair``)."""
        return self.path.rsplit("/", 1)[-1] + (f"-{self.subset}" if self.subset else "")


class BeirSource(SourceConfig):
    """A BEIR folder's qrels as (query, document) training pairs; YAML ``{beir: folder, split: train}``."""

    kind: Literal["beir"] = Field("beir", description="source kind; set by the `beir:` key")
    path: str = Field(description="the BEIR folder; a relative path resolves against the config file's folder")
    split: str = Field("train", description="the qrels file to read, qrels/<split>.tsv")

    path_fields: ClassVar[tuple[str, ...]] = ("path",)
    generated_columns: ClassVar[frozenset[str]] = frozenset({"query_id", "doc_id"})  # the pair's ids
    shorthand: ClassVar[str | None] = "beir"
    shorthand_hint: ClassVar[str] = "the BEIR folder as `beir: <folder>`"

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        return f"{self.path} (BEIR, qrels/{self.split}.tsv)"

    def default_name(self) -> str:
        """The BEIR folder's name with its split (``scifact-train``)."""
        return f"{Path(self.path).name}-{self.split}"


class PreparedSource(SourceConfig):
    """A prepared source (:mod:`cembed.data.prepared`): a folder of token ids already tokenized for
    the model, by ``cembed prepare-data`` or another engine; YAML ``{prepared: folder}``. Its role
    columns, prompts and ``max_seq_length`` are the manifest's; training checks them against the model."""

    kind: Literal["prepared"] = Field("prepared", description="source kind; set by the `prepared:` key")
    path: str = Field(
        description="the prepared folder (holding cembed_prepared.json); a relative path resolves against the "
        "config file's folder"
    )

    path_fields: ClassVar[tuple[str, ...]] = ("path",)
    shorthand: ClassVar[str | None] = "prepared"
    shorthand_hint: ClassVar[str] = "the prepared folder as `prepared: <folder>`"

    @field_validator("columns")
    @classmethod
    def _no_columns(cls, value: ColumnMap | None) -> ColumnMap | None:
        if value is not None:
            raise ValueError("a prepared source's roles are its manifest's columns; remove `columns`")
        return value

    @property
    def label(self) -> str:
        """How messages and the run summary name this source: its folder."""
        return self.path

    def default_name(self) -> str:
        """The folder's name."""
        return Path(self.path).name or self.path


# kind -> its config class; `kind` picks it (inferred by DataConfig when not given).
SOURCE_CONFIGS: dict[str, type[SourceConfig]] = {}


def register_source_config(cls: type[SourceConfig]) -> type[SourceConfig]:
    """Register a :class:`SourceConfig` subclass under its ``kind`` default (usable as a decorator).

    Raises:
        TypeError: ``cls`` is not a SourceConfig subclass with a one-value ``Literal`` kind.
        ValueError: the kind is already registered to another class.
    """
    return register_by_literal(SOURCE_CONFIGS, cls, SourceConfig, "kind", "source kind")


def source_config_class(kind: Any) -> type[SourceConfig]:
    """The registered :class:`SourceConfig` subclass for ``kind``.

    Raises:
        ValueError: an unknown kind; the message lists the known ones.
    """
    return registered(SOURCE_CONFIGS, kind, "source kind")


def source_config(**fields: Any) -> SourceConfig:
    """The registered source config for ``fields["kind"]``, validated.

    Raises:
        ValueError: unknown kind (listing the known ones); pydantic's ValidationError for bad fields.
    """
    return source_config_class(fields.get("kind")).model_validate(fields)


def source_config_class_of(item: Any) -> type[SourceConfig]:
    """The class a ``data.train`` entry as written picks (its ``kind``, else its shorthand key);
    :class:`FileSource` when neither names a registered kind (a file and a hub id have the same fields).
    Used for did-you-mean on an unknown key."""
    if isinstance(item, dict):
        if item.get("kind") in SOURCE_CONFIGS:
            return SOURCE_CONFIGS[item["kind"]]
        for cls in SOURCE_CONFIGS.values():
            if cls.shorthand is not None and cls.shorthand in item:
                return cls
    return FileSource


register_source_config(FileSource)
register_source_config(HubSource)
register_source_config(BeirSource)
register_source_config(PreparedSource)


def infer_source_kind(path: str, base: Path | None = None) -> Literal["file", "hub"]:
    """``file`` when ``path`` names packaged data (``cembed:<name>``), exists (relative to the
    working folder or to ``base``, the config file's folder), ends with one of
    :data:`LOCAL_EXTENSIONS` or is a glob pattern; ``hub`` otherwise."""
    if is_sample(path) or path.lower().endswith(LOCAL_EXTENSIONS) or is_glob(path) or Path(path).exists():
        return "file"
    if base is not None and (base / path).exists():
        return "file"
    return "hub"


class SamplingConfig(_Strict):
    """How a run with several training sources picks the source of each batch (every batch holds
    rows of one source only; see :class:`cembed.data.sampler.NoDuplicatesSampler`)."""

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
        if any(isinstance(s.source, PreparedSource) for s in sources):
            _check_prepared(self, sources)
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


def _check_prepared(cfg: DataConfig, sources: list[TrainSource]) -> None:
    """A prepared source holds token ids only and its roles are its manifest's: it trains alone and
    pre-tokenized. ``data.columns`` may stay (the config that prepared it maps the same roles; the
    data stage checks that they are the manifest's columns)."""
    if len(sources) > 1:
        raise ValueError(
            "train: a prepared source trains alone; give it as the only source (prepare the others into it)"
        )
    if not cfg.pretokenize:
        raise ValueError(
            "pretokenize: false, but a prepared source holds token ids only (no text to tokenize); remove it"
        )


def merged_prompts(own: PromptsConfig | None, run: PromptsConfig | None) -> PromptsConfig | None:
    """A source's prompts: each role its own (``data.train.<name>.prompts``) if set, else ``run``'s
    (``data.prompts``); None when neither sets any."""
    if own is None:
        return run
    if run is None:
        return own
    return PromptsConfig(
        **{f: getattr(own, f) if getattr(own, f) is not None else getattr(run, f) for f in PromptsConfig.model_fields}
    )


def streaming_conflict(data: DataConfig, max_steps: int | None, workers: int | str, no_duplicates: bool) -> str | None:
    """Why ``data`` cannot train from its streamed source (``data.train.streaming``) with the rest of
    the config (``train.max_steps``, ``train.dataloader_num_workers``, ``sampler.no_duplicates``), as one
    line naming the field and the fix; None when nothing streams or nothing conflicts."""
    streamed = [s for s in data.sources() if getattr(s.source, "streaming", None) is not None]
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
            f"data.drop_invalid_rows: a streaming source checks only its first {streamed[0].source.streaming.check_rows} "
            "rows and cannot drop rows later; set it to false or drop streaming"
        )
    if not no_duplicates:
        return (
            f"sampler.no_duplicates: false: a streaming source always batches without duplicates (over "
            f"{key}.window_batches batches); remove it or drop streaming"
        )
    if workers != "auto" and int(workers) > 1:
        return (
            f"train.dataloader_num_workers: {workers}: a stream is read by one data-loader process (each worker would "
            "read the whole stream); set it to 0 or 1"
        )
    return None
