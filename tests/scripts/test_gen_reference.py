"""docs/reference/config.md and cli.md are what scripts/gen_reference.py makes from the schema and the
Typer app: a schema or CLI change without the regenerated page fails here (the fix:
``python scripts/gen_reference.py``). Needs no mkdocs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    return load_script(REPO / "scripts" / "gen_reference.py", "gen_reference")


@pytest.fixture(scope="module")
def pages(gen):
    """The generated pages, made once (the CLI page runs every command's --help)."""
    return gen.pages()


def test_committed_config_reference_is_the_generated_one(gen, pages):
    assert gen.CONFIG_PAGE.read_text(encoding="utf-8") == pages[gen.CONFIG_PAGE], (
        "docs/reference/config.md is stale: run python scripts/gen_reference.py"
    )


def test_committed_cli_reference_is_the_generated_one(gen, pages):
    assert gen.CLI_PAGE.read_text(encoding="utf-8") == pages[gen.CLI_PAGE], (
        "docs/reference/cli.md is stale: run python scripts/gen_reference.py"
    )


def test_config_reference_lists_every_field_of_the_schema(gen, pages):
    listed = set()  # (class, field) pairs of the page's tables
    for _title, prefix, cls in gen.sections():
        rows = gen.model_rows(cls, prefix)
        listed |= {(cls.__name__, re.match(r"^\| `([\w.]+)` \|", r)[1].removeprefix(prefix)) for r in rows}
        assert all(r in pages[gen.CONFIG_PAGE] for r in rows)
    fields = gen.config_fields()  # walked from the pydantic models
    assert {("ModelConfig", "name_or_path"), ("BatchConfig", "mini_batch_size"), ("FileSource", "path")} <= fields
    assert ("MatryoshkaConfig", "dims") in fields
    assert fields == listed


def test_a_new_field_reaches_the_reference(gen, monkeypatch):
    from pydantic.fields import FieldInfo

    from cembed.config.schema import SamplerConfig

    field = FieldInfo.from_annotated_attribute(int, 8)
    field.description = "rows shuffled together"
    monkeypatch.setitem(SamplerConfig.model_fields, "shuffle_window", field)
    assert "| `sampler.shuffle_window` | int | `8` | rows shuffled together |" in gen.config_reference()


def test_check_mode_names_a_stale_page(gen, tmp_path, monkeypatch, capsys):
    (tmp_path / "config.md").write_text("old\n")
    (tmp_path / "cli.md").write_text("the generated page\n")
    monkeypatch.setattr(
        gen, "pages", lambda: {tmp_path / "config.md": "new\n", tmp_path / "cli.md": "the generated page\n"}
    )
    monkeypatch.setattr(gen, "REPO", tmp_path)
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "config.md" in err and "cli.md" not in err
