"""A new training-source kind is one config class plus one loader, registered through the two
registries only (``cembed.config.sources.register_source_config``, ``cembed.data.sources.registry.register_source_loader``):
it validates (with the config's own error messages), its path fields resolve against the config's
folder, and the data stage the recipe calls (``load_checked_data``) yields its rows."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import pytest
from conftest import distinct_pairs
from pydantic import field_validator
from pydantic_core import PydanticCustomError

from cembed.config.file import load_config
from cembed.config.sources import SOURCE_CONFIGS, SourceConfig, register_source_config
from cembed.data.batchable import load_checked_data
from cembed.data.sources.registry import LOADERS, register_source_loader
from cembed.errors import UserError


class SeparatedSource(SourceConfig):
    """A text file of ``anchor<separator>positive`` lines (a toy kind with a path field)."""

    kind: Literal["separated"] = "separated"
    path: str
    separator: str = " | "

    path_fields: ClassVar[tuple[str, ...]] = ("path",)
    generated_columns: ClassVar[frozenset[str]] = frozenset({"line"})

    @field_validator("separator")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value:  # the kind's own error type: it must reach the message as the kind wrote it
            raise PydanticCustomError("empty_separator", "the separator must not be empty; e.g. ' | '")
        return value

    @property
    def label(self) -> str:
        return f"{self.path} (separated by {self.separator!r})"

    def default_name(self) -> str:
        return Path(self.path).stem


class InlineSource(SourceConfig):
    """Rows given in the YAML itself (a toy kind without a path)."""

    kind: Literal["inline"] = "inline"
    rows: list[dict[str, str]]

    @property
    def label(self) -> str:
        return f"{len(self.rows)} inline rows"

    def default_name(self) -> str:
        return "inline"


def load_separated(source: SeparatedSource):
    import datasets

    lines = [(n, text) for n, text in enumerate(Path(source.path).read_text().splitlines(), 1) if text.strip()]
    pairs = [text.split(source.separator, 1) for _, text in lines]
    return datasets.Dataset.from_dict(
        {"anchor": [p[0] for p in pairs], "positive": [p[1] for p in pairs], "line": [n for n, _ in lines]}
    )


def separated_row_locator(source: SeparatedSource):
    numbers = [n for n, text in enumerate(Path(source.path).read_text().splitlines(), 1) if text.strip()]
    return lambda index: f"line {numbers[index]}"


def load_inline(source: InlineSource):
    import datasets

    return datasets.Dataset.from_list(source.rows)


@pytest.fixture
def toy_kinds():
    """The two toy kinds registered for one test, and removed afterwards."""
    register_source_config(SeparatedSource)
    register_source_loader("separated", load_separated, separated_row_locator)
    register_source_config(InlineSource)
    register_source_loader("inline", load_inline)
    yield
    for kind in ("separated", "inline"):
        SOURCE_CONFIGS.pop(kind, None)
        LOADERS.pop(kind, None)


def _separated_file(path: Path, pairs: list[dict]) -> Path:
    path.write_text("".join(f"{p['anchor']} | {p['positive']}\n\n" for p in pairs))  # blank lines between
    return path


def test_toy_kind_validates_resolves_its_path_and_yields_its_rows(toy_kinds, tmp_path, write_config, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # the path must resolve against the config's folder, not the cwd
    pairs = distinct_pairs(6)
    _separated_file(tmp_path / "pairs.txt", pairs)
    cfg = load_config(write_config("data:\n  train:\n    kind: separated\n    path: pairs.txt\n"))
    source = cfg.data.train
    assert isinstance(source, SeparatedSource) and source.path == str(tmp_path / "pairs.txt")
    assert [s.name for s in cfg.data.sources()] == ["pairs"]
    data = load_checked_data(cfg.data, global_batch_size=4, no_duplicates=True)
    assert data.dataset["anchor"] == [p["anchor"] for p in pairs]
    assert data.dataset["positive"] == [p["positive"] for p in pairs]
    assert data.columns == ["anchor", "positive"] and data.rows_read == 6
    assert data.source == f"{tmp_path / 'pairs.txt'} (separated by ' | ')"
    assert data.warnings == ()  # `line` is the kind's own column, not an unmapped one


def test_toy_kind_rows_are_named_by_its_row_locator(toy_kinds, tmp_path, write_config):
    pairs = distinct_pairs(4)
    pairs[2]["anchor"] = " "  # the third pair sits on line 5 (blank lines between pairs)
    _separated_file(tmp_path / "pairs.txt", pairs)
    cfg = load_config(write_config({"data": {"train": {"kind": "separated", "path": "pairs.txt"}}}))
    with pytest.raises(UserError, match="line 5") as e:
        load_checked_data(cfg.data, global_batch_size=2, no_duplicates=True)
    assert "pairs.txt" in str(e.value)


def test_toy_kind_errors_keep_file_line_and_did_you_mean(toy_kinds, tmp_path, write_config):
    path = write_config("data:\n  train:\n    kind: separated\n    path: pairs.txt\n    seperator: ','\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert f"{path}:5: unknown key 'data.train.seperator'; did you mean 'data.train.separator'?" in str(e.value)
    path = write_config("data:\n  train:\n    kind: separated\n    path: pairs.txt\n    separator: ''\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert f"{path}:5: data.train.separator: the separator must not be empty; e.g. ' | ' (got '')" in str(e.value)
    path = write_config("data:\n  train:\n    kind: inline\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert f"{path}:2: missing required field 'data.train.rows'" in str(e.value)
    path = write_config("data:\n  train:\n    kind: tsv_folder\n    path: x\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert f"{path}:3: data.train.kind: unknown value 'tsv_folder'" in str(e.value)
    assert "'separated', 'inline'" in str(e.value)  # the registered kinds are the allowed ones


def test_kind_without_path_fields_beside_a_file_source(toy_kinds, tmp_path, write_config, pairs_file):
    pairs_file(distinct_pairs(4), name="file.jsonl")
    inline = [{"anchor": f"inline question {i}", "positive": f"inline answer {i}"} for i in range(4)]
    cfg = load_config(write_config({"data": {"train": [{"kind": "inline", "rows": inline}, "file.jsonl"]}}))
    first, second = cfg.data.sources()
    assert (first.name, first.key, first.source.rows) == ("inline", "data.train.inline", inline)  # nothing resolved
    assert (second.name, second.source.path) == ("file", str(tmp_path / "file.jsonl"))
    data = load_checked_data(cfg.data, global_batch_size=4, no_duplicates=True)
    assert data.dataset["anchor"][:4] == [r["anchor"] for r in inline]
    assert data.source_sizes() == [4, 4] and data.source == "inline + file"


def test_a_kind_declares_what_it_can_do_in_its_class_and_loader(
    toy_kinds, tmp_path, write_config, monkeypatch, pairs_file
):
    """Capabilities are the kind's class attributes and loader hooks; nothing else names the kind."""
    from cembed.data.sources.registry import SourceLoader

    pairs = distinct_pairs(6)
    _separated_file(tmp_path / "pairs.txt", pairs)
    # A loader's count_files hook: the source reads shards, which validate and the summary count.
    monkeypatch.setitem(
        LOADERS, "separated", SourceLoader(load_separated, separated_row_locator, count_files=lambda s: 3)
    )
    cfg = load_config(write_config({"data": {"train": {"kind": "separated", "path": "pairs.txt"}}}))
    data = load_checked_data(cfg.data, global_batch_size=4, no_duplicates=True)
    assert data.sources[0].files == 3
    # trains_alone: the config refuses it beside another source, naming its kind.
    monkeypatch.setattr(SeparatedSource, "trains_alone", True)
    pairs_file(distinct_pairs(4), name="file.jsonl")
    both = write_config(
        {"data": {"train": [{"kind": "separated", "path": "pairs.txt"}, "file.jsonl"]}}, name="two.yaml"
    )
    with pytest.raises(UserError, match="train: a separated source trains alone; give it as the only source$"):
        load_config(both)
    # is_pretokenized: token ids only, so pretokenize: false is refused.
    monkeypatch.setattr(SeparatedSource, "trains_alone", False)
    monkeypatch.setattr(SeparatedSource, "is_pretokenized", True)
    ids = {"data": {"train": {"kind": "separated", "path": "pairs.txt"}, "pretokenize": False}}
    with pytest.raises(UserError, match="pretokenize: false, but a separated source holds token ids only"):
        load_config(write_config(ids, name="ids.yaml"))


def test_registries_refuse_a_second_class_or_loader_for_a_kind(toy_kinds):
    class Other(SourceConfig):
        kind: Literal["separated"] = "separated"

    with pytest.raises(ValueError, match="already registered"):
        register_source_config(Other)
    with pytest.raises(ValueError, match="already has a loader"):
        register_source_loader("separated", load_inline)

    class NoLiteral(SourceConfig):
        kind: str = "free"

    with pytest.raises(TypeError, match="Literal"):
        register_source_config(NoLiteral)


def test_toy_kinds_are_gone_after_the_fixture():
    assert not {"separated", "inline"} & (set(SOURCE_CONFIGS) | set(LOADERS))
