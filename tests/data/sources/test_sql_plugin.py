"""A newcomer's source kind from a plugin: a SQL table (or query) of a SQLite file, read with
``datasets.Dataset.from_sql`` (SQLAlchemy's ``sqlite:///`` URI, offline), in a distribution of its
own (``sqlkind``, written here as pip would install it) whose ``cembed.plugins`` entry points
register the kind (a callable) and a loss (a module). No cembed file names it: the config validates,
its rows load with their exact count, ``init`` reads it, and (slow) ``cembed validate`` and
``cembed train`` run from it in a fresh process."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest
from conftest import REPO, install_distribution

import cembed.plugins as plugins
from cembed.config.file import load_config
from cembed.config.loss import LOSS_CONFIGS
from cembed.config.sources import SOURCE_CONFIGS
from cembed.data.batchable import load_checked_data
from cembed.data.sources.registry import LOADERS
from cembed.data.starter import make_starter
from cembed.errors import UserError
from cembed.losses.registry import LOSS_BUILDERS

SQLKIND = '''
    """A cembed plugin: the ``sql`` source kind, a table or query of a SQLite file."""

    from __future__ import annotations

    import tempfile
    from pathlib import Path
    from typing import ClassVar, Literal

    from pydantic import model_validator

    from cembed.config.sources import SourceConfig, register_source_config
    from cembed.errors import UserError


    class SqlSource(SourceConfig):
        """A SQLite file's table, or the rows of a query on it."""

        kind: Literal["sql"] = "sql"
        path: str
        table: str | None = None
        query: str | None = None

        path_fields: ClassVar[tuple[str, ...]] = ("path",)  # resolved against the config's folder
        reads_files: ClassVar[bool] = True  # one file: a folder prepared from it records 1 input file

        @model_validator(mode="after")
        def _table_or_query(self):
            if (self.table is None) == (self.query is None):
                raise ValueError("give `table` or `query` (one of them)")
            return self

        @property
        def label(self) -> str:
            return f"{self.path} ({'table ' + self.table if self.table else 'query'})"

        def default_name(self) -> str:
            return self.table or Path(self.path).stem


    def load_sql(source: SqlSource):
        import datasets

        if not Path(source.path).is_file():
            raise UserError(f"{source.path}: SQLite file not found")
        # datasets caches by query and URI, not by the file's content: a fresh cache each time.
        with tempfile.TemporaryDirectory() as cache:
            return datasets.Dataset.from_sql(
                source.query or source.table, f"sqlite:///{source.path}", cache_dir=cache, keep_in_memory=True
            )


    def register() -> None:
        from cembed.data.sources.registry import register_source_loader

        register_source_config(SqlSource)
        register_source_loader("sql", load_sql)
'''

HALVED_LOSS = '''
    """Importing this module registers the ``halved_mnrl`` loss: half of sentence-transformers' MNRL."""

    from typing import Literal

    from sentence_transformers.losses import MultipleNegativesRankingLoss
    from torch import nn

    from cembed.config.loss import LossConfig
    from cembed.losses.registry import register_loss


    class HalvedMNRLConfig(LossConfig):
        name: Literal["halved_mnrl"] = "halved_mnrl"


    class HalvedMNRL(nn.Module):
        def __init__(self, model, scale: float) -> None:
            super().__init__()
            self.inner = MultipleNegativesRankingLoss(model, scale=scale)

        def forward(self, features, labels):
            return 0.5 * self.inner(features, labels)


    register_loss(HalvedMNRLConfig, lambda model, cfg, settings: HalvedMNRL(model, cfg.scale))
'''

ENTRY_POINTS = {plugins.GROUP: {"sql": "sqlkind:register", "halved_mnrl": "sqlkind.loss"}}


def _site(tmp_path):
    return install_distribution(
        tmp_path / "site", "sqlkind", {"sqlkind/__init__.py": SQLKIND, "sqlkind/loss.py": HALVED_LOSS}, ENTRY_POINTS
    )


def _database(path, rows: int):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE pairs (question TEXT, answer TEXT)")
    con.executemany(
        "INSERT INTO pairs VALUES (?, ?)", [(f"question {i} about a red car", f"answer {i}") for i in range(rows)]
    )
    con.commit()
    con.close()
    return path


@pytest.fixture
def sqlkind(tmp_path, monkeypatch):
    """The ``sqlkind`` distribution on sys.path for one test; afterwards its modules, kinds, loss
    and the record of loaded plugins are gone."""
    loaded, modules = dict(plugins.LOADED), dict(plugins.MODULES)
    monkeypatch.syspath_prepend(str(_site(tmp_path)))
    yield
    for module in [m for m in sys.modules if m.split(".")[0] == "sqlkind"]:
        del sys.modules[module]
    SOURCE_CONFIGS.pop("sql", None)
    LOADERS.pop("sql", None)
    LOSS_CONFIGS.pop("halved_mnrl", None)
    LOSS_BUILDERS.pop("halved_mnrl", None)
    plugins.LOADED.clear()
    plugins.LOADED.update(loaded)
    plugins.MODULES.clear()
    plugins.MODULES.update(modules)


COLUMNS = {"anchor": "question", "positive": "answer"}


def test_a_sql_table_from_a_plugin_validates_and_loads_its_exact_rows(sqlkind, tmp_path, write_config, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # the path resolves against the config's folder
    db = _database(tmp_path / "pairs.db", 24)
    cfg = load_config(
        write_config({"data": {"train": {"kind": "sql", "path": "pairs.db", "table": "pairs"}, "columns": COLUMNS}})
    )
    source = cfg.data.train
    assert type(source).__name__ == "SqlSource" and source.path == str(db) and source.table == "pairs"
    assert plugins.LOADED == {("sqlkind", "sql"): "sqlkind:register", ("sqlkind", "halved_mnrl"): "sqlkind.loss"}
    data = load_checked_data(cfg.data, global_batch_size=8, no_duplicates=True)
    assert (data.rows_read, data.rows_dropped, len(data.dataset)) == (24, 0, 24)
    assert data.dataset["anchor"] == [f"question {i} about a red car" for i in range(24)]
    assert data.dataset["positive"] == [f"answer {i}" for i in range(24)]
    assert data.sources[0].name == "pairs" and data.sources[0].files is None  # no count_files hook: no shards
    assert data.warnings == ()

    query = {"kind": "sql", "path": "pairs.db", "query": "SELECT question, answer FROM pairs WHERE rowid % 3 = 0"}
    cfg = load_config(write_config({"data": {"train": query, "columns": COLUMNS}}, name="query.yaml"))
    data = load_checked_data(cfg.data, global_batch_size=8, no_duplicates=True)
    assert len(data.dataset) == 8 and data.dataset["positive"][0] == "answer 2"  # rowid 3 is the third row


def test_the_plugin_kinds_own_rules_and_what_it_does_not_declare(sqlkind, write_config):
    path = write_config("data:\n  train:\n    kind: sql\n    path: pairs.db\n")
    with pytest.raises(UserError, match=r"data\.train: .*give `table` or `query` \(one of them\)"):
        load_config(path)
    # Streaming is a capability a kind declares (FileSource's `streaming` field): this one has none.
    path = write_config("data:\n  train:\n    kind: sql\n    path: pairs.db\n    table: pairs\n    streaming: true\n")
    with pytest.raises(UserError, match=r":6: unknown key 'data\.train\.streaming'"):
        load_config(path)


def test_cembed_init_reads_a_plugin_kind(sqlkind, tmp_path, write_config):
    _database(tmp_path / "pairs.db", 40)
    cfg = load_config(write_config({"data": {"train": {"kind": "sql", "path": "pairs.db", "table": "pairs"}}}))
    starter = make_starter(tmp_path / "starter.yaml", "m", cfg.data.train)
    assert (starter.rows, starter.roles) == (40, {"anchor": "question", "positive": "answer"})
    assert '  train: {"kind": "sql", "path": "pairs.db", "table": "pairs"}' in starter.text
    (tmp_path / "starter.yaml").write_text(starter.text)
    again = load_config(tmp_path / "starter.yaml")  # the starter reads back as the same source
    assert again.data.train == cfg.data.train


def _run(args, site, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    r = subprocess.run(
        [sys.executable, "-m", "cembed", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.slow
def test_cembed_validate_and_train_from_a_plugin_kind_with_a_plugin_loss(tmp_path, tiny_model_dir):
    """A fresh ``cembed`` process finds the installed plugin at start-up: the SQL kind validates and
    trains with the plugin's loss, the exact rows and steps in run_summary.json."""
    site = _site(tmp_path)
    _database(tmp_path / "pairs.db", 48)
    config = tmp_path / "sql.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {
                    "train": {"kind": "sql", "path": "pairs.db", "table": "pairs"},
                    "columns": COLUMNS,
                    "cache_dir": str(tmp_path / "cache"),
                },
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
                "loss": {"name": "halved_mnrl", "scale": 10},
                "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
                "train": {"max_steps": 5, "logging_steps": 1, "output_dir": "out", "seed": 1},
            }
        )
    )
    report = json.loads(_run(["validate", str(config), "--json"], site, tmp_path).stdout)
    (source,) = report["data"]["sources"]
    assert (source["name"], source["rows_read"], source["rows"]) == ("pairs", 48, 48)
    assert source["path"] == f"{tmp_path / 'pairs.db'} (table pairs)"

    _run(["train", str(config)], site, tmp_path)
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["config"]["loss"]["name"] == "halved_mnrl"
    assert (summary["data"]["rows_read"], summary["data"]["rows_trained"]) == (48, 48)
    assert summary["steps"] == 5 and [step for step, _ in summary["step_losses"]] == [1, 2, 3, 4, 5]
    assert summary["samples_seen"] == 5 * 8  # five full no-duplicates batches of 8 distinct rows
