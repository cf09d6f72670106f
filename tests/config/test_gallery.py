"""The recipe gallery (configs/) validates, and a hub dataset that cannot be reached only warns in
``validate`` while ``train`` still stops with the clear error."""

from __future__ import annotations

import pytest
from conftest import REPO, distinct_pairs
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import config_from_dict
from cembed.data.rows import UnloadedData
from cembed.errors import HubUnavailable
from cembed.train.recipe import check_run_inputs

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
RECIPES = {
    "seed-minilm-65536-bf16.yaml",
    "hard-negatives-allnli.yaml",
    "retrieval-msmarco.yaml",
    "multi-gpu-8.yaml",
    "multi-node-2x8.yaml",
}


@pytest.fixture
def offline(monkeypatch):
    """The datasets hub in offline mode, as in CI (HF_DATASETS_OFFLINE=1)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_gallery_has_the_recipes_with_headers():
    names = {p.name for p in CONFIGS}
    assert RECIPES <= names
    for path in CONFIGS:
        header = path.read_text().split("\nmodel:")[0]
        assert header.startswith("#") and len(header.splitlines()) >= 3, path.name
    for name in RECIPES:
        header = (REPO / "configs" / name).read_text().split("\nmodel:")[0]
        assert "Hardware:" in header and "Data:" in header, name
    assert "--nproc-per-node 8 --nnodes 2 --node-rank 1" in (REPO / "configs" / "multi-node-2x8.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates(path, offline):
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    assert "config OK" in r.output


@pytest.mark.slow
def test_seed_recipe_plan_and_offline_warning(offline):
    r = CliRunner().invoke(app, ["validate", str(REPO / "configs" / "seed-minilm-65536-bf16.yaml")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert (
        "warning: data: hub dataset sentence-transformers/gooaq not loaded (offline: HF_DATASETS_OFFLINE=1); "
        "rows and columns unchecked" in text
    )
    assert "65536 samples per optimizer step" in text
    assert "effective learning_rate: 9.051e-04 = 2e-05 x sqrt(65536/32)" in text
    assert "model loads; max_seq_length 256" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "flags", "samples", "lr"),
    [
        ("multi-gpu-8.yaml", ["--nproc-per-node", "8"], 65536, "9.051e-04"),
        ("multi-node-2x8.yaml", ["--nproc-per-node", "8", "--nnodes", "2"], 131072, "1.280e-03"),
    ],
)
def test_multi_gpu_recipes_global_batch(name, flags, samples, lr, offline):
    r = CliRunner().invoke(app, ["validate", str(REPO / "configs" / name), *flags])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert f"= {samples} samples per optimizer step" in text and f"effective learning_rate: {lr}" in text


def _hub_config(tmp_path, tiny_model_dir, **extra):
    data = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {"train": {"path": "someone/some-pairs", "split": "train"}},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 8},
        **extra,
    }
    return config_from_dict(data, base=tmp_path)


def test_offline_hub_is_unloaded_for_validate_but_an_error_for_train(tmp_path, tiny_model_dir, offline):
    cfg = _hub_config(tmp_path, tiny_model_dir)
    plan, data = check_run_inputs(cfg, allow_unloaded=True)
    assert isinstance(data, UnloadedData) and plan.samples_per_step == 8
    assert data.message == (
        "data: hub dataset someone/some-pairs not loaded (offline: HF_DATASETS_OFFLINE=1); rows and columns unchecked"
    )
    with pytest.raises(HubUnavailable, match=r"data: cannot load hub dataset 'someone/some-pairs'"):
        check_run_inputs(cfg)


def test_offline_hub_still_checks_the_rest(tmp_path, tiny_model_dir, offline, write_config, pairs_file):
    sts = tmp_path / "sts.csv"
    sts.write_text("sentence1\tsentence2\tscore\n")
    base = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {"train": {"path": "someone/some-pairs"}},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 8},
    }
    # an eval set that does not exist is still reported (exit 2)
    path = write_config({**base, "eval": {"sts": str(tmp_path / "missing.csv")}})
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 2 and "missing.csv" in r.output
    # fp16 on CPU is still refused
    path = write_config({**base, "model": {**base["model"], "precision": "fp16"}})
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 2 and "fp16 needs a CUDA device" in r.output
    # `cembed train` stops with the clear error
    path = write_config(base)
    r = CliRunner().invoke(app, ["train", str(path)])
    assert r.exit_code == 2 and "cannot load hub dataset 'someone/some-pairs'" in r.output
    # a local file is unaffected: its rows are checked
    path = write_config({**base, "data": {"train": str(pairs_file(distinct_pairs(16)))}})
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0 and "question number 0" in r.output and "not loaded" not in r.output


def test_unknown_hub_error_is_not_downgraded(tmp_path, tiny_model_dir, monkeypatch):
    import datasets

    def broken(*args, **kwargs):
        raise ValueError("BuilderConfig 'nope' not found")

    monkeypatch.setattr(datasets, "load_dataset", broken)
    cfg = _hub_config(tmp_path, tiny_model_dir)
    with pytest.raises(Exception, match="BuilderConfig 'nope' not found") as err:
        check_run_inputs(cfg, allow_unloaded=True)
    assert not isinstance(err.value, HubUnavailable)


def test_unreachable_hub_reason_names_the_library_message(tmp_path, tiny_model_dir, monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/some-pairs' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    _, data = check_run_inputs(_hub_config(tmp_path, tiny_model_dir), allow_unloaded=True)
    assert data.reason == "hub unreachable: Couldn't reach 'someone/some-pairs' on the Hub (LocalEntryNotFoundError)"


def test_recipes_name_their_public_dataset_in_the_header():
    from cembed.config.file import load_config
    from cembed.config.sources import HubSource

    for name in RECIPES:
        path = REPO / "configs" / name
        header, body = path.read_text().split("\nmodel:")
        assert "../../" not in body, name  # nothing outside the repo
        cfg = load_config(path)
        assert cfg.model.name_or_path == "all-MiniLM-L6-v2"
        assert isinstance(cfg.data.train, HubSource) and cfg.data.train.path in header, name
