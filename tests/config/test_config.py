"""Config loading: every user mistake is a one-line UserError naming the file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from cembed.config.file import load_config
from cembed.errors import UserError


def _base(train: str = "pairs.jsonl") -> dict:
    return {"data": {"train": train}, "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4}}


def test_valid_config_defaults_and_relative_paths(write_config, tmp_path):
    cfg = load_config(write_config(_base()))
    assert cfg.data.train.path == str(tmp_path / "pairs.jsonl")
    assert cfg.train.output_dir == str(tmp_path / "runs" / "cembed")
    assert cfg.optim.lr_scaling == "sqrt" and cfg.loss.name == "cached_mnrl" and cfg.sampler.no_duplicates
    assert cfg.train.num_train_epochs == 1.0 and cfg.batch.drop_last is True


def test_yaml_syntax_error_names_line_and_column(write_config):
    path = write_config("data:\n  train: pairs.jsonl\nbatch: [1, 2\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    msg = str(e.value)
    assert f"{path}:4:1: YAML syntax error" in msg


def test_unknown_key_did_you_mean(write_config):
    cfg = _base()
    cfg["batch"]["mini_bach_size"] = 4
    path = write_config(cfg)
    with pytest.raises(UserError) as e:
        load_config(path)
    msg = str(e.value)
    assert "unknown key 'batch.mini_bach_size'" in msg
    assert "did you mean 'batch.mini_batch_size'?" in msg
    assert f"{path}:6: " in msg  # the line of the offending key


def test_unknown_section_did_you_mean(write_config):
    cfg = _base()
    cfg["optimizer"] = {"learning_rate": 1e-4}
    with pytest.raises(UserError, match=r"unknown key 'optimizer'; did you mean 'optim'\?"):
        load_config(write_config(cfg))


def test_wrong_type_names_dotted_field(write_config):
    cfg = _base()
    cfg["optim"] = {"learning_rate": "fast"}
    with pytest.raises(UserError, match=r"optim\.learning_rate: .*number.*\(got 'fast'\)"):
        load_config(write_config(cfg))


@pytest.mark.parametrize("value", [0, -3, 2.5, "auto-ish"])
def test_mini_batch_size_not_positive_int(write_config, value):
    cfg = _base()
    cfg["batch"]["mini_batch_size"] = value
    with pytest.raises(UserError, match=r"batch\.mini_batch_size"):
        load_config(write_config(cfg))


def test_mini_batch_larger_than_batch(write_config):
    cfg = _base()
    cfg["batch"]["mini_batch_size"] = 16
    with pytest.raises(
        UserError, match=r"batch: mini_batch_size \(16\) is larger than per_device_train_batch_size \(8\)"
    ):
        load_config(write_config(cfg))


def test_overrides_are_validated_like_the_file(write_config):
    path = write_config(_base())
    cfg = load_config(path, ["batch.per_device_train_batch_size=64", "optim.learning_rate=1e-4", "loss.symmetric=true"])
    assert cfg.batch.per_device_train_batch_size == 64
    assert cfg.optim.learning_rate == pytest.approx(1e-4)
    assert cfg.loss.symmetric is True
    with pytest.raises(UserError, match=r"batch\.mini_batch_size: .*greater than 0"):
        load_config(path, ["batch.mini_batch_size=0"])
    with pytest.raises(UserError, match=r"unknown key 'batch.mini_batchsize'; did you mean 'batch.mini_batch_size'"):
        load_config(path, ["batch.mini_batchsize=2"])
    with pytest.raises(UserError, match=r"expected section.field=value"):
        load_config(path, ["batch.mini_batch_size"])


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match=r"nope\.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_config_must_be_mapping(write_config):
    with pytest.raises(UserError, match=r"must be a mapping of sections .* not a list"):
        load_config(write_config("- a\n- b\n"))


def test_missing_data_train(write_config):
    with pytest.raises(UserError, match=r"missing required field 'data'"):
        load_config(write_config({"batch": {"mini_batch_size": 4}}))


def test_bad_literal_names_field(write_config):
    cfg = _base()
    cfg["optim"] = {"lr_scaling": "cubic"}
    with pytest.raises(UserError, match=r"optim\.lr_scaling: Input should be 'sqrt', 'linear' or 'none'"):
        load_config(write_config(cfg))


def test_shipped_configs_validate():
    for path in Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"):
        load_config(path)
