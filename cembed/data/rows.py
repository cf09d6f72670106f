"""The in-memory training rows: what loading and checking produced, and what reports read of it.

:class:`TrainingData` holds the checked table (columns ``anchor``, ``positive``, ``negative_1`` ...)
and one :class:`LoadedSource` per training source. A source is named three ways along the data
flow: :class:`cembed.config.sources.SourceConfig` (as configured),
:class:`cembed.config.data.TrainSource` (resolved: its field, name, columns, prompts) and
:class:`LoadedSource` (loaded: its rows and where they sit in the table).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cembed.config.columns import ColumnMap


@dataclass
class TrainingData:
    """A checked dataset plus what the run summary reports about it."""

    dataset: object  # datasets.Dataset with columns anchor, positive, negative_1..k (the widest source's)
    source: str
    rows_read: int
    rows_dropped: int = 0
    roles: dict[str, str] = field(default_factory=dict)  # role column -> source column
    # One entry per training source, in config order; their rows are consecutive in ``dataset``.
    sources: list[LoadedSource] = field(default_factory=list)
    warnings: tuple[str, ...] = ()  # unmapped columns, expanded list columns (printed by validate and train)

    @property
    def manifest(self):
        """The :class:`cembed.data.tokens.format.PreparedManifest` of a prepared source (token ids, no
        text; it trains alone), else None."""
        return self.sources[0].manifest if len(self.sources) == 1 else None

    @property
    def columns(self) -> list[str]:
        """The dataset's role columns: the widest source's layout (see the module docstring); a
        prepared source's manifest columns (its dataset holds ``<role>_input_ids`` ..., no text)."""
        if self.manifest is not None:
            return list(self.manifest.columns)
        return list(self.dataset.column_names)

    def source_columns(self) -> list[list[str]]:
        """Each source's own role columns, in ``dataset`` order (one entry for a single source)."""
        return [[c for c in self.columns if c in s.roles] for s in self.sources] or [self.columns]

    def first_row(self) -> dict[str, str]:
        """The first training row's texts by role column (a prepared source: its manifest's first
        sample row; ``{}`` without rows), for ``validate``."""
        if self.manifest is not None:
            samples = self.manifest.samples
            return {c: str(samples[c][0]) for c in self.columns if samples.get(c)}
        return {k: str(v) for k, v in self.dataset[0].items()} if len(self.dataset) else {}

    def sample_texts(self) -> dict[str, list[str]]:
        """One text of every column (``{column: [text]}``), from the first source that maps it; for
        the checks that run the model once per column (unused parameters). A prepared source: its
        manifest's first sample text of each column."""
        if self.manifest is not None:
            samples = self.manifest.samples
            return {c: [samples[c][0]] for c in self.columns if samples.get(c) and samples[c][0] is not None}
        out: dict[str, list[str]] = {}
        for src, columns in zip(self.sources or [None], self.source_columns()):
            row = self.dataset[src.offset if src is not None else 0]
            out |= {c: [row[c]] for c in columns if c not in out}
        return {c: out[c] for c in self.columns if c in out}

    @property
    def streamed(self):
        """The streamed source's :class:`cembed.config.sources.StreamingOptions` (``data.train.streaming``),
        or None: then ``dataset`` holds only its first rows (checked), not what training reads."""
        stream = self.sources[0].stream if len(self.sources) == 1 else None
        return stream.source.stream_options() if stream is not None else None

    def source_sizes(self) -> list[int]:
        """Rows of each source, in ``dataset`` order (one entry for a single source)."""
        return [s.rows for s in self.sources] or [len(self.dataset)]


@dataclass
class LoadedSource:
    """One training source's share of :class:`TrainingData`: its rows ``offset .. offset + rows``."""

    name: str  # the source's name (data.train.<name>), a default from its path otherwise
    label: str  # its path or id, for messages
    key: str  # the config field holding it (data.train, data.train.<name>)
    rows_read: int
    rows_dropped: int
    rows: int
    offset: int
    roles: dict[str, str] = field(default_factory=dict)  # role column -> this source's column
    prompts: Any = (
        None  # PromptsConfig: its own prompts over data.prompts (data.train.<name>.prompts); None: data.prompts'
    )
    files: int | None = None  # a sharded source's file count (its loader's count_files; None: one file, or no shards)
    # What its folder or glob holds but does not read, each "<path> (<why>)" (its loader's skipped_files:
    # hidden and underscore-prefixed folders and files, files that are not data, 0-row shards).
    skipped: tuple[str, ...] = ()
    # The roles its own prompts set (the rest of ``prompts`` is data.prompts'), for where a prompt came from.
    own_prompt_roles: tuple[str, ...] = ()
    manifest: Any = None  # a prepared source's cembed.data.tokens.format.PreparedManifest (token ids, no text)
    # A streamed source's TrainSource (data.train.streaming): then the rows above are only its first
    # rows, read to check its columns and cells; training reads the stream (cembed.data.batching.windowed).
    stream: Any = None

    @property
    def where(self) -> str:
        """How messages name the source: its path, after its config field when there are several."""
        return self.label if self.key == "data.train" else f"{self.key} ({self.label})"


@dataclass
class UnloadedData:
    """Training data that ``cembed validate`` could not load because the hub is offline or
    unreachable: rows and columns unchecked; everything else is checked without them."""

    source: str
    reason: str  # e.g. "offline: HF_DATASETS_OFFLINE=1"

    @property
    def message(self) -> str:
        """The warning ``validate`` prints."""
        return f"data: hub dataset {self.source} not loaded ({self.reason}); rows and columns unchecked"


def role_columns(columns: ColumnMap) -> list[tuple[str, str]]:
    """``(source column, role column)`` pairs in loss order: anchor, positive, negative_1..k."""
    pairs = [(columns.anchor, "anchor"), (columns.positive, "positive")]
    pairs += [(src, f"negative_{i + 1}") for i, src in enumerate(columns.negatives)]
    return pairs


def source_views(data: TrainingData) -> list[TrainingData]:
    """Each training source of ``data`` as a TrainingData of its own rows (``data`` itself when it
    has one source), for reports that are per source (inspect-data, rows that cannot be placed)."""
    if len(data.sources) <= 1:
        return [data]
    views = []
    for src, columns in zip(data.sources, data.source_columns()):
        rows = data.dataset.select(range(src.offset, src.offset + src.rows)).select_columns(columns)
        view_src = replace(src, offset=0)
        views.append(TrainingData(rows, src.where, src.rows_read, src.rows_dropped, src.roles, [view_src]))
    return views


def prepared_samples(manifest):
    """A prepared source's sample texts (its manifest's first rows) as a ``datasets.Dataset`` of its
    role columns, the rows every column has a text for."""
    import datasets

    samples = {c: list(manifest.samples.get(c) or []) for c in manifest.columns}
    rows = min(len(v) for v in samples.values())
    return datasets.Dataset.from_dict({c: v[:rows] for c, v in samples.items()})


def card_datasets(data: TrainingData):
    """Each source's rows with its own columns, as a ``DatasetDict`` by source name, for what the
    model card describes, when the sources' columns differ; None otherwise (the dataset itself). A
    prepared source (token ids, no text): a ``Dataset`` of its manifest's sample texts. A streamed
    source: its first rows (the trainer's dataset is the stream)."""
    if data.manifest is not None:
        return prepared_samples(data.manifest)
    if data.streamed is not None:
        return data.dataset
    if len({tuple(c) for c in data.source_columns()}) <= 1:
        return None
    import datasets

    return datasets.DatasetDict({s.name: v.dataset for s, v in zip(data.sources, source_views(data))})
