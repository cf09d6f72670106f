"""Model kinds as a seam (issue 40 item 1, issue 39 item 7): a kind is a config class and a
``ModelKind`` registered by name, and nothing outside it asks which kind a model is. A toy kind defined
entirely here validates from a config, refuses the options it does not take in one line naming the
field and the kind, loads through ``load_model`` as its own class and is found again by ``kind_of``.
A saved folder of another sentence-transformers model type is never loaded as a dense model."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
import torch
from pydantic import PositiveFloat
from sentence_transformers import SentenceTransformer
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import config_from_dict, load_config
from cembed.config.model import MODEL_CONFIGS, ModelConfig, model_config
from cembed.config.schema import CembedConfig
from cembed.distributed.ddp import unused_parameters
from cembed.errors import ModelRefused, UserError
from cembed.model.kinds.dense import DenseKind
from cembed.model.kinds.lookup import kind_of, model_kind, saved_model_type
from cembed.model.kinds.registry import MODEL_KINDS, register_model_kind
from cembed.model.load import load_eval_model, load_model, pooling_in_effect


class ToyModelConfig(ModelConfig):
    """``toy``: a dense model whose vector is ``factor`` x the loaded model's."""

    not_options: ClassVar[dict[str, str]] = {
        "model.pooling": "the toy scales the saved model's own pooled vector",
        "batch.sort_by_length": "the toy keeps rows in data order",
    }

    kind: Literal["toy"] = "toy"
    factor: PositiveFloat = 2.0


class ToyEncoder(SentenceTransformer):
    """A SentenceTransformer whose sentence embedding is ``factor`` x its modules' output."""

    factor = 1.0

    def forward(self, features, **kwargs):
        out = super().forward(features, **kwargs)
        out["sentence_embedding"] = out["sentence_embedding"] * self.factor
        return out


class ToyKind(DenseKind):
    """The dense kind's behaviour but for its model class and its load (which applies ``factor``)."""

    def trainer_classes(self):
        from dataclasses import replace

        return replace(super().trainer_classes(), model=ToyEncoder)

    def load(self, path, cfg, device, model_kwargs, saved, model_type=None, seed=0):
        model = ToyEncoder(path, device=device, model_kwargs=model_kwargs or None)
        model.factor = cfg.factor
        return model

    def describe(self, model, cfg, saved):
        return f"x{model.factor} of the saved model's vector"


class ToyTokensConfig(ModelConfig):
    """``toy_tokens``: a kind that makes token vectors (no model behind it: only its config half)."""

    output: ClassVar[str] = "token_vectors"
    default_loss: ClassVar[str] = "toy_tokens_loss"
    kind: Literal["toy_tokens"] = "toy_tokens"


@pytest.fixture
def toy_kinds():
    """Register ``toy`` (both halves) and ``toy_tokens`` (its config half) for one test."""
    register_model_kind(ToyModelConfig, ToyKind())
    MODEL_CONFIGS["toy_tokens"] = ToyTokensConfig
    try:
        yield
    finally:
        for name in ("toy", "toy_tokens"):
            MODEL_CONFIGS.pop(name, None)
            MODEL_KINDS.pop(name, None)


def test_a_toy_kind_validates_loads_and_is_found_through_the_registry_only(toy_kinds, tiny_model_dir, tmp_path):
    cfg = config_from_dict(
        {"model": {"kind": "toy", "factor": 3.0, "name_or_path": str(tiny_model_dir)}, "data": {"train": "x.jsonl"}},
        base=tmp_path,
    )
    assert type(cfg.model) is ToyModelConfig and cfg.model.factor == 3.0 and cfg.loss.name == "cached_mnrl"
    assert model_config(**cfg.model.model_dump()) == cfg.model  # a dumped section reads back as its kind

    model = load_model(cfg.model, "cpu")
    assert type(model) is ToyEncoder and kind_of(model) is model_kind("toy") is MODEL_KINDS["toy"]
    assert pooling_in_effect(model, cfg.model) == "x3.0 of the saved model's vector"
    dense = load_model(model_config(name_or_path=str(tiny_model_dir)), "cpu")
    assert kind_of(dense) is model_kind("dense")
    texts = ["a dog on a table", "two people"]
    torch.testing.assert_close(
        model.encode(texts, convert_to_tensor=True), 3.0 * dense.encode(texts, convert_to_tensor=True)
    )
    # The kind's own outputs reach the unused-parameter search (the BERT pooler gets no gradient).
    assert unused_parameters(model, texts, outputs=kind_of(model).text_outputs) == [
        "0.model.pooler.dense.weight",
        "0.model.pooler.dense.bias",
    ]


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"model": {"kind": "toy", "pooling": "cls"}}, "model.pooling"),
        ({"model": {"kind": "toy"}, "batch": {"sort_by_length": False}}, "batch.sort_by_length"),
    ],
)
def test_an_option_the_kind_does_not_take_is_refused_naming_field_and_kind(toy_kinds, write_config, sections, field):
    path = write_config({"data": {"train": "x.jsonl"}, **sections})
    line = 1 + next(
        i for i, text in enumerate(path.read_text().splitlines()) if text.strip().startswith(field.split(".")[1])
    )
    with pytest.raises(UserError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}: {field}: not an option of model.kind toy: "), message


def test_an_option_set_to_its_default_is_no_conflict(toy_kinds, tmp_path):
    # A dumped and reloaded config sets every field: its defaults must not read as the user's choice.
    cfg = config_from_dict({"model": {"kind": "toy", "pooling": "mean"}, "data": {"train": "x.jsonl"}}, base=tmp_path)
    assert cfg.model.kind == "toy"
    again = CembedConfig.model_validate(cfg.model_dump(mode="json"))
    assert type(again.model) is ToyModelConfig and again == cfg


def test_a_loss_for_another_output_is_refused_naming_loss_name(toy_kinds, tmp_path):
    with pytest.raises(UserError) as err:
        config_from_dict(
            {"model": {"kind": "toy_tokens"}, "loss": {"name": "cached_mnrl"}, "data": {"train": "x.jsonl"}},
            base=tmp_path,
        )
    assert str(err.value) == (
        "<config>: loss.name: cached_mnrl trains a model that makes one vector per text, but model.kind toy_tokens "
        "makes one vector per token; use loss.name toy_tokens_loss (model.kind toy_tokens's loss) (got 'cached_mnrl')"
    )
    # Without a loss the kind's default is asked for (here unregistered: the loss registry says so).
    with pytest.raises(UserError, match="loss.name: unknown loss 'toy_tokens_loss'"):
        config_from_dict({"model": {"kind": "toy_tokens"}, "data": {"train": "x.jsonl"}}, base=tmp_path)


def test_unknown_kind_lists_the_known_ones(tmp_path):
    with pytest.raises(UserError, match=r"model.kind: unknown model kind 'sparce'; known: dense"):
        config_from_dict({"model": {"kind": "sparce"}, "data": {"train": "x.jsonl"}}, base=tmp_path)


def test_the_toy_kinds_are_gone_after_the_fixture():
    assert "toy" not in MODEL_CONFIGS and "toy" not in MODEL_KINDS and "toy_tokens" not in MODEL_CONFIGS
    assert CembedConfig.model_validate({"data": {"train": "x.jsonl"}}).model.kind == "dense"


# --- a saved folder is loaded as the kind it is (issue 39 item 7) ------------------------------------------

OTHER_TYPES = ("SparseEncoder", "MultiVectorEncoder", "CrossEncoder")


def test_saved_folders_say_their_type(other_kind_dirs, tiny_model_dir):
    assert saved_model_type(str(tiny_model_dir)) == "SentenceTransformer"
    assert saved_model_type(str(tiny_model_dir.parent / "hf")) is None  # a plain transformers checkpoint
    assert {t: saved_model_type(str(p)) for t, p in other_kind_dirs.items()} == {t: t for t in OTHER_TYPES}


@pytest.mark.parametrize("model_type", ["SparseEncoder", "CrossEncoder"])
def test_a_folder_of_a_type_no_kind_trains_is_refused_naming_it(other_kind_dirs, model_type):
    folder = other_kind_dirs[model_type]
    with pytest.raises(ModelRefused) as err:
        load_model(model_config(name_or_path=str(folder)), "cpu")
    message = str(err.value)
    assert message.startswith(f"model.name_or_path: '{folder}' is a sentence-transformers {model_type} folder ("), (
        message
    )
    assert "not one model.kind dense trains" in message and "cembed has no model kind for it" in message
    with pytest.raises(UserError, match=f"^--model: '{folder}' is a sentence-transformers {model_type} folder"):
        load_eval_model(str(folder))


def test_validate_refuses_a_sparse_folder_in_one_line(other_kind_dirs, write_config, pairs_file, tmp_path):
    from conftest import distinct_pairs

    folder = other_kind_dirs["SparseEncoder"]
    path = write_config(
        {
            "model": {"name_or_path": str(folder), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(40)))},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 2, r.output
    assert "is a sentence-transformers SparseEncoder folder" in r.output and "Traceback" not in r.output
