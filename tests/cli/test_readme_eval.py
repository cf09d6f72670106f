"""The README quickstart's ``cembed eval`` lines run as written (the model swapped for a tiny one to
keep them cheap): the packaged held-out set and the STS fixture they name load, and ``--json`` writes
the metrics. A moved fixture or a renamed flag fails here before a user copies the line."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from cembed.cli.app import app

ROOT = Path(__file__).resolve().parents[2]


def _quickstart_eval_lines() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- --8<-- [start:quickstart] -->", 1)[1].split("<!-- --8<-- [end:quickstart] -->", 1)[0]
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("cembed eval ")]


def _with_model(args: list[str], model: Path, tmp: Path) -> list[str]:
    out = list(args)
    out[out.index("--model") + 1] = str(model)
    if "--json" in out:
        out[out.index("--json") + 1] = str(tmp / out[out.index("--json") + 1])
    return out


def test_readme_eval_lines_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the clone
    lines = _quickstart_eval_lines()
    assert len(lines) == 2, lines
    sts_line, json_line = lines
    assert "--sts" in sts_line and "--json" in json_line

    result = CliRunner().invoke(app, _with_model(sts_line, tiny_model_dir, tmp_path))
    assert result.exit_code == 0, result.output
    assert re.search(r"sts-test\s*│\s*1379 pairs", result.output), result.output
    assert re.search(r"heldout-test\s*│\s*1000 q / 1000 docs", result.output), result.output

    result = CliRunner().invoke(app, _with_model(json_line, tiny_model_dir, tmp_path))
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "after.json").read_text())
    assert any("ndcg@10" in key.lower() for key in _keys(metrics)), metrics


def _keys(obj) -> list[str]:
    if isinstance(obj, dict):
        return [str(k) for k in obj] + [k for v in obj.values() for k in _keys(v)]
    if isinstance(obj, list):
        return [k for v in obj for k in _keys(v)]
    return []
