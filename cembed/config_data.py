"""The ``data`` config section: training sources (file, hub, BEIR) and the column mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt, ValidationInfo, model_validator

from cembed.samples import is_sample
from cembed.strict import Strict as _Strict

# Extensions read as local files; anything else that does not exist on disk is taken as a hub id.
LOCAL_EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".tsv", ".parquet", ".csv.gz", ".tsv.gz")


class FileSource(_Strict):
    """A local data file: .jsonl[.gz], .json[.gz], .csv[.gz], .tsv[.gz] or .parquet."""

    kind: Literal["file"] = Field("file", description="source kind; inferred from path when not given")
    path: str = Field(description="the file; a relative path resolves against the config file's folder")
    split: str = Field("train", description="accepted for symmetry with hub sources; a file is one split")
    subset: str | None = Field(None, description="accepted for symmetry with hub sources; ignored for a file")

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        return self.path


class HubSource(_Strict):
    """A dataset on the datasets hub (or any id ``datasets.load_dataset`` accepts)."""

    kind: Literal["hub"] = Field("hub", description="source kind; inferred from path when not given")
    path: str = Field(description="the dataset id, e.g. sentence-transformers/all-nli")
    split: str = Field("train", description="the split to train on")
    subset: str | None = Field(None, description="the dataset's configuration (subset) name, if it has several")

    @property
    def label(self) -> str:
        """How messages and the run summary name this source."""
        return self.path


class BeirSource(_Strict):
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


class ColumnMap(_Strict):
    """Source column names for the roles the loss expects; every other column is dropped."""

    anchor: str = Field("anchor", description="column holding the anchor (query) text")
    positive: str = Field("positive", description="column holding the positive text for the anchor")
    negatives: list[str] = Field(
        default_factory=list, description="columns holding hard negatives, one role (negative_1..k) each"
    )


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
    ``default_prompt_name``, else none (see :func:`cembed.prompts.resolve_prompts`).
    """

    anchor: Prompt | None = Field(None, description="the anchor's (query's) prompt: text, {name: ...} or {text: ...}")
    positive: Prompt | None = Field(None, description="the positive's (document's) prompt")
    negatives: Prompt | None = Field(None, description="the hard negatives' prompt (default: the positive's)")


class DataConfig(_Strict):
    """The training data: where it comes from, which columns feed the loss, how it is checked."""

    train: DataSource = Field(description="a file path, a hub id, {kind, path, split, subset} or {beir, split}")
    columns: ColumnMap = Field(default_factory=ColumnMap, description="data column -> loss role")
    prompts: PromptsConfig | None = Field(
        None, description="per-role prompts; unset: the model's own query/document prompts (if any)"
    )
    max_samples: PositiveInt | None = Field(None, description="train on the first N rows only")
    drop_invalid_rows: bool = Field(False, description="drop rows with an empty/over-1-MB cell instead of refusing")
    pretokenize: bool = Field(True, description="tokenize once, cache on disk, only pad in the collator")
    cache_dir: str | None = Field(None, description="default $CEMBED_CACHE_DIR or ~/.cache/cembed")

    @model_validator(mode="before")
    @classmethod
    def _path_shorthand(cls, data: Any, info: ValidationInfo) -> Any:
        # `train: file.jsonl` is shorthand for `train: {path: file.jsonl}`; a `train` without `kind`
        # gets it from infer_source_kind (config_from_dict passes the config's folder as context base).
        if isinstance(data, dict):
            data = dict(data)
            train = data.get("train")
            if isinstance(train, str):
                train = {"path": train}
            if isinstance(train, dict) and "beir" in train:
                # `train: {beir: folder, split: ...}` is the BEIR source's YAML form.
                if "path" in train or train.get("kind", "beir") != "beir":
                    raise ValueError("data.train: give the BEIR folder as `beir: <folder>` without `path` or `kind`")
                train = {k: v for k, v in train.items() if k != "beir"} | {"kind": "beir", "path": train["beir"]}
            if isinstance(train, dict) and "kind" not in train:
                path = train.get("path")
                base = (info.context or {}).get("base")
                # Without a usable path any kind reports the same error (missing or not a string).
                kind = infer_source_kind(path, base) if isinstance(path, str) else "file"
                train = {"kind": kind, **train}
            if isinstance(train, dict):
                data["train"] = train
        return data
