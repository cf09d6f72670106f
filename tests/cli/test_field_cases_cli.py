"""Field cases (issue 39 item 10) for what the command line shows: ``validate --json``'s stdout, the
``--help`` pages and the library warnings, each built from a public bug report about the same feature
in the field's tools and compared with a reference computed without cembed (``json.loads`` of
stdout, the text as a terminal-less pipe receives it). docs/development.md lists the round."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from conftest import distinct_pairs, install_distribution
from typer.testing import CliRunner

import cembed.plugins as plugins
from cembed.cli.app import app
from cembed.config.sources import SOURCE_CONFIGS
from cembed.data.sources.registry import LOADERS

# A source kind whose loader says what it does on stdout, as scripts' loaders do.
TALKING_KIND = """
    from typing import Literal

    from cembed.config.sources import SourceConfig, register_source_config


    class TalkingSource(SourceConfig):
        kind: Literal["talking"] = "talking"
        rows: int

        @property
        def label(self) -> str:
            return f"{self.rows} generated rows"

        def default_name(self) -> str:
            return "talking"


    def load(source):
        import os

        import datasets

        print("talking kind: reading rows ...")
        os.write(1, b"talking kind: a C extension's progress\\n")
        rows = [{"anchor": f"question number {i}", "positive": f"answer text {i}"} for i in range(source.rows)]
        return datasets.Dataset.from_list(rows)


    def register():
        from cembed.data.sources.registry import register_source_loader

        register_source_config(TalkingSource)
        register_source_loader("talking", load)
"""


@pytest.fixture
def talking_kind(tmp_path, monkeypatch):
    """The distribution ``talking-kind`` installed on sys.path for one test; afterwards its module,
    its registrations and the record of loaded plugins are gone."""
    site = tmp_path / "site"
    install_distribution(
        site, "talking-kind", {"talkingkind.py": TALKING_KIND}, {plugins.GROUP: {"talking": "talkingkind:register"}}
    )
    saved = dict(plugins.LOADED), dict(plugins.MODULES), dict(SOURCE_CONFIGS), dict(LOADERS)
    monkeypatch.syspath_prepend(str(site))
    yield
    for registry, before in zip((plugins.LOADED, plugins.MODULES, SOURCE_CONFIGS, LOADERS), saved):
        registry.clear()
        registry.update(before)
    sys.modules.pop("talkingkind", None)


def test_validate_json_stays_one_object_while_a_plugins_loader_prints(talking_kind, tmp_path, tiny_model_dir, capfd):
    """openclaw#37328 ("keep --json stdout machine-readable": plugin logs printed before the JSON
    broke ``| jq``) and dvc#9144 ("avoid printing anything on --json output"): a plugin's source
    loader runs inside ``validate`` and prints (Python's stdout and file descriptor 1); stdout must
    still be the one JSON object (the reference: ``json.loads`` of it), what the loader said on stderr."""
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": {"kind": "talking", "rows": 32}},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
                "train": {"output_dir": str(tmp_path / "run")},
            }
        )
    )
    r = CliRunner().invoke(app, ["validate", str(config), "--json"])
    fd_out, fd_err = capfd.readouterr()
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["data"]["rows"] == 32, r.stdout  # stdout is the JSON object alone
    assert "talking kind: reading rows ..." in r.stderr
    assert "talking kind: a C extension's progress" in fd_err and "talking kind" not in fd_out


def test_validate_json_with_pairs_is_one_object(tmp_path, tiny_model_dir):
    """The same command without a plugin: the reference case (stdout parses, nothing else on it)."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(32)))
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": str(data)},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
                "train": {"output_dir": str(tmp_path / "run")},
            }
        )
    )
    r = CliRunner().invoke(app, ["validate", str(config), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["data"]["rows"] == 32, r.output


@pytest.mark.parametrize(
    "args", [["--help"], ["train", "-h"], ["suggest-lr", "--base-lr", "2e-5", "--base-bs", "32", "--bs", "1024"]]
)
def test_stdout_piped_while_stderr_is_a_terminal_holds_no_escape_codes(args):
    """rust-lang/rustup#772 ("only checked if stderr was a tty", so ``rustup component list | less``
    showed escape codes): with stdout a pipe and stderr a terminal, what cembed writes to stdout is
    plain text (the reference: the bytes a pipe receives hold no ESC), the help's rows included."""
    import os
    import pty
    import subprocess

    terminal, other_end = pty.openpty()
    try:
        r = subprocess.run(
            [str(Path(sys.executable).parent / "cembed"), *args],  # the console script, as a user runs it
            stdout=subprocess.PIPE,
            stderr=other_end,
            env={**os.environ, "TERM": "xterm-256color", "HF_HUB_OFFLINE": "1"},
            timeout=120,
        )
    finally:
        os.close(terminal)
        os.close(other_end)
    assert r.returncode == 0 and r.stdout.strip(), r.stdout
    assert b"\x1b" not in r.stdout
    if args[-1] in ("--help", "-h"):
        assert b"<bool>" not in r.stdout and b"Usage: cembed" in r.stdout
