"""Publishing: train.push_to_hub / hub_model_id / hub_private_repo reach the trainer's arguments
(offline), and the model card in output_dir keeps cembed's training facts."""

from __future__ import annotations

import pytest
from conftest import distinct_pairs

from cembed.config.file import config_from_dict
from cembed.errors import UserError
from cembed.plan.resolve import resolve_plan
from cembed.train.args import build_training_args


def _cfg(tmp_path, **train):
    data = {
        "data": {"train": "pairs.jsonl"},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "model": {"device": "cpu"},
        "train": {"max_steps": 2, "output_dir": str(tmp_path / "run"), **train},
    }
    return config_from_dict(data, base=tmp_path)


def test_hub_fields_reach_the_training_arguments(tmp_path):
    cfg = _cfg(tmp_path, push_to_hub=True, hub_model_id="someone/minilm-coco", hub_private_repo=True)
    args = build_training_args(cfg, resolve_plan(cfg))
    assert args.push_to_hub is True and args.hub_model_id == "someone/minilm-coco" and args.hub_private_repo is True
    args = build_training_args(_cfg(tmp_path), resolve_plan(_cfg(tmp_path)))
    assert args.push_to_hub is False and args.hub_model_id is None and args.hub_private_repo is None


def test_push_to_hub_needs_hub_model_id(tmp_path):
    with pytest.raises(UserError, match=r"train: push_to_hub: true needs train\.hub_model_id"):
        _cfg(tmp_path, push_to_hub=True)


@pytest.mark.slow
def test_model_card_keeps_cembed_facts(tmp_path, tiny_model_dir, pairs_file):
    from cembed.train.recipe import check_run_inputs, run_training

    data = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {"train": str(pairs_file(distinct_pairs(40))), "pretokenize": False},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-4, "base_batch_size": 2},
        "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(tmp_path / "run")},
    }
    cfg = config_from_dict(data, base=tmp_path)
    plan, prepared = check_run_inputs(cfg)
    summary = run_training(cfg, plan, prepared)
    assert summary["status"] == "completed"
    card = (tmp_path / "run" / "README.md").read_text()
    assert "- `cembed_effective_batch_size`: 8 (8 per device x 1 processes x 1 accumulation)" in card
    assert "- `cembed_mini_batch_size`: 4" in card
    assert "- `cembed_learning_rate`: 2.000e-04 = 0.0001 x sqrt(8/2) (lr_scaling: sqrt)" in card
    assert "- `cembed_training_rows`: 40" in card and "- `cembed_steps`: 2" in card


def test_failed_push_is_one_clear_error(tmp_path):
    from types import SimpleNamespace

    from cembed.train.publish import push_final_model

    class Trainer:
        args = SimpleNamespace(push_to_hub=True, output_dir="runs/x", hub_model_id="someone/m")
        state = SimpleNamespace(global_step=3)

        def push_to_hub(self, **kwargs):
            raise OSError("401 Client Error: Unauthorized")

    with pytest.raises(
        UserError,
        match=r"train.push_to_hub: the model is saved in runs/x, but uploading it to "
        r"someone/m failed: 401 Client Error",
    ):
        push_final_model(Trainer())


def _front_matter(card: str) -> dict:
    import yaml

    return yaml.safe_load(card.split("---\n", 2)[1])


@pytest.mark.slow
def test_model_card_tells_the_truth(tmp_path, tiny_model_dir, pairs_file, monkeypatch):
    """A pre-tokenized run with evaluation before and after training (the quickstart's shape): the
    card names the base model and the data source, carries the final model's metrics (and before ->
    after), cembed's facts, no token-id column, and asks the hub nothing."""
    import json
    import shutil

    import sentence_transformers.base.model_card as st_card

    from cembed.train.recipe import check_run_inputs, run_training

    def no_hub(*args, **kwargs):
        raise AssertionError(f"the model card asked the hub: {args}")

    monkeypatch.setattr(st_card, "get_model_info", no_hub)
    monkeypatch.setattr(st_card, "get_dataset_info", no_hub)
    base = shutil.copytree(tiny_model_dir, tmp_path / "tiny-bert-base")
    rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(16)]
    train_file = pairs_file(rows, name="street-captions.jsonl")
    (tmp_path / "sts.tsv").write_text(
        "".join(f"a car on road {i}\ta vehicle on a street {i}\t{i % 5}\n" for i in range(8))
    )
    data = {
        "model": {"name_or_path": str(base), "max_seq_length": 16, "device": "cpu"},
        "data": {"train": str(train_file), "cache_dir": str(tmp_path / "cache")},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-2},
        "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(tmp_path / "run")},
        "eval": {"sts": str(tmp_path / "sts.tsv")},
    }
    cfg = config_from_dict(data, base=tmp_path)
    plan, prepared = check_run_inputs(cfg)
    run_training(cfg, plan, prepared)
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    before, after = summary["eval"]["before"], summary["eval"]["after"]
    key = "sts_spearman_cosine"
    assert round(before[key], 4) != round(after[key], 4)  # else the test could not tell them apart
    card = (tmp_path / "run" / "README.md").read_text()

    # The final model's metrics: in the hub's model-index exactly, in the Evaluation table rounded.
    results = _front_matter(card)["model-index"][0]["results"]
    reported = {m["type"]: m["value"] for r in results for m in r["metrics"]}
    assert reported == {k.removeprefix("sts_"): v for k, v in after.items()}
    assert f"| **spearman_cosine** | **{round(after[key], 4)}** |" in card.replace("  ", "")
    assert str(round(before[key], 4)) not in card.split("## Training Details")[0]  # no base-model score as a result
    # before -> after among cembed's facts, and the training-log rows before (step 0) and at the end.
    assert f"- `cembed_eval_{key}`: {before[key]:.4f} -> {after[key]:.4f} (before -> after training)" in card
    assert "| -1 " not in card

    # The base model and the data source by name; no "json" dataset, no "Unknown" base model.
    assert "# SentenceTransformer based on tiny-bert-base" in card
    assert "- `cembed_base_model`: tiny-bert-base (a local folder)" in card
    assert "trained on the street-captions dataset" in card and "#### street-captions" in card
    assert "json" not in card.split("### Training Hyperparameters")[0].replace("```json", "")
    # Only the user's text columns: the pre-tokenized run's token-id columns stay internal.
    assert summary["tokenization"]["pretokenized"] is True
    assert "* Columns: <code>anchor</code> and <code>positive</code>" in card
    assert "_input_ids" not in card and "_prompt_length" not in card
    # cembed's training facts, as before.
    assert "- `cembed_effective_batch_size`: 8 (8 per device x 1 processes x 1 accumulation)" in card
    assert "- `cembed_training_rows`: 16" in card and "- `cembed_steps`: 2" in card


@pytest.mark.parametrize(
    ("name", "hub_id"),
    [
        ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"),
        ("sentence-transformers/all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"),
        ("BAAI/bge-small-en-v1.5", "BAAI/bge-small-en-v1.5"),
        ("/cache/hub/models--BAAI--bge-small-en-v1.5/snapshots/5c38ec7c", "BAAI/bge-small-en-v1.5"),
        ("/work/models/my-bert", None),
        ("./my-bert", None),
    ],
)
def test_base_model_hub_id(name, hub_id):
    from cembed.train.publish import base_model_id

    assert base_model_id(name) == hub_id


def test_card_names_a_hub_base_model_without_asking_the_hub(tiny_model_dir, monkeypatch):
    import sentence_transformers.base.model_card as st_card
    from sentence_transformers import SentenceTransformer

    from cembed.train.publish import describe_base_model

    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    monkeypatch.setattr(st_card, "get_model_info", lambda *a, **k: pytest.fail("asked the hub"))
    describe_base_model(model, "all-MiniLM-L6-v2", revision="c9745ed1")
    card = st_card.generate_model_card(model)
    assert _front_matter(card)["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert "# SentenceTransformer based on sentence-transformers/all-MiniLM-L6-v2" in card
    assert (
        "**Base model:** [sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2) <!-- at revision c9745ed1 -->"
        in card
    )


def test_several_sources_each_named_with_text_columns_only(tmp_path, tiny_model_dir, pairs_file):
    """Three sources (a file, a hub dataset, cembed's packaged data): one card entry each, with its
    own rows; the hub one by its id, linked; the token-id column of the pre-tokenized dataset nowhere."""
    from types import SimpleNamespace

    import sentence_transformers.base.model_card as st_card
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    from cembed.train.publish import describe_training_data

    pairs_file(distinct_pairs(3), name="local-pairs.jsonl")
    cfg = config_from_dict(
        {
            "data": {
                "train": [
                    "local-pairs.jsonl",
                    {"kind": "hub", "path": "sentence-transformers/all-nli"},
                    "cembed:coco-captions",
                ]
            }
        },
        base=tmp_path,
    )
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.model_card_data.local_files_only = True
    rows = distinct_pairs(6)
    dataset = Dataset.from_dict(
        {
            "anchor": [r["anchor"] for r in rows],
            "positive": [r["positive"] for r in rows],
            "anchor_input_ids": [[2, 5, 3]] * 6,
        }
    )
    names = [s.name for s in cfg.data.sources()]
    data = SimpleNamespace(
        dataset=dataset,
        columns=dataset.column_names,
        sources=[SimpleNamespace(name=n, offset=o, rows=r) for n, o, r in zip(names, (0, 3, 5), (3, 2, 1))],
    )
    trainer = SimpleNamespace(
        model=model, loss=MultipleNegativesRankingLoss(model), args=SimpleNamespace(router_mapping={})
    )
    describe_training_data(trainer, cfg.data.sources(), data)
    entries = model.model_card_data.train_datasets
    assert [(e["name"], e.get("id"), e["size"]) for e in entries] == [
        ("local-pairs", None, 3),
        ("sentence-transformers/all-nli", "sentence-transformers/all-nli", 2),
        ("coco-captions", None, 1),  # cembed:coco-captions, not its file's name (train_pairs)
    ]
    card = st_card.generate_model_card(model)
    hub_link = "[sentence-transformers/all-nli](https://huggingface.co/datasets/sentence-transformers/all-nli)"
    assert f"trained on the local-pairs, {hub_link} and coco-captions datasets" in card
    assert "_input_ids" not in card and "#### json" not in card
    assert _front_matter(card)["datasets"] == ["sentence-transformers/all-nli"]
