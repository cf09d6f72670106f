"""cembed.plugins: an installed distribution's ``cembed.plugins`` entry points run once per process,
before a config is validated (a callable is called, a module imported); one that fails stops the
command with one line naming it. The distributions here are written into a temporary folder on
``sys.path`` (``install_distribution``), as pip would write them into site-packages."""

from __future__ import annotations

import sys

import pytest
from conftest import install_distribution

import cembed.plugins as plugins
from cembed.config.file import config_from_dict, load_config
from cembed.config.loss import LOSS_CONFIGS
from cembed.config.sources import SOURCE_CONFIGS, SourceConfig
from cembed.errors import UserError

COUNTING = """
    from typing import Literal

    from cembed.config.sources import SourceConfig, register_source_config

    CALLS = []


    class CountedSource(SourceConfig):
        kind: Literal["counted"] = "counted"
        rows: int

        @property
        def label(self) -> str:
            return f"{self.rows} counted rows"

        def default_name(self) -> str:
            return "counted"


    def register():
        CALLS.append(1)
        register_source_config(CountedSource)
"""

LOSS_MODULE = """
    from typing import Literal

    from cembed.config.loss import LossConfig, register_loss_config


    class ModuleLossConfig(LossConfig):
        name: Literal["module_loss"] = "module_loss"
        margin: float = 0.5


    register_loss_config(ModuleLossConfig)  # importing the module is the registration
"""


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """Installs distributions into a folder on sys.path for one test; afterwards their modules,
    registrations and the record of loaded plugins are gone."""
    site = tmp_path / "site"
    site.mkdir()
    loaded = dict(plugins.LOADED)
    names: list[str] = []

    def install(name: str, files: dict[str, str], points: dict[str, str]) -> None:
        install_distribution(site, name, files, {plugins.GROUP: points})
        names.extend(path.split("/")[0].removesuffix(".py") for path in files)
        monkeypatch.syspath_prepend(str(site))  # also clears importlib's caches

    yield install
    plugins.LOADED.clear()
    plugins.LOADED.update(loaded)
    for module in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[module]
    SOURCE_CONFIGS.pop("counted", None)
    LOSS_CONFIGS.pop("module_loss", None)


def test_a_callable_plugin_registers_a_kind_once_before_the_config_validates(plugin_site, tmp_path):
    plugin_site("counting", {"counting.py": COUNTING}, {"counted": "counting:register"})
    assert "counted" not in SOURCE_CONFIGS  # nothing runs on install: the config loader loads plugins
    cfg = config_from_dict({"data": {"train": {"kind": "counted", "rows": 3}}}, base=tmp_path)
    assert type(cfg.data.train).__name__ == "CountedSource" and cfg.data.train.rows == 3
    assert isinstance(cfg.data.train, SourceConfig)
    assert plugins.load_plugins()["counted"] == "counting:register"
    config_from_dict({"data": {"train": {"kind": "counted", "rows": 4}}}, base=tmp_path)
    assert sys.modules["counting"].CALLS == [1]  # run once per process, however many configs are read


def test_a_module_plugin_registers_by_being_imported(plugin_site, tmp_path):
    plugin_site("modloss", {"modloss.py": LOSS_MODULE}, {"module_loss": "modloss"})
    cfg = config_from_dict(
        {"data": {"train": "x.jsonl"}, "loss": {"name": "module_loss", "margin": 0.2}}, base=tmp_path
    )
    assert type(cfg.loss).__name__ == "ModuleLossConfig" and cfg.loss.margin == 0.2


def test_a_plugin_that_fails_to_load_is_one_line_naming_it(plugin_site, write_config):
    plugin_site(
        "broken",
        {"broken.py": "import not_installed_anywhere\n\ndef register():\n    pass\n"},
        {"sql": "broken:register"},
    )
    path = write_config({"data": {"train": "x.jsonl"}})
    with pytest.raises(UserError) as err:
        load_config(path)
    message = str(err.value)
    assert message == (
        "cembed plugin 'sql' (broken:register, entry point group cembed.plugins) failed to load: "
        "ModuleNotFoundError: No module named 'not_installed_anywhere'"
    )
    assert "sql" not in plugins.LOADED  # a later command tries again (and says the same)


def test_a_plugin_whose_registration_fails_is_named_too(plugin_site, tmp_path):
    clash = """
        from typing import Literal

        from cembed.config.sources import SourceConfig, register_source_config


        class AnotherFile(SourceConfig):
            kind: Literal["file"] = "file"


        def register():
            register_source_config(AnotherFile)
    """
    plugin_site("clash", {"clash.py": clash}, {"clash": "clash:register"})
    with pytest.raises(
        UserError,
        match=r"^cembed plugin 'clash' \(clash:register, .*\) failed to load: ValueError: source kind 'file' is already registered \(FileSource\)$",
    ):
        config_from_dict({"data": {"train": "x.jsonl"}}, base=tmp_path)


def test_without_plugins_nothing_is_loaded(tmp_path):
    before = dict(plugins.LOADED)
    config_from_dict({"data": {"train": "x.jsonl"}}, base=tmp_path)
    assert plugins.LOADED == before and "counted" not in SOURCE_CONFIGS


def test_an_unknown_kind_still_lists_the_registered_ones(tmp_path):
    with pytest.raises(UserError, match="'file', 'hub', 'beir', 'prepared'"):
        config_from_dict({"data": {"train": {"kind": "counted", "rows": 3}}}, base=tmp_path)
