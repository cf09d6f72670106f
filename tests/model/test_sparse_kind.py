"""``model.kind: sparse`` (issue 41 item 1): a ``SparseEncoder`` folder loads as it is; a masked-language
checkpoint becomes SPLADE and a dense model CSR exactly as ``SparseEncoder(path)`` makes them (the same
modules and outputs); inference-free SPLADE is a Router with a static query side; the options that
contradict the model are refused in one line naming the field."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SparseEncoder
from sentence_transformers.base.modules import Router
from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder, SparseStaticEmbedding, SpladePooling

from cembed.config.file import config_from_dict
from cembed.config.model import SparseModelConfig, model_config
from cembed.errors import ModelRefused, UserError
from cembed.model.kinds.lookup import kind_of
from cembed.model.load import load_eval_model, load_model, pooling_in_effect
from cembed.train.flops import encoder_shape

TEXTS = ["a dog on a table, next to two cats!", "red car", "people sitting at the street near a large bus"]


def _sparse(path, seed: int = 0, **options):
    return load_model(model_config(kind="sparse", name_or_path=str(path), **options), "cpu", seed=seed)


def _same_embeddings(mine, theirs):
    for task in ("encode_query", "encode_document"):
        a = getattr(mine, task)(TEXTS, convert_to_tensor=True).to_dense()
        b = getattr(theirs, task)(TEXTS, convert_to_tensor=True).to_dense()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_sparse_folder_loads_as_it_is(other_kind_dirs):
    folder = other_kind_dirs["SparseEncoder"]
    model = _sparse(folder)
    assert type(model) is SparseEncoder and kind_of(model).name == "sparse"
    _same_embeddings(model, SparseEncoder(str(folder), device="cpu"))
    described = pooling_in_effect(model, model_config(kind="sparse", name_or_path=str(folder)))
    assert described == (
        "SPLADE: max of log1p(relu(MLM logits)) over a text's tokens; 127-dim sparse vectors, dot "
        "(the model's SparseEncoder config)"
    )
    evaluated = load_eval_model(str(folder))  # no config: loaded as the kind it is
    assert type(evaluated) is SparseEncoder and kind_of(evaluated).name == "sparse"
    with pytest.raises(ModelRefused, match=r"^model.architecture: csr, but .* is a splade SparseEncoder; drop"):
        _sparse(folder, architecture="csr")


def test_a_masked_language_checkpoint_becomes_what_sparse_encoder_makes(other_kind_dirs):
    mlm = other_kind_dirs["SparseEncoder"].parent / "mlm"
    model = _sparse(mlm)
    assert [type(m).__name__ for m in model] == ["Transformer", "SpladePooling"]
    _same_embeddings(model, SparseEncoder(str(mlm), device="cpu"))
    twice = _sparse(mlm, splade_pooling="sum", splade_activation="log1p_relu")
    assert (twice[1].pooling_strategy, twice[1].activation_function) == ("sum", "log1p_relu")
    assert "sum of log1p(log1p(relu(MLM logits)))" in kind_of(twice).describe(twice, None, False)


def test_the_mlm_head_is_counted_in_the_flops_per_token(other_kind_dirs):
    # transformers ties the decoder to the word embeddings: N leaves out 2 x hidden x vocab per token.
    model = _sparse(other_kind_dirs["SparseEncoder"])
    n, _, _ = encoder_shape(model)
    decoder = model[0].auto_model.cls.predictions.decoder.weight
    assert decoder.data_ptr() == model[0].auto_model.bert.embeddings.word_embeddings.weight.data_ptr()
    assert kind_of(model).head_flops_per_token(model) == 2.0 * 32 * 127 == 2.0 * decoder.numel()


def test_inference_free_splade_is_a_router_with_a_static_query_side(other_kind_dirs, tmp_path):
    mlm = other_kind_dirs["SparseEncoder"].parent / "mlm"
    model = _sparse(mlm, architecture="inference_free_splade")
    router = model[0]
    assert isinstance(router, Router) and set(router.sub_modules) == {"query", "document"}
    (static,) = router.sub_modules["query"]
    assert isinstance(static, SparseStaticEmbedding) and static.weight.requires_grad
    query = model.encode_query(["red car"], convert_to_tensor=True).to_dense()[0]
    ids = model.tokenizer("red car", add_special_tokens=False)["input_ids"]
    assert sorted(query.nonzero().flatten().tolist()) == sorted(set(ids)) and set(query[ids].tolist()) == {1.0}
    document = model.encode_document(TEXTS, convert_to_tensor=True).to_dense()
    torch.testing.assert_close(document, SparseEncoder(str(mlm), device="cpu").encode_document(TEXTS).to_dense())
    model.save(str(tmp_path / "saved"))
    again = _sparse(tmp_path / "saved")  # the saved folder is a SparseEncoder of the same architecture
    assert "inference-free SPLADE" in kind_of(again).describe(again, None, True)
    _same_embeddings(again, SparseEncoder(str(tmp_path / "saved"), device="cpu"))


def test_a_dense_model_becomes_csr_as_sparse_encoder_converts_it(tiny_model_dir):
    model = _sparse(tiny_model_dir, seed=3)
    torch.manual_seed(3)
    reference = SparseEncoder(str(tiny_model_dir), device="cpu")
    assert repr(model) == repr(reference)
    reference.similarity_fn_name = "dot"  # cembed trains and scores a built model by dot product
    _same_embeddings(model, reference)
    assert model.similarity_fn_name == "dot"
    sae = model[-1]
    assert isinstance(sae, SparseAutoEncoder) and (sae.input_dim, sae.hidden_dim, sae.k) == (32, 128, 8)
    assert kind_of(model).encode_settings(model) == {"max_active_dims": 8}  # SparseEncoder caps CSR at k
    assert "; max_active_dims 8 (the autoencoder's k): encoding keeps" in kind_of(model).describe(model, None, False)
    resized = _sparse(tiny_model_dir, csr_k=4, csr_hidden_dim=64)
    assert (resized[-1].hidden_dim, resized[-1].k, resized[-1].k_aux) == (64, 4, 8)
    active = (resized.encode_document(TEXTS, convert_to_tensor=True).to_dense() != 0).sum(dim=1)
    assert int(active.max()) <= 4
    other = _sparse(tiny_model_dir, seed=4)  # the new autoencoder is seeded by train.seed
    assert not torch.equal(other[-1].encoder.weight, model[-1].encoder.weight)


def test_splade_needs_a_masked_language_head(tiny_model_dir):
    with pytest.raises(ModelRefused, match=r"^model.architecture: splade needs a masked-language checkpoint .* is a "):
        _sparse(tiny_model_dir, architecture="splade")


@pytest.mark.parametrize(
    ("options", "field", "words"),
    [
        (
            {"architecture": "csr", "splade_pooling": "sum"},
            "model",
            "splade_pooling: not an option of architecture csr",
        ),
        ({"architecture": "splade", "csr_k": 8}, "model", "csr_k: not an option of architecture splade"),
        ({"pooling": "cls"}, "model.pooling", "not an option of model.kind sparse"),
    ],
)
def test_options_that_contradict_the_architecture_are_refused(options, field, words):
    with pytest.raises(UserError) as err:
        config_from_dict({"model": {"kind": "sparse", **options}, "data": {"train": "x.jsonl"}})
    assert field in str(err.value) and words in str(err.value), str(err.value)


def test_the_sparse_kind_trains_with_its_own_loss():
    cfg = config_from_dict({"model": {"kind": "sparse"}, "data": {"train": "x.jsonl"}})
    assert isinstance(cfg.model, SparseModelConfig) and cfg.loss.name == "cached_splade"
    with pytest.raises(UserError, match="use loss.name cached_splade"):
        config_from_dict({"model": {"kind": "sparse"}, "loss": {"name": "cached_mnrl"}, "data": {"train": "x.jsonl"}})
    with pytest.raises(UserError, match="use loss.name cached_mnrl"):
        config_from_dict({"loss": {"name": "cached_splade"}, "data": {"train": "x.jsonl"}})


def test_splade_pooling_module_is_what_the_config_names(other_kind_dirs):
    model = _sparse(other_kind_dirs["SparseEncoder"].parent / "mlm", splade_pooling="max")
    assert isinstance(model[1], SpladePooling) and model[1].pooling_strategy == "max"
