"""``model.kind: multi_vector`` (issue 40 item 2): a ``MultiVectorEncoder`` folder loads as it is; an
encoder or a dense ``SentenceTransformer`` becomes one exactly as ``MultiVectorEncoder(path)`` makes it
(the same modules and, seeded alike, the same outputs); the config's dim, lengths, query expansion and
skiplist land on the modules sentence-transformers reads them from, and the saved folder keeps them;
packed rows give every token vector the row gives alone."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import MultiVectorEncoder

from cembed.config.file import config_from_dict
from cembed.config.model import MultiVectorModelConfig, model_config
from cembed.errors import ModelRefused, UserError
from cembed.model.kinds.lookup import kind_of
from cembed.model.load import load_eval_model, load_model, pooling_in_effect
from cembed.model.packing import plan_packing
from cembed.model.unpad import column_lengths, packed_encoder, resolve_unpad

TEXTS = ["a dog on a table, next to two cats!", "red car", "people sitting at the street near a large bus", "x"]


def _mv(path, **options):
    return load_model(model_config(kind="multi_vector", name_or_path=str(path), **options), "cpu", seed=7)


def _tokens(model, texts, task):
    return model.encode(texts, task=task)


@pytest.mark.parametrize("source", ["st", "hf"])
def test_an_encoder_or_dense_model_becomes_what_multi_vector_encoder_makes(tiny_model_dir, source):
    path = tiny_model_dir if source == "st" else tiny_model_dir.parent / "hf"
    model = _mv(path)
    torch.manual_seed(7)
    reference = MultiVectorEncoder(str(path), device="cpu")
    assert type(model) is MultiVectorEncoder and kind_of(model).name == "multi_vector"
    assert repr(model) == repr(reference)  # Transformer, Dense 32 -> 128 (no bias), MultiVectorMask, Normalize
    for task in ("query", "document"):
        for mine, theirs in zip(_tokens(model, TEXTS, task), _tokens(reference, TEXTS, task)):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert pooling_in_effect(model, model_config(kind="multi_vector", name_or_path=str(path))).startswith(
        "none: one 128-dim vector per token, maxsim (query max_seq_length / document max_seq_length tokens; built from a"
    )


def test_dim_makes_a_seeded_projection_of_that_size(tiny_model_dir):
    a, b = _mv(tiny_model_dir, dim=16), _mv(tiny_model_dir, dim=16)
    assert a[1].linear.weight.shape == (16, 32) and a[1].linear.bias is None
    torch.testing.assert_close(a[1].linear.weight, b[1].linear.weight, rtol=0, atol=0)  # the same on every rank
    other = load_model(model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), dim=16), "cpu", seed=8)
    assert not torch.equal(a[1].linear.weight, other[1].linear.weight)
    assert a.get_embedding_dimension() == 16 and all(e.shape[1] == 16 for e in _tokens(a, TEXTS, "document"))


def test_a_multi_vector_folder_loads_as_it_is(other_kind_dirs):
    folder = other_kind_dirs["MultiVectorEncoder"]
    model = _mv(folder)
    reference = MultiVectorEncoder(str(folder), device="cpu")
    for mine, theirs in zip(_tokens(model, TEXTS, "query"), _tokens(reference, TEXTS, "query")):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert "the model's MultiVectorEncoder config" in pooling_in_effect(model, model_config(kind="multi_vector"))
    with pytest.raises(ModelRefused, match=r"^model.dim: 32, but .* has its own projection to 16 dimensions"):
        _mv(folder, dim=32)
    evaluated = load_eval_model(str(folder))  # no config: loaded as the kind it is
    assert type(evaluated) is MultiVectorEncoder and kind_of(evaluated).name == "multi_vector"


def test_lengths_expansion_and_skiplist_reach_the_modules_and_the_saved_folder(tiny_model_dir, tmp_path):
    model = _mv(tiny_model_dir, dim=16, query_length=12, document_length=9, query_expansion=10, skiplist="punctuation")
    transformer, mask = model[0], model[2]
    assert (transformer.query_length, transformer.document_length) == (12, 9)
    assert transformer.query_expansion == {"strategy": "fixed", "attend": False, "length": 10, "token": None}
    assert "," in mask.skiplist_words and "!" in mask.skiplist_words
    query = model.preprocess(["a dog"], task="query")
    assert query["input_ids"].shape == (1, 10) and query["query_expansion_positions"].sum() == 10 - 4
    document = model.preprocess([TEXTS[0]], task="document")
    assert document["input_ids"].shape == (1, 9)
    comma = model.tokenizer.convert_tokens_to_ids(",")
    out = model(document, task="document")
    assert not out["attention_mask"][document["input_ids"] == comma].any()  # skiplisted: not scored
    model.save(str(tmp_path / "saved"))
    again = MultiVectorEncoder(str(tmp_path / "saved"), device="cpu")
    assert (again[0].query_length, again[0].document_length, again[0].query_expansion["length"]) == (12, 9, 10)
    for mine, theirs in zip(_tokens(model, TEXTS, "query"), _tokens(again, TEXTS, "query")):
        torch.testing.assert_close(mine, theirs)


def test_the_kind_declares_its_loss_and_refuses_what_it_does_not_take(tmp_path):
    data = {"train": "x.jsonl"}
    cfg = config_from_dict({"model": {"kind": "multi_vector"}, "data": data}, base=tmp_path)
    assert type(cfg.model) is MultiVectorModelConfig and cfg.loss.name == "cached_maxsim" and cfg.loss.scale == 1.0
    with pytest.raises(UserError, match=r"loss.name: cached_mnrl trains a model that makes one vector per text, but "):
        config_from_dict(
            {"model": {"kind": "multi_vector"}, "loss": {"name": "cached_mnrl"}, "data": data}, base=tmp_path
        )
    with pytest.raises(UserError, match=r"loss.name: cached_maxsim trains a model that makes one vector per token, "):
        config_from_dict({"loss": {"name": "cached_maxsim"}, "data": data}, base=tmp_path)
    with pytest.raises(UserError, match=r"model.pooling: not an option of model.kind multi_vector: a multi-vector"):
        config_from_dict({"model": {"kind": "multi_vector", "pooling": "cls"}, "data": data}, base=tmp_path)
    with pytest.raises(UserError, match=r"eval.sts: not an option of model.kind multi_vector: STS scores one"):
        config_from_dict({"model": {"kind": "multi_vector"}, "data": data, "eval": {"sts": ["s.tsv"]}}, base=tmp_path)
    with pytest.raises(UserError, match=r"loss: matryoshka is not an option of cached_maxsim"):
        config_from_dict(
            {"model": {"kind": "multi_vector"}, "loss": {"matryoshka": {"dims": [8]}}, "data": data}, base=tmp_path
        )


def test_packed_rows_give_every_token_vector_the_row_gives_alone(tiny_model_dir):
    """Acceptance: packed vs each text alone, every token embedding within 1e-5."""
    model = _mv(tiny_model_dir, dim=16, skiplist="punctuation").eval()
    unpadding = resolve_unpad(model, True)
    assert unpadding.enabled, unpadding.description
    texts = [f"{' '.join(['table'] * n)}, the dog {n}!" for n in (1, 30, 4, 12, 2, 50, 7, 3)]
    worst = 0.0
    for task in ("query", "document"):
        features = model.preprocess(texts, task=task)
        lengths = column_lengths(features)
        with torch.no_grad():
            alone = [
                model(
                    {k: v[i : i + 1, : lengths[i]] if torch.is_tensor(v) else v for k, v in features.items()}, task=task
                )
                for i in range(len(texts))
            ]
            plan = plan_packing(lengths, 0.0, torch.device("cpu"), capacity=max(lengths) + 20)
            assert plan.packs < len(texts)  # several rows share a pack
            with packed_encoder(model, plan, unpadding) as ran:
                packed = model(dict(features), task=task)
        assert ran.count == 1
        for i, out in enumerate(alone):
            keep = out["attention_mask"][0].bool()
            assert torch.equal(packed["attention_mask"][i, : lengths[i]].bool(), keep)
            diff = (packed["token_embeddings"][i, : lengths[i]][keep] - out["token_embeddings"][0][keep]).norm(dim=-1)
            worst = max(worst, float(diff.max()))
    assert worst <= 1e-5
