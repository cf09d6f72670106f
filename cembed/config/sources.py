"""Source kinds as configured: ``file``, ``hub``, ``beir``, ``prepared`` and ``saved``, and their registry.

A kind is a :class:`SourceConfig` subclass registered by its ``kind`` literal
(:func:`register_source_config`); :mod:`cembed.data.sources.registry` holds its loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveInt,
    field_validator,
)

from cembed.config.base import Strict as _Strict
from cembed.config.base import register_by_literal, registered
from cembed.config.columns import ColumnMap
from cembed.config.prompts import PromptsConfig
from cembed.samples import is_sample

# The compressions a text data file may carry, as datasets reads them (gzip, bzip2, xz, Zstandard:
# .zst needs the zstandard package, cembed[zstd]).
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
# Extensions read as local files; anything else that does not exist on disk is taken as a hub id.
LOCAL_EXTENSIONS = (
    *(text + c for text in (".jsonl", ".json", ".csv", ".tsv") for c in ("", *COMPRESSIONS)),
    ".parquet",
)
# What datasets' save_to_disk writes: a Dataset's folder holds both files, a DatasetDict's the one
# (datasets.config DATASET_STATE_JSON_FILENAME, DATASET_INFO_FILENAME, DATASETDICT_JSON_FILENAME).
SAVED_DATASET_FILES = ("state.json", "dataset_info.json")
SAVED_DICT_FILE = "dataset_dict.json"
# A file source's path holding one of these is a glob pattern (a hub id never holds them).
GLOB_CHARACTERS = "*?["


def saved_dataset_kind(folder: str | Path) -> Literal["Dataset", "DatasetDict"] | None:
    """What ``datasets``' ``save_to_disk`` wrote in ``folder``, judged as ``datasets.load_from_disk``
    judges it: ``Dataset`` (``state.json`` and ``dataset_info.json``), ``DatasetDict``
    (``dataset_dict.json``), or None (not such a folder, or not a folder)."""
    folder = Path(folder)
    if all((folder / name).is_file() for name in SAVED_DATASET_FILES):
        return "Dataset"
    return "DatasetDict" if (folder / SAVED_DICT_FILE).is_file() else None


def is_glob(path: str) -> bool:
    """Whether a data path is a glob pattern (``data/*.jsonl.gz``, ``shards/**/*.parquet``)."""
    return any(c in path for c in GLOB_CHARACTERS)


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
    plus one loader (``cembed.data.sources.registry.register_source_loader``), nothing else.

    A subclass declares ``kind: Literal["<kind>"] = "<kind>"``, its own fields, and answers:

    * :attr:`label`: how messages and the run summary name the source;
    * :meth:`default_name`: the source's name when it sets none;
    * :attr:`path_fields`: the fields that hold local paths, resolved against the config file's
      folder (``cembed:<name>`` -> the packaged data) by ``cembed.config.file.resolve_paths``;
    * :attr:`generated_columns`: the columns its loader adds itself (not the user's data, so not
      reported as unmapped);
    * :attr:`shorthand` / :attr:`shorthand_hint`, optionally: a YAML key that names the kind and
      holds its path (``{beir: folder}`` -> ``{kind: beir, path: folder}``).

    What the kind can do, declared here and read by every stage instead of asking which class it is
    (the defaults suit a kind whose loader returns rows of text):

    * :attr:`trains_alone`: it must be the only training source;
    * :attr:`is_pretokenized`: it holds token ids, not text (its loader's dataset carries the
      :class:`cembed.data.tokens.format.PreparedManifest` as ``cembed_manifest``): ``data.pretokenize``
      must stay on, its roles are the manifest's and ``prepare-data`` refuses it;
    * :attr:`reads_files`: its rows come from local data files (a folder prepared from it records
      their count; the loader's ``count_files`` hook counts shards);
    * :attr:`can_init` / :attr:`can_mine`: ``cembed init`` / ``mine-negatives`` may read it;
    * :meth:`stream_options`: how it is read as a stream when the config asks (its loader then has
      an ``open_stream`` hook), else None;
    * :attr:`hub_id`: the datasets-hub id the model card links, if it is one.
    """

    kind: str = Field(description="source kind")

    path_fields: ClassVar[tuple[str, ...]] = ()
    generated_columns: ClassVar[frozenset[str]] = frozenset()
    shorthand: ClassVar[str | None] = None
    shorthand_hint: ClassVar[str] = ""  # the shorthand's form, for the message when it is mixed up
    trains_alone: ClassVar[bool] = False
    is_pretokenized: ClassVar[bool] = False
    reads_files: ClassVar[bool] = False
    can_init: ClassVar[bool] = True
    can_mine: ClassVar[bool] = True

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        raise NotImplementedError(f"{type(self).__name__} must define label")

    def default_name(self) -> str:
        """The source's name when it sets none (from its fields as written, before paths are resolved)."""
        raise NotImplementedError(f"{type(self).__name__} must define default_name")

    def stream_options(self) -> StreamingOptions | None:
        """How the source is read as a stream (``data.train.streaming``), or None: read whole (a
        kind that cannot stream has no such field and always answers None)."""
        return None

    @property
    def hub_id(self) -> str | None:
        """The datasets-hub id of the source (the model card links it), or None: not a hub dataset."""
        return None


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
    """A local data file: .jsonl, .json, .csv or .tsv (each plain or compressed: .gz, .bz2, .xz, .zst) or
    .parquet; or a sharded one:
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
    reads_files: ClassVar[bool] = True

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

    def stream_options(self) -> StreamingOptions | None:
        """``streaming`` (None: the files are read whole)."""
        return self.streaming

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

    @property
    def hub_id(self) -> str | None:
        """The dataset id (``path``)."""
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


class SavedSource(SourceConfig):
    """A folder ``datasets``' ``save_to_disk`` wrote (a ``Dataset``; a ``DatasetDict``, its split picked
    by name; or a DatasetDict's split folder), read as ``datasets.load_from_disk`` reads it: its Arrow
    files memory-mapped. Inferred from the folder's own files (:func:`saved_dataset_kind`)."""

    kind: Literal["saved"] = Field("saved", description="source kind; inferred from the folder's save_to_disk files")
    path: str = Field(
        description="the folder save_to_disk wrote; a relative path resolves against the config file's folder"
    )
    split: str | None = Field(
        None, description="a DatasetDict's split to train on (default: train); a Dataset is one split"
    )

    path_fields: ClassVar[tuple[str, ...]] = ("path",)
    reads_files: ClassVar[bool] = True

    @property
    def label(self) -> str:
        """How messages and the run summary name this source: its folder (and split)."""
        return self.path + (f" (split {self.split})" if self.split else "")

    def default_name(self) -> str:
        """The folder's name, with the split when one is given (``pairs-validation``)."""
        name = Path(self.path).name or self.path
        return f"{name}-{self.split}" if self.split else name


class PreparedSource(SourceConfig):
    """A prepared source (:mod:`cembed.data.tokens.format`): a folder of token ids already tokenized for
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
    # Token ids with its roles in the manifest: trains alone, pre-tokenized; no text to init or mine from.
    trains_alone: ClassVar[bool] = True
    is_pretokenized: ClassVar[bool] = True
    can_init: ClassVar[bool] = False
    can_mine: ClassVar[bool] = False

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
register_source_config(SavedSource)


def infer_source_kind(path: str, base: Path | None = None) -> Literal["file", "hub", "saved"]:
    """``saved`` when ``path`` is a folder ``datasets``' ``save_to_disk`` wrote (:func:`saved_dataset_kind`);
    ``file`` when it names packaged data (``cembed:<name>``), exists (relative to the working folder or
    to ``base``, the config file's folder), ends with one of :data:`LOCAL_EXTENSIONS` or is a glob
    pattern; ``hub`` otherwise."""
    found = [p for p in (Path(path), base / path if base is not None else None) if p is not None and p.exists()]
    if not is_sample(path) and any(saved_dataset_kind(p) for p in found[:1]):
        return "saved"
    if is_sample(path) or path.lower().endswith(LOCAL_EXTENSIONS) or is_glob(path) or found:
        return "file"
    return "hub"


def local_source(path: str) -> SourceConfig:
    """The source a command's own data path names (``cembed init --data``, ``cembed mine-negatives``):
    a folder ``datasets``' ``save_to_disk`` wrote is a :class:`SavedSource` (read as
    ``datasets.load_from_disk`` reads it, not as files: its ``state.json`` is no table), anything
    else a :class:`FileSource`."""
    return SavedSource(path=path) if infer_source_kind(path) == "saved" else FileSource(path=path)
