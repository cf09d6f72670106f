"""The ``data`` config section: training sources (file, hub, BEIR) and the column mapping."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, PositiveFloat, PositiveInt, Tag, ValidationInfo, model_validator

from cembed.config.base import Strict as _Strict
from cembed.samples import is_sample

# Extensions read as local files; anything else that does not exist on disk is taken as a hub id.
LOCAL_EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".tsv", ".parquet", ".csv.gz", ".tsv.gz")


class ColumnMap(_Strict):
    """Source column names for the roles the loss expects; every other column is dropped."""

    anchor: str = Field("anchor", description="column holding the anchor (query) text")
    positive: str = Field("positive", description="column holding the positive text for the anchor")
    negatives: list[str] = Field(
        default_factory=list, description="columns holding hard negatives, one role (negative_1..k) each"
    )


class SourceOptions(_Strict):
    """What every training source may set for itself (with several sources, each its own)."""

    name: str | None = Field(
        None, description="how summaries and messages name the source (default: from its path; a mapping's key)"
    )
    columns: ColumnMap | None = Field(None, description="this source's column mapping (default: data.columns)")
    max_samples: PositiveInt | None = Field(
        None, description="this source's first N rows only (default: data.max_samples)"
    )


class FileSource(SourceOptions):
    """A local data file: .jsonl[.gz], .json[.gz], .csv[.gz], .tsv[.gz] or .parquet."""

    kind: Literal["file"] = Field("file", description="source kind; inferred from path when not given")
    path: str = Field(description="the file; a relative path resolves against the config file's folder")
    split: str = Field("train", description="accepted for symmetry with hub sources; a file is one split")
    subset: str | None = Field(None, description="accepted for symmetry with hub sources; ignored for a file")

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        return self.path


class HubSource(SourceOptions):
    """A dataset on the datasets hub (or any id ``datasets.load_dataset`` accepts)."""

    kind: Literal["hub"] = Field("hub", description="source kind; inferred from path when not given")
    path: str = Field(description="the dataset id, e.g. sentence-transformers/all-nli")
    split: str = Field("train", description="the split to train on")
    subset: str | None = Field(None, description="the dataset's configuration (subset) name, if it has several")

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        return self.path


class BeirSource(SourceOptions):
    """A BEIR folder's qrels as (query, document) training pairs; YAML ``{beir: folder, split: train}``."""

    kind: Literal["beir"] = Field("beir", description="source kind; set by the `beir:` key")
    path: str = Field(description="the BEIR folder; a relative path resolves against the config file's folder")
    split: str = Field("train", description="the qrels file to read, qrels/<split>.tsv")

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        return f"{self.path} (BEIR, qrels/{self.split}.tsv)"


# One class per kind of training data; `kind` picks it (inferred by DataConfig when not given).
DataSource = Annotated[FileSource | HubSource | BeirSource, Field(discriminator="kind")]


def infer_source_kind(path: str, base: Path | None = None) -> Literal["file", "hub"]:
    """``file`` when ``path`` names packaged data (``cembed:<name>``), exists (relative to the
    working folder or to ``base``, the config file's folder) or ends with one of
    :data:`LOCAL_EXTENSIONS`; ``hub`` otherwise."""
    if is_sample(path) or path.lower().endswith(LOCAL_EXTENSIONS) or Path(path).exists():
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


# Keys that make a mapping under data.train one source (else it maps names to sources).
_SOURCE_KEYS = {"kind", "path", "beir", "split", "subset", "name", "columns", "max_samples"}


def _source_dict(train: Any, base: Path | None, where: str) -> Any:
    """One source as the dict pydantic validates: ``file.jsonl`` -> ``{path: ...}``, ``{beir: folder}``
    -> ``{kind: beir, path: folder}``, ``kind`` inferred (:func:`infer_source_kind`) when not given."""
    if isinstance(train, str):
        train = {"path": train}
    if isinstance(train, dict) and "beir" in train:
        # `train: {beir: folder, split: ...}` is the BEIR source's YAML form.
        if "path" in train or train.get("kind", "beir") != "beir":
            raise ValueError(f"{where}: give the BEIR folder as `beir: <folder>` without `path` or `kind`")
        train = {k: v for k, v in train.items() if k != "beir"} | {"kind": "beir", "path": train["beir"]}
    if isinstance(train, dict) and "kind" not in train:
        path = train.get("path")
        # Without a usable path any kind reports the same error (missing or not a string).
        kind = infer_source_kind(path, base) if isinstance(path, str) else "file"
        train = {"kind": kind, **train}
    return train


def default_source_name(kind: str, path: str, split: str = "train", subset: str | None = None) -> str:
    """A source's name when it sets none: the file name without its extensions
    (``cembed:coco-captions`` -> ``coco-captions``), the BEIR folder's name with its split
    (``scifact-train``), or the hub id's last part (with its subset)."""
    if kind == "beir":
        return f"{Path(path).name}-{split}"
    if kind == "hub":
        return path.rsplit("/", 1)[-1] + (f"-{subset}" if subset else "")
    name = path.split(":", 1)[1] if path.startswith("cembed:") else Path(path).name
    for ext in sorted(LOCAL_EXTENSIONS, key=len, reverse=True):
        if name.lower().endswith(ext):
            return name[: -len(ext)]
    return name


def _named(item: Any) -> Any:
    """A list entry with its default ``name`` filled in from the path as written (before paths are
    resolved), so names stay what the user sees."""
    if isinstance(item, dict) and item.get("name") is None and isinstance(item.get("path"), str):
        kind = item.get("kind", "file")
        split, subset = item.get("split", "train"), item.get("subset")
        return {**item, "name": default_source_name(kind, item["path"], str(split), subset)}
    return item


@dataclass(frozen=True)
class TrainSource:
    """One training source as the run uses it: its name, where it comes from, its column mapping
    and row cap (its own, else ``data.columns`` / ``data.max_samples``)."""

    name: str
    source: FileSource | HubSource | BeirSource
    columns: ColumnMap
    max_samples: int | None
    key: str  # the config field that holds it: data.train or data.train.<name>


# The tags of data.train's two forms (pydantic puts them in error locations; messages drop them).
TRAIN_FORMS = ("one", "several")


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


class DataConfig(_Strict):
    """The training data: where it comes from, which columns feed the loss, how it is checked."""

    train: Annotated[
        Annotated[DataSource, Tag(TRAIN_FORMS[0])] | Annotated[list[DataSource], Tag(TRAIN_FORMS[1])],
        Discriminator(lambda value: "several" if isinstance(value, list) else "one"),
    ] = Field(
        description="a file path, a hub id, {kind, path, split, subset} or {beir, split}; or several sources: "
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
            if isinstance(train, dict) and train and not (set(train) & _SOURCE_KEYS):
                named = []
                for name, item in train.items():
                    item = _source_dict(item, base, f"data.train.{name}")
                    named.append({**item, "name": name} if isinstance(item, dict) else item)
                train = named
            if isinstance(train, list):
                train = [_named(_source_dict(item, base, f"data.train.{i}")) for i, item in enumerate(train)]
            elif train is not None:
                train = _source_dict(train, base, "data.train")
            if train is not None:
                data["train"] = train
        return data

    @model_validator(mode="after")
    def _names_and_weights(self) -> DataConfig:
        sources = self.sources()
        names = [s.name for s in sources]
        if isinstance(self.train, list) and not sources:
            raise ValueError("train: the list of sources is empty; give at least one")
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"train: two sources are named {dup!r}; give each a distinct `name`")
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
            name = item.name or default_source_name(item.kind, item.path, item.split, getattr(item, "subset", None))
            key = f"data.train.{name}" if isinstance(self.train, list) else "data.train"
            columns = item.columns if item.columns is not None else self.columns
            max_samples = item.max_samples if item.max_samples is not None else self.max_samples
            out.append(TrainSource(name, item, columns, max_samples, key))
        return out
