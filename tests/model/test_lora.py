"""cembed.model.lora: adapters on a tiny random BERT: which parameters train (counted by hand),
seeded initialisation, the merged model computing what the adapted one does, adapter resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import KILL_AT_STEP_3, REPO, make_tiny_model
from safetensors.torch import load_file
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
    load_lora_checkpoint,
    parameter_counts,
    trainable_parts,
    unsaved_trainable,
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
    load_lora_checkpoint(resumed, checkpoint)  # found in a subfolder
    torch.testing.assert_close(_embed(resumed), _embed(model), rtol=0, atol=0)
    with pytest.raises(UserError, match=f"no {ADAPTER_WEIGHTS} in this checkpoint"):
        load_lora_checkpoint(resumed, tmp_path / "empty")


def test_unknown_target_modules_refused(model_dir):
    with pytest.raises(UserError, match="^model.lora.target_modules: "):
        apply_lora(_load(model_dir), LoraOptions(target_modules=["q_proj"]))


# --- a trainable module outside the adapters (issue 23 item 13) -----------------------------------
# Many sentence-transformers models end in a Dense projection after pooling; under LoRA it keeps
# training (it is not part of the backbone peft wraps), so a checkpoint must carry it and a resume
# must restore it, as it restores the adapters.

DENSE_PARAMS = 32 * 16 + 16  # Dense(32 -> 16) with bias


def make_dense_model(path, dropout: float = 0.0):
    """The tiny BERT + mean pooling + Dense(32 -> 16, tanh), saved as a sentence-transformers folder."""
    from sentence_transformers.sentence_transformer.modules import Dense

    model = SentenceTransformer(str(make_tiny_model(path / "base", dropout=dropout)), device="cpu")
    torch.manual_seed(11)
    model.append(Dense(32, 16))
    model.save(str(path / "dense"))
    return path / "dense"


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_dense_model(tmp_path_factory.mktemp("lora_dense"))


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_checkpoint_restores_every_trainable_parameter(dense_dir, tmp_path):
    """What trains under LoRA = the adapters + the Dense head; a checkpoint written as
    sentence-transformers' trainer writes it (``model.save_pretrained``) restores all of it."""
    model = _load(dense_dir)
    apply_lora(model, OPTIONS)
    trained = _trainable(model)
    assert len(trained) == 4 + 2 and sum(p.numel() for p in trained.values()) == ADAPTER_PARAMS + DENSE_PARAMS
    assert unsaved_trainable(model) == []
    _train_adapters(model, seed=7)
    with torch.no_grad():
        for p in model[2].parameters():
            p.add_(0.25)  # the Dense head moved away from the base weights, as training moves it
    trained = _trainable(model)
    model.save_pretrained(str(tmp_path / "checkpoint-3"))  # what SentenceTransformerTrainer._save does

    resumed = _load(dense_dir)
    apply_lora(resumed, OPTIONS)
    load_lora_checkpoint(resumed, tmp_path / "checkpoint-3")
    after = _trainable(resumed)
    assert after.keys() == trained.keys()
    worst = {n: (after[n] - trained[n]).abs().max().item() for n in trained}
    assert max(worst.values()) == 0.0, worst
    torch.testing.assert_close(_embed(resumed), _embed(model), rtol=0, atol=0)


def test_unsaved_trainable_names_what_a_checkpoint_would_lose(dense_dir):
    """A backbone weight set trainable by hand is neither an adapter (peft saves those) nor a module
    of its own (sentence-transformers saves those): the check names it, and apply_lora refuses it."""
    model = _load(dense_dir)
    apply_lora(model, OPTIONS)
    holder = backbone_holder(model)
    embeddings = holder.model.base_model.model.embeddings.word_embeddings.weight
    embeddings.requires_grad_(True)
    assert unsaved_trainable(model) == ["0.model.base_model.model.embeddings.word_embeddings.weight"]
    embeddings.requires_grad_(False)
    assert unsaved_trainable(model) == []


def test_a_module_no_checkpoint_restores_is_refused(dense_dir):
    """A module after the backbone that is not a sentence-transformers module has no weights folder a
    resume could read: training it under LoRA is refused rather than silently reset on resume."""
    model = _load(dense_dir)
    model.append(torch.nn.Linear(16, 16))
    with pytest.raises(UserError, match=r"^model.lora: 2 trainable parameter\(s\) .* \(first: 3.weight\)"):
        apply_lora(model, OPTIONS)


def test_lora_parts_name_the_dense_head(dense_dir, model_dir):
    """What ``cembed validate`` says trains: the adapters, and the Dense head beside them."""
    from cembed.config.schema import ModelConfig
    from cembed.model.load import load_model, pooling_in_effect

    model = _load(dense_dir)
    apply_lora(model, OPTIONS)
    assert trainable_parts(model) == {"adapters": ADAPTER_PARAMS, "2_Dense": DENSE_PARAMS}
    plain = _load(model_dir)
    apply_lora(plain, OPTIONS)
    assert trainable_parts(plain) == {"adapters": ADAPTER_PARAMS}
    cfg = ModelConfig(name_or_path=str(dense_dir), device="cpu", lora=OPTIONS)
    text = pooling_in_effect(load_model(cfg, "cpu"), cfg)
    total = parameter_counts(_load(dense_dir))["total"] + ADAPTER_PARAMS
    assert text.endswith(
        f"; LoRA: {ADAPTER_PARAMS + DENSE_PARAMS:,} of {total:,} parameters train (adapters {ADAPTER_PARAMS}; "
        f"outside them 2_Dense {DENSE_PARAMS}, saved in checkpoints and resumed)"
    )


def _dense_config(write_config, tmp_path, model_dir, out):
    data = tmp_path / "pairs.jsonl"
    rows = [
        {"anchor": f"question {i} about a {'red ' * (i % 5)}car", "positive": f"answer {i} on the street"}
        for i in range(96)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_config(
        {
            "model": {
                "name_or_path": str(model_dir),
                "device": "cpu",
                "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["query", "value"], "merge": True},
            },
            "data": {"train": str(data), "pretokenize": False},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 3},
            "optim": {"learning_rate": 1e-2, "base_batch_size": 8},
            "train": {"max_steps": 6, "logging_steps": 1, "output_dir": str(out), "seed": 5},
        },
        name=f"{out.name}.yaml",
    )


@pytest.mark.slow
def test_lora_with_dense_head_resume_equals_uninterrupted(tmp_path, write_config):
    """Killed at step 3 (a real SIGTERM) and resumed == uninterrupted, in the Dense head and in the
    merged backbone; dropout is on in the model and the adapters, so the equality is not vacuous."""
    model_dir = make_dense_model(tmp_path / "model", dropout=0.1)
    env = dict(cwd=REPO, capture_output=True, text=True, timeout=600)
    straight = _dense_config(write_config, tmp_path, model_dir, tmp_path / "straight")
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(straight)], **env)
    assert r.returncode == 0, r.stderr
    killed = _dense_config(write_config, tmp_path, model_dir, tmp_path / "killed")
    r = subprocess.run([sys.executable, "-c", KILL_AT_STEP_3, str(killed)], **env)
    assert r.returncode == 143, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(killed), "--resume"], **env)
    assert r.returncode == 0, r.stderr
    moved, diff = {}, {}
    for f in ("model.safetensors", "2_Dense/model.safetensors"):  # the merged backbone, the Dense head
        base = load_file(str(model_dir / f))
        a, b = load_file(str(tmp_path / "straight" / f)), load_file(str(tmp_path / "killed" / f))
        assert a.keys() == b.keys() == base.keys()
        moved[f] = max((a[k] - base[k]).abs().max().item() for k in a)
        diff[f] = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |dW| trained from the base {moved}; resumed vs uninterrupted {diff}")
    assert min(moved.values()) > 1e-3  # both did train
    assert max(diff.values()) <= 1e-6, diff
