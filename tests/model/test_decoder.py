"""Decoder models as embedders (issue 17): last-token pooling, EOS, padding side, LoRA.

A tiny random Qwen2 decoder with a byte-level BPE tokenizer is built in the test (no download),
saved as a plain transformers checkpoint (no modules.json), as a Qwen checkpoint is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import KILL_AT_STEP_3, REPO, rel_diff
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.gradcache import _create_minibatch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from cembed.config.loss import loss_config
from cembed.config.schema import LoraOptions, ModelConfig
from cembed.losses.registry import build_loss
from cembed.model.decoder import appends_eos
from cembed.model.load import load_model
from cembed.model.lora import is_lora, parameter_counts

WORDS = "the a cat dog sat on mat red blue query passage doc man woman street car ran".split()
TEXTS = [
    "the cat",
    "a red dog sat on the mat",
    "the man ran",
    "a blue car on the street ran red",
    "the woman sat",
    "doc",
    "query passage doc the cat sat",
]


def make_tiny_decoder(path, padding_side: str = "left", attention_dropout: float = 0.0):
    """A 2-layer Qwen2 (hidden 32, GQA 4/2 heads) and a byte-level BPE tokenizer that, like Qwen2's,
    adds no EOS and has ``padding_side`` as given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2Model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side=padding_side
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_dropout=attention_dropout,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2Model(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory):
    return make_tiny_decoder(tmp_path_factory.mktemp("decoder") / "qwen")


def _load(path, **model):
    return load_model(ModelConfig(name_or_path=str(path), device="cpu", pooling="lasttoken", **model), "cpu")


def test_last_token_pooling_picks_last_real_token_for_both_padding_sides(decoder_dir):
    model = _load(decoder_dir)
    model.eval()
    tokenizer = model.tokenizer
    assert appends_eos(tokenizer) and tokenizer.padding_side == "right"
    assert set(model.cembed_tokenizer_changes) == {"eos", "padding_side"}
    # Reference: each text alone (no padding at all), the backbone's hidden state at its EOS.
    backbone = model[0].auto_model
    reference = []
    for text in TEXTS:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        assert ids[0, -1].item() == tokenizer.eos_token_id
        with torch.no_grad():
            reference.append(backbone(input_ids=ids).last_hidden_state[0, -1])
    reference = torch.stack(reference)
    for side in ("right", "left"):
        tokenizer.padding_side = side
        features = model.tokenize(TEXTS)
        assert features["attention_mask"].sum() < features["attention_mask"].numel()  # really padded
        pad_col = -1 if side == "right" else 0
        assert features["attention_mask"][:, pad_col].min() == 0
        with torch.no_grad():
            emb = model(features)["sentence_embedding"]
        assert torch.allclose(emb, reference, atol=1e-5), side
    tokenizer.padding_side = "right"


def test_saved_decoder_keeps_eos_and_pooling(decoder_dir, tmp_path):
    model = _load(decoder_dir)
    model.eval()
    model.save(str(tmp_path / "saved"))
    again = SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    assert appends_eos(again.tokenizer)
    a = model.encode(TEXTS, convert_to_tensor=True)
    b = again.encode(TEXTS, convert_to_tensor=True)
    assert torch.allclose(a, b, atol=1e-6)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.slow
@pytest.mark.parametrize("mbs", [1, 3])
def test_cached_equals_plain_with_lora_dropout(decoder_dir, mbs):
    """LoRA dropout on: the cached loss replays each mini-batch's RNG state, so it equals the plain
    loss over the same mini-batches drawn from the same seed (as tests/losses/test_losses.py does for CMNRL)."""
    model = _load(decoder_dir, lora=LoraOptions(r=4, alpha=8, dropout=0.3, target_modules=["q_proj", "v_proj"]))
    assert is_lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    model.train()
    # LoRA B starts at zero (no gradient reaches A); give B values so every adapter weight trains.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    anchors, positives = TEXTS, TEXTS[1:] + TEXTS[:1]
    features = [model.tokenize(anchors), model.tokenize(positives)]
    n = len(anchors)

    model.zero_grad()
    torch.manual_seed(7)
    reps = [
        torch.cat([model(_create_minibatch(f, b, b + mbs))["sentence_embedding"] for b in range(0, n, mbs)])
        for f in features
    ]
    ref_loss = MultipleNegativesRankingLoss(model).compute_loss_from_embeddings(reps, None)
    ref_loss.backward()
    ref = _grads(model)

    # padded like the reference: dropout masks follow the tensor's shape, so a packed mini-batch draws
    # other masks (the packed path's own replay: tests/model/test_packed_models.py)
    cached = build_loss(model, loss_config(), mbs, sort_by_length=False, unpad=False).module
    model.zero_grad()
    torch.manual_seed(7)
    loss = cached(features, labels=None)
    loss.backward()
    assert rel_diff(loss.detach(), ref_loss.detach()) <= 1e-5
    assert rel_diff(_grads(model), ref) <= 1e-5

    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    # Dropout is really on: another seed gives other gradients.
    model.zero_grad()
    torch.manual_seed(8)
    cached(features, labels=None).backward()
    assert rel_diff(_grads(model), ref) > 1e-3


def test_loss_scaling_reaches_the_replayed_minibatches(decoder_dir):
    """fp16 training scales the loss before backward (the trainer's GradScaler) and unscales the
    gradients after: the cached loss's replay must carry the upstream gradient into every
    mini-batch's backward. Backward of ``2**16 x loss`` gives exactly ``2**16 x`` the gradients
    (a power of two: exact in fp32), with LoRA and 3 mini-batches per column."""
    model = _load(decoder_dir, lora=LoraOptions(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    features = [model.tokenize(TEXTS), model.tokenize(TEXTS[1:] + TEXTS[:1])]
    cached = build_loss(model, loss_config(), 2).module
    grads = []
    for scale in (1.0, 2.0**16):
        model.zero_grad()
        (cached([dict(f) for f in features], labels=None) * scale).backward()
        grads.append(_grads(model))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[1], grads[0] * 2.0**16, rtol=1e-6, atol=0)


def _coco_config(write_config, tmp_path, model_dir, out, merge: bool, **train):
    return write_config(
        {
            "model": {
                "name_or_path": str(model_dir),
                "device": "cpu",
                "pooling": "lasttoken",
                "max_seq_length": 32,
                "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"], "merge": merge},
            },
            "data": {"train": "cembed:coco-captions", "max_samples": 256},
            "batch": {"per_device_train_batch_size": 32, "mini_batch_size": 8},
            "optim": {"learning_rate": 1e-2, "base_batch_size": 32},
            "train": {"max_steps": 6, "logging_steps": 1, "output_dir": str(out), "seed": 3, **train},
        },
        name=f"{out.name}.yaml",
    )


@pytest.mark.slow
def test_train_decoder_with_lora_changes_only_adapted_weights(decoder_dir, write_config, tmp_path):
    cfg = _coco_config(write_config, tmp_path, decoder_dir, tmp_path / "run", merge=True)
    r = subprocess.run(
        [sys.executable, "-m", "cembed", "train", str(cfg)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LoRA: adapter" in r.stdout and "merged into the weights" in r.stdout
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    lora = summary["lora"]
    # r=4 on q_proj (32->32) and v_proj (32->16, GQA) in 2 layers: A (4x32) + B (out x 4) each.
    assert lora["adapter_parameters"] == 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    assert lora["merged"] is True
    base = load_file(str(decoder_dir / "model.safetensors"))
    saved = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert set(saved) == set(base)
    changed = {k for k in base if not torch.equal(base[k], saved[k])}
    assert changed == {f"layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "v_proj")}
    # The folder is a plain sentence-transformers model: it reloads and embeds like the run's model.
    again = SentenceTransformer(str(tmp_path / "run"), device="cpu")
    assert appends_eos(again.tokenizer)
    assert again.encode(["the cat sat"]).shape == (1, 32)


@pytest.mark.slow
def test_lora_resume_equals_uninterrupted(decoder_dir, write_config, tmp_path):
    env = dict(cwd=REPO, capture_output=True, text=True, timeout=600)
    straight = _coco_config(write_config, tmp_path, decoder_dir, tmp_path / "straight", merge=False, save_steps=3)
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(straight)], **env)
    assert r.returncode == 0, r.stderr
    # Checkpoints hold only the adapter.
    ckpt = tmp_path / "straight" / "checkpoint-3"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    killed = _coco_config(write_config, tmp_path, decoder_dir, tmp_path / "killed", merge=False, save_steps=3)
    r = subprocess.run([sys.executable, "-c", KILL_AT_STEP_3, str(killed)], **env)
    assert r.returncode == 143, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(killed), "--resume"], **env)
    assert r.returncode == 0, r.stderr
    a = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "adapter_model.safetensors"))
    assert set(a) == set(b) and len(a) == 8
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert not (tmp_path / "killed" / "model.safetensors").exists()  # adapter only, as configured


def test_lora_without_peft_is_a_clear_error(decoder_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft":
            raise ImportError("no peft")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    from cembed.errors import UserError

    with pytest.raises(UserError, match=r"model.lora needs the peft package: pip install 'cembed\[lora\]'"):
        _load(decoder_dir, lora=LoraOptions())


def test_parameter_counts_of_plain_model(decoder_dir):
    model = _load(decoder_dir)
    counts = parameter_counts(model)
    assert counts["trainable"] == counts["total"] == sum(p.numel() for p in model.parameters())


def test_fsdp_strategy_reaches_the_trainer(tiny_model_dir, write_config, pairs_file):
    """distributed.strategy: fsdp becomes the trainer's FSDP2 options, one shard unit per layer;
    ddp (the default) sets none. (Sharding, exactness and checkpoints: tests/distributed/test_fsdp.py.)"""
    from dataclasses import replace

    from cembed.config.file import load_config
    from cembed.plan.resolve import resolve_plan
    from cembed.train.args import build_training_args

    data = pairs_file([{"anchor": f"a {i}", "positive": f"b {i}"} for i in range(8)])
    base = {"model": {"name_or_path": str(tiny_model_dir), "device": "cpu"}, "data": {"train": str(data)}}
    fsdp = load_config(write_config(base | {"distributed": {"strategy": "fsdp"}}))
    plan = replace(resolve_plan(fsdp, world_size=2))
    args = build_training_args(fsdp, plan, None, ["BertLayer"])
    assert args.fsdp and args.fsdp_config["version"] == 2
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["BertLayer"]
    assert args.fsdp_plugin_args["fsdp_version"] == 2
    ddp = load_config(write_config(base, name="ddp.yaml"))
    assert not build_training_args(ddp, resolve_plan(ddp, world_size=2), None, ["BertLayer"]).fsdp


def test_validate_names_tokenizer_changes_and_lora(decoder_dir):
    from cembed.model.load import pooling_in_effect

    cfg = ModelConfig(name_or_path=str(decoder_dir), device="cpu", pooling="lasttoken", lora=LoraOptions(r=2))
    text = pooling_in_effect(load_model(cfg, "cpu"), cfg)
    assert text.startswith("lasttoken (model.pooling; plain transformers checkpoint)")
    assert "eos: appended '<|endoftext|>' to every text" in text and "padding_side: left -> right" in text
    assert "; LoRA: " in text and " parameters train" in text


@pytest.mark.parametrize("lora", [None, LoraOptions(r=2, alpha=4)], ids=["plain", "lora"])
def test_a_decoder_with_use_cache_on_keeps_its_packing_mode(decoder_dir, lora):
    """A decoder whose config has ``use_cache: true`` (a Qwen checkpoint's config.json; kept by
    sentence-transformers before 6.3, e.g. 6.0 on the GPU image, which does not switch it off on load)
    packs in ``position_ids`` mode as with the cache off: the packed forward passes ``use_cache=False``
    (with a cache, transformers does not read packed rows from the positions and every mode would
    disagree, silently padding). Each packed row equals the row alone; the config is left as it was."""
    from cembed.model.packing import plan_packing
    from cembed.model.unpad import backbone, packed_encoder, resolve_unpad

    model = _load(decoder_dir, lora=lora)
    base = backbone(model[0].auto_model)
    base.config.use_cache = True
    unpadding = resolve_unpad(model, True)  # True: refuses rather than pads when no mode agrees
    assert (unpadding.enabled, unpadding.mode) == (True, "position_ids"), unpadding.description
    model.eval()
    features = model.preprocess(TEXTS)
    lengths = features["attention_mask"].sum(1).tolist()
    plan = plan_packing(lengths, 0.0, capacity=sum(lengths) // 2)
    assert plan.packs < len(lengths)  # rows share packs
    with torch.no_grad():
        alone = torch.cat(
            [
                model({k: v[i : i + 1, :n] if torch.is_tensor(v) else v for k, v in features.items()})[
                    "sentence_embedding"
                ]
                for i, n in enumerate(lengths)
            ]
        )
        with packed_encoder(model, plan, unpadding) as ran:
            packed = model(dict(features))["sentence_embedding"]
    assert ran.count == 1 and rel_diff(packed, alone) < 1e-5
    assert base.config.use_cache is True
