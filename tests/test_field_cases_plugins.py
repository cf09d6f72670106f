"""Field cases (issue 39 item 10) for plugins (``cembed.plugins``), each built from a public bug report
about entry-point plugins in the field's tools and compared with a reference computed without cembed
(what ``importlib.metadata`` itself lists). docs/development.md lists the round."""

from __future__ import annotations

import sys
from importlib.metadata import distributions, entry_points

import pytest
from conftest import install_distribution

import cembed.plugins as plugins
from cembed.config.file import config_from_dict
from cembed.config.sources import SOURCE_CONFIGS
from cembed.data.sources.registry import LOADERS

COUNTED = """
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


@pytest.fixture
def restored():
    """Afterwards the record of loaded plugins, the registries and the plugin modules are as before."""
    saved = dict(plugins.LOADED), dict(plugins.MODULES), dict(SOURCE_CONFIGS), dict(LOADERS)
    yield
    for registry, before in zip((plugins.LOADED, plugins.MODULES, SOURCE_CONFIGS, LOADERS), saved):
        registry.clear()
        registry.update(before)
    sys.modules.pop("countedkind", None)


def test_one_distribution_seen_twice_on_the_path_loads_once(tmp_path, monkeypatch, restored):
    """layday/instawow#188 ("Plugin registered twice on systems where venv lib64 symlinks to lib":
    the same dist-info found through two sys.path entries, then "Plugin name already registered"):
    site-packages on the path as ``lib`` and as its ``lib64`` symlink. The reference: importlib.metadata
    finds the distribution twice; cembed runs its plugin once, and the kind it registers is usable."""
    lib = install_distribution(
        tmp_path / "lib",
        "counted-kind",
        {"countedkind.py": COUNTED},
        {plugins.GROUP: {"counted": "countedkind:register"}},
    )
    (tmp_path / "lib64").symlink_to(lib, target_is_directory=True)
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.syspath_prepend(str(tmp_path / "lib64"))
    assert sum(d.metadata["Name"] == "counted-kind" for d in distributions()) == 2  # the duplicate is real
    loaded = plugins.load_plugins()
    assert ("counted-kind", "counted") in loaded
    assert sys.modules["countedkind"].CALLS == [1]
    source = config_from_dict({"data": {"train": {"kind": "counted", "rows": 3}}}).data.sources()[0].source
    assert source.label == "3 counted rows"


def test_one_callable_under_two_entry_point_names_is_no_clash(tmp_path, monkeypatch, restored):
    """pytest-dev/pytest#919 (one distribution supplying several plugins) and PyCQA/flake8#1090 (entry
    points that name the same thing): a distribution that points two entry-point names at one
    register function. The reference: importlib.metadata lists both points; cembed loads both, the
    function runs twice and registering the same class again is no clash."""
    site = install_distribution(
        tmp_path / "site",
        "counted-kind",
        {"countedkind.py": COUNTED},
        {plugins.GROUP: {"counted": "countedkind:register", "counted_alias": "countedkind:register"}},
    )
    monkeypatch.syspath_prepend(str(site))
    points = [p for p in entry_points(group=plugins.GROUP) if p.dist is not None and p.dist.name == "counted-kind"]
    assert sorted(p.name for p in points) == ["counted", "counted_alias"]
    loaded = plugins.load_plugins()
    assert {("counted-kind", "counted"), ("counted-kind", "counted_alias")} <= set(loaded)
    assert sys.modules["countedkind"].CALLS == [1, 1]
    assert SOURCE_CONFIGS["counted"].__name__ == "CountedSource"
