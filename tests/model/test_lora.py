"""cembed.model.lora: adapters on a tiny random BERT: which parameters train (counted by hand),
seeded initialisation, the merged model computing what the adapted one does, adapter resume."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from sentence_transformers import SentenceTransformer

from cembed.config.schema import LoraOptions
from cembed.errors import UserError
from cembed.model.lora import (
    ADAPTER_WEIGHTS,
    adapter_facts,
    apply_lora,
    backbone_holder,
    finish_lora,
    is_lora,
    load_adapter_checkpoint,
    parameter_counts,
)

TEXTS = ["a man on the street", "two dogs sitting next to a table", "the red bus"]
# hidden 32, one layer: query and value are 32 x 32 linears; rank 4 adds A (4 x 32) and B (32 x 4) to each
OPTIONS = LoraOptions(r=4, alpha=8.0, dropout=0.0, target_modules=["query", "value"])
ADAPTER_PARAMS = 2 * (4 * 32 + 32 * 4)
SCALE = 8.0 / 4  # alpha / r

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora_tiny"))


def _load(model_dir) -> SentenceTransformer:
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.eval()
    return model


def _embed(model) -> torch.Tensor:
    with torch.no_grad():
        return model.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=False)


def _train_adapters(model, seed=1) -> None:
    """Give every B a random value (B starts at 0, so the adapters would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_only_the_adapters_train(model_dir):
    model = _load(model_dir)
    base_total = parameter_counts(model)["total"]
    assert parameter_counts(model)["trainable"] == base_total and not is_lora(model)
    apply_lora(model, OPTIONS)
    assert is_lora(model)
    assert parameter_counts(model) == {"trainable": ADAPTER_PARAMS, "total": base_total + ADAPTER_PARAMS}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert len(trainable) == 4 and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"query", "value"}
    assert adapter_facts(model) == {
        "adapter_parameters": 512,
        "total_parameters": base_total + 512,
        "adapter_bytes": 2048,
        "full_bytes": (base_total + 512) * 4,
    }


def test_fresh_adapters_change_nothing_and_are_seeded(model_dir):
    base = _embed(_load(model_dir))
    rng = torch.random.get_rng_state()
    a, b, c = _load(model_dir), _load(model_dir), _load(model_dir)
    apply_lora(a, OPTIONS, seed=3)
    apply_lora(b, OPTIONS, seed=3)
    apply_lora(c, OPTIONS, seed=4)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the global RNG is left as it was
    lora_a = {n: p for n, p in a.named_parameters() if "lora_A" in n}
    assert all(torch.equal(p, dict(b.named_parameters())[n]) for n, p in lora_a.items())
    assert not all(torch.equal(p, dict(c.named_parameters())[n]) for n, p in lora_a.items())
    assert torch.equal(_embed(a), base)  # B = 0: the adapted model starts as the base model


def test_merged_model_matches_the_adapted_one(model_dir, tmp_path):
    base = _embed(_load(model_dir))
    model = _load(model_dir)
    apply_lora(model, OPTIONS)
    _train_adapters(model)
    adapted = _embed(model)
    assert (adapted - base).abs().max() > 1e-2  # the adapters do change the embeddings
    params = dict(model.named_parameters())
    query = next(n for n in params if n.endswith("attention.self.query.base_layer.weight"))
    stem = query.removesuffix("base_layer.weight")
    a, b = params[stem + "lora_A.default.weight"], params[stem + "lora_B.default.weight"]
    expected = (params[query] + SCALE * b @ a).detach().clone()  # W + (alpha / r) B A
    finish_lora(model, merge=True)
    merged = dict(model.named_parameters())[stem.replace("base_model.model.", "", 1) + "weight"]
    torch.testing.assert_close(merged, expected, rtol=1e-6, atol=1e-6)
    assert not is_lora(model)
    assert parameter_counts(model)["total"] == parameter_counts(_load(model_dir))["total"]  # plain weights again
    torch.testing.assert_close(_embed(model), adapted, rtol=1e-5, atol=1e-5)
    model.save(str(tmp_path / "merged"))  # a folder any sentence-transformers loads
    torch.testing.assert_close(_embed(_load(tmp_path / "merged")), adapted, rtol=1e-5, atol=1e-5)


def test_merge_false_keeps_the_adapters(model_dir):
    model = _load(model_dir)
    apply_lora(model, OPTIONS)
    finish_lora(model, merge=False)
    assert is_lora(model)
    plain = _load(model_dir)
    finish_lora(plain, merge=True)  # no adapters: nothing to merge
    assert not is_lora(plain)


def test_adapter_checkpoint_resume(model_dir, tmp_path):
    model = _load(model_dir)
    apply_lora(model, OPTIONS)
    _train_adapters(model, seed=7)
    checkpoint = tmp_path / "checkpoint-5"
    backbone_holder(model).model.save_pretrained(str(checkpoint / "adapter"))
    assert (checkpoint / "adapter" / ADAPTER_WEIGHTS).is_file()
    resumed = _load(model_dir)
    apply_lora(resumed, OPTIONS)
    load_adapter_checkpoint(resumed, checkpoint)  # found in a subfolder
    torch.testing.assert_close(_embed(resumed), _embed(model), rtol=0, atol=0)
    with pytest.raises(UserError, match=f"no {ADAPTER_WEIGHTS} in this checkpoint"):
        load_adapter_checkpoint(resumed, tmp_path / "empty")


def test_unknown_target_modules_refused(model_dir):
    with pytest.raises(UserError, match="^model.lora.target_modules: "):
        apply_lora(_load(model_dir), LoraOptions(target_modules=["q_proj"]))
