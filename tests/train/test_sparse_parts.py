"""What cembed does around a sparse run (issue 41 items 2, 3), part by part: the trainer built from the
kind's sentence-transformers classes; an inference-free model's columns tokenized and routed as
sentence-transformers does (the query column by the static query side: no special tokens, the ``query``
route; the others as documents), in stored ids and in the collator's batches, and every parameter used."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_splade

from cembed.config.file import config_from_dict
from cembed.config.model import model_config
from cembed.data.tokens.collator import TokenIdRows
from cembed.data.tokens.tokenize import tokenize_stage
from cembed.model.kinds.lookup import kind_of
from cembed.model.load import load_model
from cembed.train.kinds import router_mapping, trainer_for_kind
from cembed.train.recipe import build_components, check_run_inputs
from cembed.train.trainer import CembedTrainer

ROWS = [
    {
        "anchor": f"{'a dog on the table ' * (i % 4)}car {i}{', near the red bus' * (i % 3)}",
        "positive": f"answer {i}: {'the man sits at the table near the bus, ' * (1 + i % 5)}done!",
        "negative": f"black cat {i} {'on a plate ' * (i % 6)}.",
    }
    for i in range(24)
] + [{"anchor": "a long query " * 40, "positive": "a long answer " * 40, "negative": "no"}]  # cut at 64 tokens


@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("splade")
    make_tiny_splade(folder, bias=-0.1)
    return folder / "hf"


@pytest.fixture
def run(mlm, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def make(**model):
        cfg = config_from_dict(
            {
                "model": {"kind": "sparse", "name_or_path": str(mlm), "device": "cpu", **model},
                "data": {"train": str(data), "cache_dir": str(tmp_path / "cache")},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            },
            base=tmp_path,
        )
        plan, training = check_run_inputs(cfg)
        return cfg, plan, training

    return make


def test_the_trainer_is_cembeds_with_the_kinds_classes(mlm):
    from sentence_transformers.sparse_encoder import SparseEncoder, SparseEncoderTrainingArguments
    from sentence_transformers.sparse_encoder.data_collator import SparseEncoderDataCollator
    from sentence_transformers.sparse_encoder.model_card import (
        SparseEncoderModelCardCallback,
        SparseEncoderModelCardData,
    )

    from cembed.data.tokens.collator import TextCollator

    model = load_model(model_config(kind="sparse", name_or_path=str(mlm)), "cpu")
    trainer = trainer_for_kind(CembedTrainer, kind_of(model))
    assert issubclass(trainer, CembedTrainer) and trainer.model_class is SparseEncoder
    assert trainer.training_args_class is SparseEncoderTrainingArguments
    assert trainer.model_card_data_class is SparseEncoderModelCardData
    assert trainer.model_card_callback_class is SparseEncoderModelCardCallback
    collator = trainer.data_collator_class
    assert issubclass(collator, TextCollator) and issubclass(collator, SparseEncoderDataCollator)
    assert router_mapping(model, ["anchor", "positive"]) == {}  # no Router: nothing to route


def test_inference_free_columns_are_stored_and_routed_as_the_model_preprocesses_each(run):
    cfg, _, data = run(architecture="inference_free_splade")
    model = load_model(cfg.model, "cpu")
    dataset, collator, info = tokenize_stage(model, data, True, cfg.data.cache_dir)
    assert info["pretokenized"], info  # no fallback to tokenizing in the collator
    rows = list(range(len(dataset)))
    batch = collator(TokenIdRows(dataset, collator.roles).__getitems__(rows))
    for role, task in zip(collator.roles, ("query", "document", "document")):
        texts = [dataset[i][role] for i in rows]
        ref = model.preprocess(texts, task=task)
        assert set(ref) == {k.removeprefix(f"{role}_") for k in batch if k.startswith(f"{role}_")}, role
        assert batch[f"{role}_task"] == task
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            assert torch.equal(batch[f"{role}_{key}"], ref[key].to(torch.int64)), (role, key)
        # what the loss embeds from the batch is the model's own query / document vector
        features = {k.removeprefix(f"{role}_"): v for k, v in batch.items() if k.startswith(f"{role}_")}
        encode = model.encode_query if task == "query" else model.encode_document
        with torch.no_grad():
            embedded = model(features)["sentence_embedding"]
        torch.testing.assert_close(embedded, encode(texts, convert_to_tensor=True).to_dense(), rtol=0, atol=1e-6)
    cls = model.tokenizer.cls_token_id
    assert (batch["anchor_input_ids"][:, 0] != cls).all() and (batch["positive_input_ids"][:, 0] == cls).all()
    assert batch["anchor_attention_mask"][-1].sum() == 64  # the long query: 64 tokens of its own, no [CLS]/[SEP]
    roles = collator.roles
    assert roles[0] == "anchor" and len(roles) >= 2
    assert router_mapping(model, roles) == {"anchor": "query", **{r: "document" for r in roles[1:]}}


def test_every_parameter_of_an_inference_free_model_trains_on_several_processes(run):
    # Several processes freeze the parameters no column reaches (DDP's unused parameters): the static query
    # weights are reached by the query column only when it goes down the query route.
    cfg, plan, data = run(architecture="inference_free_splade")
    parts = build_components(cfg, plan, data, "cpu", freeze_unused=True)
    frozen = [n for n, p in parts.model.named_parameters() if not p.requires_grad]
    assert frozen == []
    assert any(p.requires_grad and p.dim() == 1 and p.numel() == 127 for p in parts.model[0].parameters())
