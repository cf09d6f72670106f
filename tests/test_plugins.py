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
    loaded, modules = dict(plugins.LOADED), dict(plugins.MODULES)
    sources, losses = dict(SOURCE_CONFIGS), dict(LOSS_CONFIGS)
    names: list[str] = []

    def install(name: str, files: dict[str, str], points: dict[str, str]) -> None:
        install_distribution(site, name, files, {plugins.GROUP: points})
        names.extend(path.split("/")[0].removesuffix(".py") for path in files)
        monkeypatch.syspath_prepend(str(site))  # also clears importlib's caches

    yield install
    plugins.LOADED.clear()
    plugins.LOADED.update(loaded)
    plugins.MODULES.clear()
    plugins.MODULES.update(modules)
    for module in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[module]
    for registry, before in ((SOURCE_CONFIGS, sources), (LOSS_CONFIGS, losses)):
        registry.clear()
        registry.update(before)


def test_a_callable_plugin_registers_a_kind_once_before_the_config_validates(plugin_site, tmp_path):
    plugin_site("counting", {"counting.py": COUNTING}, {"counted": "counting:register"})
    assert "counted" not in SOURCE_CONFIGS  # nothing runs on install: the config loader loads plugins
    cfg = config_from_dict({"data": {"train": {"kind": "counted", "rows": 3}}}, base=tmp_path)
    assert type(cfg.data.train).__name__ == "CountedSource" and cfg.data.train.rows == 3
    assert isinstance(cfg.data.train, SourceConfig)
    assert plugins.load_plugins()[("counting", "counted")] == "counting:register"
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
        "cembed plugin 'sql' of distribution 'broken' (broken:register, entry point group cembed.plugins) failed "
        "to load: ModuleNotFoundError: No module named 'not_installed_anywhere'"
    )
    assert ("broken", "sql") not in plugins.LOADED  # a later command tries again (and says the same)


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
        match=r"^cembed plugin 'clash' of distribution 'clash' \(clash:register, .*\) failed to load: ValueError: "
        r"source kind 'file' is already registered \(FileSource\)$",
    ):
        config_from_dict({"data": {"train": "x.jsonl"}}, base=tmp_path)


def test_without_plugins_nothing_is_loaded(tmp_path):
    before = dict(plugins.LOADED)
    config_from_dict({"data": {"train": "x.jsonl"}}, base=tmp_path)
    assert plugins.LOADED == before and "counted" not in SOURCE_CONFIGS


def test_an_unknown_kind_still_lists_the_registered_ones(tmp_path):
    with pytest.raises(UserError, match="'file', 'hub', 'beir', 'prepared'"):
        config_from_dict({"data": {"train": {"kind": "counted", "rows": 3}}}, base=tmp_path)


# --- issue 39 item 3: what a plugin does at import, and plugins identified by distribution --------


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        # argparse at import parses cembed's (here pytest's) command line: usage on stderr, exit 2
        (
            "import argparse\nargparse.ArgumentParser(prog='exiting').parse_args(['--nope'])\n",
            "SystemExit(2): it tried to end the process while loading (its output, if any, is above)",
        ),
        ("import sys\nsys.exit('bye')\n", "SystemExit('bye'): it tried to end the process while loading"),
        ("class Odd(BaseException):\n    pass\n\nraise Odd('not an Exception')\n", "Odd: not an Exception"),
    ],
    ids=["argparse", "sys.exit", "BaseException"],
)
def test_a_plugin_that_exits_at_import_is_one_line_naming_it_and_its_distribution(
    plugin_site, tmp_path, source, reason
):
    plugin_site("exiting-plugin", {"exiting.py": source}, {"exiter": "exiting:register"})
    with pytest.raises(UserError) as err:
        config_from_dict({"data": {"train": "x.jsonl"}}, base=tmp_path)
    assert str(err.value).startswith(
        "cembed plugin 'exiter' of distribution 'exiting-plugin' (exiting:register, entry point group "
        f"cembed.plugins) failed to load: {reason}"
    ), str(err.value)
    assert "\n" not in str(err.value)


def test_a_keyboard_interrupt_while_a_plugin_loads_is_not_swallowed(plugin_site, tmp_path):
    plugin_site("interrupted", {"interrupted.py": "raise KeyboardInterrupt\n"}, {"stop": "interrupted"})
    with pytest.raises(KeyboardInterrupt):
        config_from_dict({"data": {"train": "x.jsonl"}}, base=tmp_path)


CHATTY = """
    import os

    print("chatty plugin: importing")
    os.write(1, b"chatty plugin: a C extension's output\\n")


    def register():
        print("chatty plugin: registering")
"""


def test_what_a_plugin_prints_while_loading_goes_to_stderr(plugin_site, capfd):
    plugin_site("chatty", {"chatty.py": CHATTY}, {"chatty": "chatty:register"})
    print("before")
    plugins.load_plugins()
    print("after")
    out, err = capfd.readouterr()
    assert out == "before\nafter\n"
    assert err.splitlines() == [
        "chatty plugin: importing",
        "chatty plugin: a C extension's output",
        "chatty plugin: registering",
    ]


def test_validate_json_stays_one_object_with_a_plugin_that_prints(
    plugin_site, write_config, pairs_file, tiny_model_dir, tmp_path
):
    import json

    from conftest import distinct_pairs
    from typer.testing import CliRunner

    from cembed.cli.app import app

    plugin_site("chatty", {"chatty.py": CHATTY.replace("os.write(1,", "print(")}, {"chatty": "chatty:register"})
    config = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(32)))},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run")},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(config), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["data"]["rows"] == 32  # stdout is the one JSON object, nothing else
    assert "chatty plugin: importing" in r.stderr and "chatty plugin: registering" in r.stderr


def _kind_plugin(kind: str, cls: str) -> str:
    return f"""
        from typing import Literal

        from cembed.config.sources import SourceConfig, register_source_config


        class {cls}(SourceConfig):
            kind: Literal["{kind}"] = "{kind}"
            rows: int

            def default_name(self) -> str:
                return "{kind}"


        def register():
            register_source_config({cls})
    """


def test_two_distributions_with_the_same_entry_point_name_both_load(plugin_site, tmp_path):
    plugin_site("kind-alpha", {"kind_alpha.py": _kind_plugin("alpha", "Alpha")}, {"extra": "kind_alpha:register"})
    plugin_site("kind-beta", {"kind_beta.py": _kind_plugin("beta", "Beta")}, {"extra": "kind_beta:register"})
    for kind, cls in (("alpha", "Alpha"), ("beta", "Beta")):
        cfg = config_from_dict({"data": {"train": {"kind": kind, "rows": 2}}}, base=tmp_path)
        assert type(cfg.data.train).__name__ == cls
    assert {k: v for k, v in plugins.LOADED.items() if k[1] == "extra"} == {
        ("kind-alpha", "extra"): "kind_alpha:register",
        ("kind-beta", "extra"): "kind_beta:register",
    }


def test_two_plugins_registering_one_kind_is_one_line_naming_both(plugin_site, tmp_path):
    plugin_site("sql-one", {"sql_one.py": _kind_plugin("sql", "SqlOne")}, {"sql": "sql_one:register"})
    plugin_site("sql-two", {"sql_two.py": _kind_plugin("sql", "SqlTwo")}, {"sql": "sql_two:register"})
    with pytest.raises(UserError) as err:
        config_from_dict({"data": {"train": "x.jsonl"}}, base=tmp_path)
    (first,) = [dist for dist, name in plugins.LOADED if name == "sql"]  # the directory's order decides
    second, cls = ("sql-two", "SqlOne") if first == "sql-one" else ("sql-one", "SqlTwo")
    module = second.replace("-", "_")
    assert str(err.value) == (
        f"cembed plugin 'sql' of distribution '{second}' ({module}:register, entry point group cembed.plugins) "
        f"failed to load: ValueError: source kind 'sql' is already registered ({cls}, from cembed plugin 'sql' of "
        f"distribution '{first}')"
    )


# --- what load_plugins records: the loop goes on past a loaded plugin, an entry point of no known
# distribution, and cembed's own modules never counted as a plugin's


def test_a_plugin_installed_later_loads_past_the_ones_already_loaded(plugin_site, tmp_path, monkeypatch):
    import importlib

    plugin_site("kind-alpha", {"kind_alpha.py": _kind_plugin("alpha", "Alpha")}, {"alpha": "kind_alpha:register"})
    assert ("kind-alpha", "alpha") in plugins.load_plugins()
    later = tmp_path / "later-site"  # after the first on sys.path: its plugin comes after the loaded one
    later.mkdir()
    install_distribution(
        later,
        "kind-beta",
        {"kind_beta.py": _kind_plugin("beta", "Beta")},
        {plugins.GROUP: {"beta": "kind_beta:register"}},
    )
    monkeypatch.setattr(sys, "path", [*sys.path, str(later)])
    importlib.invalidate_caches()
    try:
        assert plugins.load_plugins()[("kind-beta", "beta")] == "kind_beta:register"
        assert "beta" in SOURCE_CONFIGS
    finally:
        sys.modules.pop("kind_beta", None)


def test_an_entry_point_of_no_known_distribution_is_named_unknown(plugin_site, monkeypatch):
    from importlib.metadata import EntryPoint

    loose = EntryPoint(name="loose", value="json", group=plugins.GROUP)  # no distribution: a module
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [loose] if group == plugins.GROUP else [])
    assert plugins.load_plugins()[("unknown", "loose")] == "json"


def test_cembeds_own_modules_a_plugin_imports_are_not_the_plugins(plugin_site, monkeypatch):
    """A plugin whose loading first imports a cembed module (a loss plugin imports cembed's loss
    registry) does not own what that module defines: a clash with a built-in names the built-in alone."""
    import cembed.data.sources as package
    import cembed.data.sources.file_stream  # noqa: F401 - imported before the plugin, as the CLI does

    name = "cembed.data.sources.file_stream"  # a module of functions only: importing it again is harmless
    monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(package, "file_stream", package.file_stream)  # put back after the test
    importer = "import cembed.data.sources.file_stream\n\n\ndef register():\n    pass\n"
    plugin_site("importer", {"importer.py": importer}, {"importer": "importer:register"})
    plugins.load_plugins()
    assert plugins.plugin_of(sys.modules[name].open_file_stream) is None
    assert plugins.plugin_of(sys.modules["importer"].register) == "cembed plugin 'importer' of distribution 'importer'"
    assert plugins.plugin_of(object()) is None  # an object of no module
