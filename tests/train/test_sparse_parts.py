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
    make_tiny_splade(folder, bias=-0.2)  # about a fifth of the coordinates active
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


def test_the_probe_caches_every_coordinate_active_the_dense_worst_case(mlm):
    from cembed.config.loss import loss_config
    from cembed.losses.registry import build_loss
    from cembed.probe.worst_case import cached_embeddings, full_length_features, worst_case_step

    model = load_model(model_config(kind="sparse", name_or_path=str(mlm)), "cpu")
    features = full_length_features(model, 2, 8)
    loss = build_loss(model, loss_config(name="cached_splade"), 4).cached_module
    rows, _ = next(loss.embed_minibatch_iter(features[1], False, False, ranges=[(0, 4)]))
    assert (rows == 0).any()  # the model's own rows are sparse ...
    (reps,) = cached_embeddings((rows,), [4, 4], 2, loss.replicate_minibatch)
    assert [r.shape for r in reps[1]] == [(4, 127)] * 2 and all((r != 0).all() for col in reps for r in col)
    torch.testing.assert_close(reps[0][0].detach()[rows != 0], rows[rows != 0])  # ... the probe's cache is dense
    case = worst_case_step(model, loss_config(name="cached_splade"), 2, 8, 4, "fp32", repeats=1)
    assert case.rows == 4 and case.tokens_per_row == 64 and case.samples_per_s > 0


def test_estimate_counts_the_mlm_head_and_the_cache_at_measured_and_dense_density(run, tmp_path):
    from cembed.cli.commands.estimate import build_estimate
    from cembed.train.flops import encoder_shape

    cfg, plan, data = run()
    report = build_estimate(cfg, None, "A100", 0.3, None)  # bf16 on the target: 2 bytes per value
    model = load_model(cfg.model, "cpu")
    n, _, _ = encoder_shape(model)
    assert report["flop_model"]["N"] == n + 32 * 127  # the tied MLM decoder, hidden x vocab per token
    rows = plan.per_device_train_batch_size
    assert report["cache_per_rank"]["value"] == 2 * rows * 2 * 127 * 2  # 2 columns x 127 x bf16, and gradients
    sample = data.dataset.select(range(len(data.dataset)))
    active = [
        float((encode(list(sample[c]), convert_to_tensor=True).to_dense() != 0).sum()) / len(sample)
        for c, encode in zip(data.columns, (model.encode_query, model.encode_document))
    ]
    per_row = sum(min(a * (2 + 4) + 4, 127 * 2) for a in active)
    measured = report["cache_per_rank_measured"]
    assert (
        measured["value"] == pytest.approx(2 * rows * per_row) and measured["value"] < report["cache_per_rank"]["value"]
    )
    assert f"mean active dims {active[0]:.0f}/{active[1]:.0f} of 127" in measured["source"]


def test_validate_states_the_kind_the_cache_and_the_regularizers(mlm, write_config, pairs_file, tmp_path):
    from typer.testing import CliRunner

    from cembed.cli.app import app

    path = write_config(
        {
            "model": {
                "kind": "sparse",
                "name_or_path": str(mlm),
                "device": "cpu",
                "architecture": "inference_free_splade",
            },
            "data": {"train": str(pairs_file(ROWS))},
            "batch": {"global_batch_size": 8, "mini_batch_size": 4},
            "loss": {"query_regularizer_weight": 1e-4, "regularizer_warmup_ratio": 0.25},
            "train": {"output_dir": str(tmp_path / "out"), "max_steps": 2},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].endswith(
        "kind: sparse   pooling: inference-free SPLADE: queries a static weight per token, documents max of "
        "log1p(relu(MLM logits)) over a text's tokens; 127-dim sparse vectors, dot (built from a plain transformers "
        "checkpoint)"
    )
    assert lines[1] == (
        "loss: cached_splade on anchor, positive; cache of each row's active coordinates (a mini-batch too dense "
        "for that kept dense); FLOPS over the global batch (documents 3e-05, queries 0.0001), weights ramped from 0 "
        "over the first 25% of the steps (quadratic)"
    )
    assert "effective batch (batch.global_batch_size): 8 per device x 1 x 1 accumulation" in r.output


def test_validate_says_no_flops_regularizer_where_its_weights_are_0():
    # CSR (the demo) sets its sparsity by top-k: a line promising FLOPS "ramped from 0" would describe nothing.
    from cembed.config.loss import CachedSpladeLossConfig

    off = CachedSpladeLossConfig(document_regularizer_weight=0.0, query_regularizer_weight=0.0, cache_form="sparse")
    assert off.describe() == "cache of each row's active coordinates; no FLOPS regularizer (its weights are 0)"
    docs_only = CachedSpladeLossConfig(query_regularizer_weight=0.0)
    assert "FLOPS over the global batch (documents 3e-05, queries 0)" in docs_only.describe()


def test_fsdp_shards_a_masked_language_model_by_its_layers_keeping_tied_embeddings_in_the_root(mlm):
    # BertForMaskedLM ties its decoder to the word embeddings: a BertEmbeddings unit of its own would put one
    # parameter in two FSDP groups (fully_shard refuses); a plain BertModel keeps both units.
    from transformers import BertModel

    from cembed.distributed.fsdp import shard_layer_classes

    model = load_model(model_config(kind="sparse", name_or_path=str(mlm)), "cpu")
    assert shard_layer_classes(model[0].auto_model) == ["BertLayer"]
    assert shard_layer_classes(BertModel.from_pretrained(str(mlm))) == ["BertEmbeddings", "BertLayer"]
