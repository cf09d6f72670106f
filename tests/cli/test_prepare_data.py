"""``cembed prepare-data``: the command writes a prepared source and prints the acceptance figures;
its refusals are one line; a SIGKILL while tokenizing publishes nothing and the rerun completes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.data.tokens.format import MANIFEST, read_manifest

ROWS = 5000  # three map batches of 2048 rows: the kill lands after two were written


def _config(write_config, model_dir, corpus, name="config.yaml", train=None):
    return write_config(
        {
            "model": {"name_or_path": str(model_dir), "device": "cpu"},
            "data": {"train": train or str(corpus)},
            "batch": {"per_device_train_batch_size": 64},
        },
        name=name,
    )


def _corpus(tmp_path, rows=300):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(f'{{"anchor": "question {i} about a car", "positive": "answer {i}"}}\n' for i in range(rows))
    )
    return path


def test_prepare_data_prints_rows_bytes_and_the_ratio(tiny_model_dir, write_config, tmp_path):
    cfg = _config(write_config, tiny_model_dir, _corpus(tmp_path))
    out = tmp_path / "prepared"
    r = CliRunner().invoke(app, ["prepare-data", str(cfg), "--output", str(out), "model.max_seq_length=12"])
    assert r.exit_code == 0, r.output
    manifest = read_manifest(out)
    assert manifest.rows == 300 and manifest.max_seq_length == 12  # the override applied
    disk = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    m = re.search(
        r"300 rows, 1 part, ([\d.,]+) MB on disk \(([\d.,]+) B/row\); token ids alone: ([\d.,]+) MB", r.output
    )
    assert m, r.output
    assert float(m.group(2).replace(",", "")) == round(disk / 300, 1)
    assert re.search(r"disk / ids = \d\.\d{3}", r.output)
    # A second run into the finished folder is refused in one line, exit 2.
    again = CliRunner().invoke(app, ["prepare-data", str(cfg), "-o", str(out)])
    assert again.exit_code == 2 and "already a prepared source" in again.output
    assert len(again.output.strip().splitlines()) == 1


def test_part_auto_prepares_on_local_rank_0_only(tiny_model_dir, write_config, tmp_path, monkeypatch):
    cfg = _config(write_config, tiny_model_dir, _corpus(tmp_path))
    out = tmp_path / "prepared"
    env = {"RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}  # node 1 of 2
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    r = CliRunner().invoke(app, ["prepare-data", str(cfg), "-o", str(out), "--part", "auto"])
    assert r.exit_code == 0 and "node 1's part is prepared by its local rank 0" in r.output, r.output
    assert not out.exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    r = CliRunner().invoke(app, ["prepare-data", str(cfg), "-o", str(out), "--part", "auto"])
    assert r.exit_code == 0 and "part 1/2: tokenized 150 rows" in r.output, r.output
    assert "part 1/2 is prepared; the folder is complete once part 0 of 2 is too" in r.output, r.output
    assert "--part 0/2" in r.output and "waiting" not in r.output and not (out / MANIFEST).exists()


def test_several_sources_are_refused_naming_data_train(tiny_model_dir, write_config, tmp_path):
    corpus = _corpus(tmp_path)
    cfg = _config(write_config, tiny_model_dir, corpus, train={"a": str(corpus), "b": str(corpus)})
    r = CliRunner().invoke(app, ["prepare-data", str(cfg), "-o", str(tmp_path / "out")])
    assert r.exit_code == 2
    line = r.output.strip()
    assert line.startswith("error: data.train: 2 sources") and "prepare each separately" in line, line
    assert len(line.splitlines()) == 1 and "Traceback" not in r.output


KILL_WHILE_TOKENIZING = textwrap.dedent(
    """
    import os, signal, sys
    import cembed.data.tokens.encode as T

    real, done = T._tokenize_batch, [0]

    def tokenize_then_die(batch, indices, *args, **kwargs):
        if done[0] >= 4096:
            os.kill(os.getpid(), signal.SIGKILL)
        done[0] += len(indices)
        return real(batch, indices, *args, **kwargs)

    T._tokenize_batch = tokenize_then_die
    from cembed.cli.app import main
    sys.argv = ["cembed", "prepare-data", *sys.argv[1:]]
    main()
    """
)


@pytest.mark.slow
def test_sigkill_while_tokenizing_publishes_nothing_and_the_rerun_completes(tiny_model_dir, write_config, tmp_path):
    cfg = _config(write_config, tiny_model_dir, _corpus(tmp_path, ROWS))
    out = tmp_path / "prepared"
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    r = run("-c", KILL_WHILE_TOKENIZING, str(cfg), "-o", str(out))
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    assert not (out / MANIFEST).exists()
    left = [p.name for p in out.iterdir()]
    assert any(n.startswith(".tmp-") for n in left), left  # the killed run's partial output
    r = run("-m", "cembed", "prepare-data", str(cfg), "-o", str(out))
    assert r.returncode == 0, r.stderr
    manifest = read_manifest(out)
    assert manifest.rows == ROWS
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST] + [p.file for p in manifest.parts])
    r = run("-m", "cembed", "prepare-data", str(cfg), "-o", str(tmp_path / "straight"))
    assert r.returncode == 0, r.stderr
    assert read_manifest(tmp_path / "straight").fingerprint == manifest.fingerprint
    assert not (tmp_path / "hf").exists() or not [p for p in (tmp_path / "hf").rglob("*") if p.is_file()]


def test_a_prepared_source_is_refused_in_one_line(tiny_model_dir, write_config, tmp_path):
    cfg = _config(write_config, tiny_model_dir, _corpus(tmp_path, 20))
    one = tmp_path / "one"
    assert CliRunner().invoke(app, ["prepare-data", str(cfg), "-o", str(one)]).exit_code == 0
    again = _config(write_config, tiny_model_dir, None, name="again.yaml", train={"prepared": str(one)})
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["prepare-data", str(again), "-o", str(out)])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert line.startswith("error: data.train: ") and "already a prepared source" in line, line
    assert len(line.splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(
    ("first", "second", "key", "values"),
    [
        (["model.max_seq_length=12"], ["model.max_seq_length=16"], "max_seq_length", ("12", "16")),
        ([], ["data.prompts.anchor='q: '"], "prompts", ("none", "anchor 'q: '")),
    ],
)
def test_parts_prepared_with_different_settings_are_refused_naming_the_key_and_both_parts(
    tiny_model_dir, write_config, tmp_path, first, second, key, values
):
    """Issue 32 item 5a: the join of --part K/N refuses parts whose manifests differ, in one line
    naming the key, both parts and both values."""
    cfg = _config(write_config, tiny_model_dir, _corpus(tmp_path))
    out = tmp_path / "prepared"
    r = CliRunner().invoke(app, ["prepare-data", str(cfg), "-o", str(out), "--part", "0/2", *first])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["prepare-data", str(cfg), "-o", str(out), "--part", "1/2", *second])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "Traceback" not in line, r.output
    assert f"{key} differs" in line and "part 1 of 2" in line and "part 0" in line, line
    assert f"{values[1]} in part 1" in line and f"{values[0]} in part 0" in line, line
    assert "remove" in line and "prepare again" in line and not (out / MANIFEST).exists(), line
