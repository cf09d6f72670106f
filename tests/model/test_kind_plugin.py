"""A model kind from a ``cembed.plugins`` entry point (issue 40 item 1): the plugin registers both halves
through the registries only, a config names the kind, and ``load_model`` loads it as that kind. The
distribution is written into a temporary folder on ``sys.path`` (``install_distribution``)."""

from __future__ import annotations

import sys

import pytest
from conftest import install_distribution

import cembed.plugins as plugins
from cembed.config.file import config_from_dict
from cembed.config.model import MODEL_CONFIGS
from cembed.model.kinds.lookup import kind_of
from cembed.model.kinds.registry import MODEL_KINDS
from cembed.model.load import load_model

HALVED = """
    from typing import ClassVar, Literal

    from cembed.config.model import ModelConfig
    from cembed.model.kinds.dense import DenseKind
    from cembed.model.kinds.registry import register_model_kind


    class HalvedConfig(ModelConfig):
        not_options: ClassVar[dict] = {"model.lora": "halved models train every weight"}
        kind: Literal["halved"] = "halved"


    class HalvedKind(DenseKind):
        def load(self, path, cfg, device, model_kwargs, saved, model_type=None, seed=0):
            model = super().load(path, cfg, device, model_kwargs, saved, model_type, seed)
            model.cembed_halved = True
            return model

        def describe(self, model, cfg, saved):
            return "halved: " + super().describe(model, cfg, saved)


    def register():
        register_model_kind(HalvedConfig, HalvedKind())
"""


@pytest.fixture
def halved_plugin(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    loaded = dict(plugins.LOADED)
    install_distribution(site, "halved", {"halved.py": HALVED}, {plugins.GROUP: {"halved": "halved:register"}})
    monkeypatch.syspath_prepend(str(site))
    yield
    plugins.LOADED.clear()
    plugins.LOADED.update(loaded)
    sys.modules.pop("halved", None)
    MODEL_CONFIGS.pop("halved", None)
    MODEL_KINDS.pop("halved", None)


def test_a_plugin_kind_validates_and_loads_as_itself(halved_plugin, tiny_model_dir, tmp_path):
    assert "halved" not in MODEL_CONFIGS  # installing runs nothing: the config loader loads plugins
    cfg = config_from_dict(
        {"model": {"kind": "halved", "name_or_path": str(tiny_model_dir)}, "data": {"train": "x.jsonl"}},
        base=tmp_path,
    )
    assert type(cfg.model).__name__ == "HalvedConfig"
    model = load_model(cfg.model, "cpu")
    assert model.cembed_halved and kind_of(model) is MODEL_KINDS["halved"]  # not dense, whose class it shares
    assert MODEL_KINDS["halved"].describe(model, cfg.model, True).startswith("halved: mean")
    with pytest.raises(Exception, match="model.lora: not an option of model.kind halved: halved models train"):
        config_from_dict(
            {"model": {"kind": "halved", "lora": {"r": 4}}, "data": {"train": "x.jsonl"}},
            base=tmp_path,
        )
