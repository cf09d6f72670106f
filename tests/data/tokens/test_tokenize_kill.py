"""A run killed (SIGKILL) while it pre-tokenizes publishes nothing; the rerun completes and trains
exactly as a run whose preparation was never interrupted, and leaves one copy of the ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO
from safetensors.torch import load_file

from cembed.data.tokens.format import MANIFEST

pytestmark = pytest.mark.slow  # kills and reruns a training subprocess

ROWS = 5000  # three map batches of 2048 rows: the kill lands after two were written
KILL_AFTER_ROWS = 4096

# `cembed train` whose tokenizing map function SIGKILLs its own process once KILL_AFTER_ROWS rows
# were tokenized (the map writes each batch as it goes, so a partial output exists on disk).
KILL_WHILE_TOKENIZING = textwrap.dedent(
    f"""
    import os, signal, sys
    import cembed.data.tokens.encode as T

    real, done = T._tokenize_batch, [0]

    def tokenize_then_die(batch, indices, *args, **kwargs):
        if done[0] >= {KILL_AFTER_ROWS}:
            os.kill(os.getpid(), signal.SIGKILL)
        done[0] += len(indices)
        return real(batch, indices, *args, **kwargs)

    T._tokenize_batch = tokenize_then_die
    from cembed.cli.app import main
    sys.argv = ["cembed", "train", sys.argv[1]]
    main()
    """
)


def _config(write_config, tmp_path, model_dir, data, name, cache):
    return write_config(
        {
            "model": {"name_or_path": str(model_dir), "device": "cpu"},
            "data": {"train": str(data), "cache_dir": str(cache)},
            "batch": {"per_device_train_batch_size": 64, "mini_batch_size": 16},
            "optim": {"learning_rate": 1e-3, "base_batch_size": 64},
            "train": {"max_steps": 4, "logging_steps": 1, "output_dir": str(tmp_path / name), "seed": 3},
        },
        name=f"{name}.yaml",
    )


def _run(args, hf_cache):
    env = {**os.environ, "HF_DATASETS_CACHE": str(hf_cache)}  # datasets' own cache, one per preparation
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _entries(cache):
    root = cache / "tokenized"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


def test_kill_while_tokenizing_then_rerun_trains_as_uninterrupted(tiny_model_dir, write_config, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"anchor": f"question {i} about a {'red ' * (i % 5)}car", "positive": f"answer {i} street"})
            + "\n"
            for i in range(ROWS)
        )
    )
    straight = _config(write_config, tmp_path, tiny_model_dir, data, "straight", tmp_path / "cache-straight")
    r = _run(["-m", "cembed", "train", str(straight)], tmp_path / "hf-straight")
    assert r.returncode == 0, r.stderr

    cache = tmp_path / "cache-killed"
    killed = _config(write_config, tmp_path, tiny_model_dir, data, "killed", cache)
    r = _run(["-c", KILL_WHILE_TOKENIZING, str(killed)], tmp_path / "hf-killed")
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    # Nothing complete was published: no entry with its manifest.
    assert not [e for e in _entries(cache) if (cache / "tokenized" / e / MANIFEST).exists()], _entries(cache)
    partial = [e for e in _entries(cache) if e.startswith(".")] + [
        p.name for p in (tmp_path / "hf-killed").rglob("tmp*") if p.is_file() and p.stat().st_size
    ]
    assert partial, "the kill came before anything was written"

    rerun = _config(write_config, tmp_path, tiny_model_dir, data, "rerun", cache)
    r = _run(["-m", "cembed", "train", str(rerun)], tmp_path / "hf-killed")
    assert r.returncode == 0, r.stderr
    a = json.loads((tmp_path / "straight" / "run_summary.json").read_text())
    b = json.loads((tmp_path / "rerun" / "run_summary.json").read_text())
    assert b["status"] == "completed" and b["tokenization"]["pretokenized"] is True
    assert b["tokenization"]["from_cache"] is False  # the killed run's partial output was not used
    assert b["losses"] == a["losses"] and len(b["losses"]) == 4  # the same batches, step by step
    wa, wb = (
        load_file(str(tmp_path / "straight" / "model.safetensors")),
        load_file(str(tmp_path / "rerun" / "model.safetensors")),
    )
    assert all((wa[k] == wb[k]).all() for k in wa)

    # One entry, no temporary folder of the killed writer left behind, and no copy of the ids (or
    # a killed map's partial file) in datasets' own cache: only the source's JSON -> Arrow file.
    assert _entries(cache) == _entries(tmp_path / "cache-straight") and len(_entries(cache)) == 1
    leftovers = [
        str(p.relative_to(tmp_path))
        for hf in ("hf-killed", "hf-straight")
        for p in (tmp_path / hf).rglob("*")
        if p.is_file() and (p.name.startswith("tmp") or p.name.startswith("cache-"))
    ]
    assert leftovers == []
