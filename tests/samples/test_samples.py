"""Packaged data (``cembed:<name>``), the held-out COCO set, the before/after table and every step's
loss in the run summary and plot."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import COCO_HELDOUT, COCO_PAIRS, REPO, TESTS_DATA
from rich.console import Console

from cembed.cli.display.run import eval_change_rows, print_eval_change
from cembed.config.file import load_config
from cembed.errors import UserError
from cembed.eval.sets import load_beir
from cembed.samples import known_samples, resolve_sample
from cembed.train.recipe import check_run_inputs, run_training


def test_short_names_resolve_to_packaged_data():
    assert resolve_sample("cembed:coco-captions") == COCO_PAIRS.resolve()
    assert resolve_sample("cembed:coco-captions-heldout") == COCO_HELDOUT.resolve()
    assert resolve_sample("data/pairs.jsonl") is None
    assert known_samples() == ["cembed:coco-captions", "cembed:coco-captions-heldout"]
    with pytest.raises(UserError, match="unknown packaged data 'cembed:coco'; known: cembed:coco-captions, cembed:"):
        resolve_sample("cembed:coco")


def test_config_refers_to_packaged_data_by_name(write_config):
    cfg = load_config(
        write_config(
            {
                "data": {"train": "cembed:coco-captions"},
                "eval": {"retrieval": [{"path": "cembed:coco-captions-heldout", "split": "test", "name": "coco"}]},
            }
        )
    )
    assert cfg.data.train.kind == "file" and cfg.data.train.path == str(COCO_PAIRS.resolve())
    assert cfg.eval.retrieval[0].path == str(COCO_HELDOUT.resolve())
    with pytest.raises(
        UserError, match=r"data.train: unknown packaged data 'cembed:nope'; known: cembed:coco-captions"
    ):
        load_config(write_config({"data": {"train": "cembed:nope"}}))
    with pytest.raises(UserError, match=r"eval.retrieval.0.path: unknown packaged data 'cembed:x'"):
        load_config(write_config({"data": {"train": "cembed:coco-captions"}, "eval": {"retrieval": "cembed:x"}}))


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".").strip()


def test_heldout_captions_never_occur_in_training_rows():
    with gzip.open(COCO_PAIRS, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 40066 and len({r["image_id"] for r in rows}) == 4000
    train_texts = {_norm(r[c]) for r in rows for c in ("anchor", "positive")}
    rs = load_beir(COCO_HELDOUT, "test")
    assert len(rs.queries) == len(rs.corpus) == 1000
    assert all(len(rel) == 1 and next(iter(rel)) in rs.corpus for rel in rs.relevant_docs.values())
    held = [_norm(t) for t in [*rs.queries.values(), *rs.corpus.values()]]
    assert len(set(held)) == 2000 and not set(held) & train_texts


def test_repository_data_is_small():
    files = [p for root in (REPO / "cembed" / "samples", TESTS_DATA) for p in root.rglob("*") if p.is_file()]
    files = [p for p in files if "__pycache__" not in p.parts]
    assert max(p.stat().st_size for p in files) < 2 * 2**20
    assert sum(p.stat().st_size for p in files) < 4_000_000
    for folder in (COCO_PAIRS.parent, TESTS_DATA / "stsbenchmark", TESTS_DATA / "scifact-test-subset"):
        assert any(p.name.startswith(("LICENSE", "README")) for p in folder.iterdir()), folder


def test_before_after_table():
    block = {
        "before": {"coco_cosine_recall@10": 0.7, "coco_cosine_ndcg@10": 0.5, "coco_cosine_mrr@10": 0.4},
        "after": {"coco_cosine_ndcg@10": 0.625, "coco_cosine_recall@10": 0.65, "coco_cosine_mrr@10": 0.5},
    }
    assert eval_change_rows(block) == [
        ("coco_cosine_ndcg@10", 0.5, 0.625, 0.125),
        ("coco_cosine_recall@10", 0.7, 0.65, pytest.approx(-0.05)),
    ]
    assert eval_change_rows({"before": None, "after": {"s_spearman_cosine": 0.8}}) == [
        ("s_spearman_cosine", None, 0.8, None)
    ]
    console = Console(record=True, width=120)
    print_eval_change(console, {"eval": block})
    text = console.export_text()
    assert "before / after" in text and "coco_cosine_ndcg@10" in text and "+0.1250" in text and "-0.0500" in text
    console = Console(record=True)
    print_eval_change(console, {"eval": None})
    assert console.export_text() == ""


@pytest.mark.slow
def test_every_step_loss_in_summary_and_plot(tiny_model_dir, write_config, pairs_file, tmp_path):
    rows = [{"anchor": f"question {i} about a {'red ' * (i % 5)}car", "positive": f"answer {i}"} for i in range(96)]
    out = tmp_path / "run"
    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": str(pairs_file(rows)), "pretokenize": False},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4, "gradient_accumulation_steps": 2},
                "optim": {"learning_rate": 1e-3, "base_batch_size": 16},
                "train": {"max_steps": 5, "logging_steps": 2, "output_dir": str(out), "seed": 3},
            }
        )
    )
    plan, data = check_run_inputs(cfg)
    summary = run_training(cfg, plan, data)
    steps = summary["step_losses"]
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5]  # step 5 was never logged
    by_step = dict(steps)
    logged = summary["losses"]  # the first step, then every 2nd: interval means of the step losses
    assert [s for s, _ in logged] == [1, 2, 4]
    assert logged[0][1] == pytest.approx(by_step[1], rel=1e-5)
    assert logged[1][1] == pytest.approx(by_step[2], rel=1e-5)
    assert logged[2][1] == pytest.approx((by_step[3] + by_step[4]) / 2, rel=1e-5)
    assert json.loads((out / "run_summary.json").read_text())["step_losses"] == [list(s) for s in steps]
    assert (out / "training_curves.png").stat().st_size > 0


def test_packaged_quickstart_example_is_the_repo_config_and_validates(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cembed.cli.app import app
    from cembed.samples import example_config

    repo = (REPO / "configs" / "quickstart.yaml").read_text().splitlines()
    packaged = example_config("quickstart").splitlines()
    differ = [(a, b) for a, b in zip(repo, packaged) if a != b]
    assert len(repo) == len(packaged) and differ == [
        ("  output_dir: ../runs/quickstart", "  output_dir: runs/quickstart")
    ]
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    r = runner.invoke(app, ["init", "quick.yaml", "--example", "quickstart"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "quick.yaml").read_text() == example_config("quickstart")
    again = runner.invoke(app, ["init", "quick.yaml", "--example", "quickstart"])
    assert again.exit_code == 2 and "already exists; cembed init never overwrites a file" in again.output
    unknown = runner.invoke(app, ["init", "other.yaml", "--example", "nope"])
    assert unknown.exit_code == 2 and "'--example'" in unknown.output and "'quickstart'" in unknown.output  # a choice
    with pytest.raises(
        UserError, match="--example nope: no such example; known: quickstart, colbert-quickstart, splade-quickstart"
    ):
        example_config("nope")
    cfg = load_config(tmp_path / "quick.yaml")
    assert cfg.train.output_dir == str(tmp_path / "runs" / "quickstart")
    assert cfg.data.train.path == str(resolve_sample("cembed:coco-captions"))


def test_packaged_colbert_example_is_the_repo_config_and_runs_without_a_clone(tmp_path, monkeypatch):
    """``cembed init --example colbert-quickstart`` writes the repo's ColBERT demo (output under the folder
    it is written to), a multi-vector config whose data and evaluation set are the packaged ones."""
    from typer.testing import CliRunner

    from cembed.cli.app import app
    from cembed.samples import example_config

    repo = (REPO / "configs" / "colbert-quickstart.yaml").read_text().splitlines()
    packaged = example_config("colbert-quickstart").splitlines()
    differ = [(a, b) for a, b in zip(repo, packaged) if a != b]
    assert len(repo) == len(packaged) and differ == [
        ("  output_dir: ../runs/colbert-quickstart", "  output_dir: runs/colbert-quickstart")
    ]
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["init", "colbert.yaml", "--example", "colbert-quickstart"])
    assert r.exit_code == 0, r.output
    assert "wrote colbert.yaml (example colbert-quickstart); next: cembed train colbert.yaml" in r.output
    cfg = load_config(tmp_path / "colbert.yaml")
    assert cfg.model.kind == "multi_vector" and cfg.loss.name == "cached_maxsim"
    assert cfg.train.output_dir == str(tmp_path / "runs" / "colbert-quickstart")
    assert cfg.data.train.path == str(resolve_sample("cembed:coco-captions"))
    assert cfg.eval.retrieval[0].path == str(resolve_sample("cembed:coco-captions-heldout"))


def test_packaged_splade_example_is_the_repo_config_and_runs_without_a_clone(tmp_path, monkeypatch):
    """``cembed init --example splade-quickstart`` writes the repo's sparse (SPLADE) demo (output under the
    folder it is written to), a sparse config whose data and evaluation set are the packaged ones."""
    from typer.testing import CliRunner

    from cembed.cli.app import app
    from cembed.samples import example_config

    repo = (REPO / "configs" / "splade-quickstart.yaml").read_text().splitlines()
    packaged = example_config("splade-quickstart").splitlines()
    differ = [(a, b) for a, b in zip(repo, packaged) if a != b]
    assert len(repo) == len(packaged) and differ == [
        ("  output_dir: ../runs/splade-quickstart", "  output_dir: runs/splade-quickstart")
    ]
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["init", "splade.yaml", "--example", "splade-quickstart"])
    assert r.exit_code == 0, r.output
    assert "wrote splade.yaml (example splade-quickstart); next: cembed train splade.yaml" in r.output
    cfg = load_config(tmp_path / "splade.yaml")
    assert cfg.model.kind == "sparse" and cfg.model.architecture == "splade" and cfg.loss.name == "cached_splade"
    assert cfg.model.name_or_path == "splade-tiny"
    assert cfg.train.output_dir == str(tmp_path / "runs" / "splade-quickstart")
    assert cfg.data.train.path == str(resolve_sample("cembed:coco-captions"))
    assert cfg.eval.retrieval[0].path == str(resolve_sample("cembed:coco-captions-heldout"))


def test_quickstart_data_trains_without_a_warning_about_its_own_columns():
    # Issue 23 item 11: `make demo` warned "column(s) image_id, anchor_caption_id, positive_caption_id
    # are not mapped ... and are not trained on" about the packaged file; the config now declares
    # them ids (data.columns.ignore), so the demo's own data warns about nothing.
    from cembed.data.load import load_training_data

    for path in (REPO / "configs" / "quickstart.yaml", resolve_sample("cembed:coco-captions").parents[1] / "examples"):
        cfg = load_config(path if path.suffix == ".yaml" else path / "quickstart.yaml")
        data = load_training_data(cfg.data)
        assert data.warnings == () and len(data.dataset) == 40066 and data.columns == ["anchor", "positive"]
