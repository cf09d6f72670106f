"""Packed mini-batches over transformers' packed-sequence masks (issue 34): every model kind packs
(BERT, XLM-R, Qwen2, Qwen3, Llama, Mistral with a sliding window, ModernBERT with local layers, and
BERT and Qwen2 under LoRA), each packed row equals the row embedded alone, the cached loss's loss and
gradients packed equal padded, and LoRA + gradient checkpointing + dropout replays exactly.

Tiny random models are built here (fp32, no download): encoders with a WordPiece tokenizer over
letters and digits, decoders with a byte-level BPE tokenizer that appends no EOS (cembed adds it).
"""

from __future__ import annotations

import string

import pytest
import torch
from conftest import make_tiny_model, rel_diff
from sentence_transformers.base.losses.gradcache import _create_minibatch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.loss import loss_config
from cembed.config.schema import LoraOptions, ModelConfig
from cembed.losses.registry import build_loss
from cembed.model.load import load_model
from cembed.model.packing import plan_packing
from cembed.model.unpad import packed_encoder, resolve_unpad

MAX_TOKENS = 64
WINDOW = 8  # Mistral's sliding window and ModernBERT's half local window: rows reach ~60 tokens
LETTERS = string.ascii_lowercase + string.digits
# kind: (pooling, LoRA target modules or None, the packing mode expected)
KINDS = {
    "bert": ("mean", None, "position_ids"),
    "bert_lora": ("mean", ["query", "value"], "position_ids"),
    "xlmr": ("mean", None, "position_ids"),
    "modernbert_local": ("mean", None, "layer_masks"),
    "qwen2": ("lasttoken", None, "position_ids"),
    "qwen2_lora": ("lasttoken", ["q_proj", "v_proj"], "position_ids"),
    "qwen3": ("lasttoken", None, "position_ids"),
    "llama": ("lasttoken", None, "position_ids"),
    "mistral_window": ("lasttoken", None, "position_ids"),
}


def _texts(n: int, seed: int) -> list[str]:
    """``n`` texts of 1 .. ~60 single-letter words (about a token each), seeded; the longest far
    beyond ``WINDOW``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_TOKENS - 4, (n,), generator=g).tolist()
    lengths[:2] = [MAX_TOKENS - 4, 3 * WINDOW]
    return [" ".join(LETTERS[(7 * i + 3 * j) % len(LETTERS)] for j in range(k)) for i, k in enumerate(lengths)]


def _bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(LETTERS)] * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def _decoder(folder, kind: str):
    from transformers import (
        LlamaConfig,
        LlamaModel,
        MistralConfig,
        MistralModel,
        Qwen2Config,
        Qwen2Model,
        Qwen3Config,
        Qwen3Model,
    )

    tokenizer = _bpe_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    family = {
        "qwen2": (Qwen2Config, Qwen2Model, {}),
        "qwen3": (Qwen3Config, Qwen3Model, {"head_dim": 8}),
        "llama": (LlamaConfig, LlamaModel, {}),
        "mistral_window": (MistralConfig, MistralModel, {"sliding_window": WINDOW}),
    }
    config_class, model_class, extra = family[kind]
    torch.manual_seed(0)
    model_class(config_class(**common, **extra)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _encoder(folder, kind: str, tokenizer_dir):
    from transformers import AutoTokenizer, ModernBertConfig, ModernBertModel, XLMRobertaConfig, XLMRobertaModel

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(folder)
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_attention_heads=2)
    torch.manual_seed(0)
    if kind == "xlmr":
        config = XLMRobertaConfig(
            **common,
            num_hidden_layers=2,
            max_position_embeddings=MAX_TOKENS + 8,
            pad_token_id=tokenizer.pad_token_id,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        XLMRobertaModel(config).save_pretrained(folder)
    else:  # ModernBERT: local layers of 2 x WINDOW tokens, every third layer global
        config = ModernBertConfig(
            **common,
            num_hidden_layers=3,
            local_attention=2 * WINDOW,
            global_attn_every_n_layers=3,
            max_position_embeddings=128,
            pad_token_id=tokenizer.pad_token_id,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
        )
        ModernBertModel(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``kind -> folder`` of a plain transformers checkpoint (the LoRA kinds share their base's)."""
    root = tmp_path_factory.mktemp("packed_models")
    bert_st = make_tiny_model(root / "bert_st", layers=2)
    folders = {"bert": bert_st.parent / "hf"}
    for kind in ("xlmr", "modernbert_local"):
        _encoder(root / kind, kind, folders["bert"])
        folders[kind] = root / kind
    for kind in ("qwen2", "qwen3", "llama", "mistral_window"):
        _decoder(root / kind, kind)
        folders[kind] = root / kind
    folders["bert_lora"], folders["qwen2_lora"] = folders["bert"], folders["qwen2"]
    return folders


def _load(checkpoints, kind: str, attn: str = "sdpa", lora_dropout: float = 0.0, base_dropout: float = 0.0, **model):
    pooling, targets, _ = KINDS[kind]
    lora = LoraOptions(r=4, alpha=8, dropout=lora_dropout, target_modules=targets) if targets else None
    cfg = ModelConfig(
        name_or_path=str(checkpoints[kind]),
        device="cpu",
        pooling=pooling,
        max_seq_length=MAX_TOKENS,
        lora=lora,
        model_kwargs={"attn_implementation": attn},
        **model,
    )
    loaded = load_model(cfg, "cpu")
    for module in loaded.modules():  # the checkpoints have no dropout: every Dropout (LoRA's too) takes it here
        if base_dropout and isinstance(module, torch.nn.Dropout):
            module.p = base_dropout
    if lora:  # LoRA B starts at zero: give it values so the adapters change the embeddings
        with torch.no_grad():
            for name, p in loaded.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return loaded


def _row_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=1) / b.norm(dim=1)


@pytest.mark.slow
# flex_attention is not here: on this CPU torch 2.13's inductor compiles it for some shapes (the start-up
# check with Qwen2 packed and agreed at 1e-5, in 91 s) and fails on others (CppCompileError
# "cur_qSplitSize4 was not declared"); resolve_unpad then pads, naming the failure.
@pytest.mark.parametrize("kind,attn", [(kind, attn) for kind in KINDS for attn in ("sdpa", "eager")])
def test_each_packed_row_equals_the_row_alone(checkpoints, kind, attn):
    """The mode expected for the kind is chosen, and each row packed (3+ rows in a pack, rows beyond
    any local window) embeds as the row alone within 1e-5 relative; the pack's rows differ (so a row
    that saw its neighbour would show)."""
    model = _load(checkpoints, kind, attn)
    unpadding = resolve_unpad(model, True)
    assert unpadding.mode == KINDS[kind][2] and f"({attn} attention" in unpadding.description
    model.eval()
    features = model.preprocess(_texts(14, seed=1))
    lengths = features["attention_mask"].sum(1).tolist()
    assert max(lengths) > 2 * WINDOW + 8
    plan = plan_packing(lengths, 0.0, capacity=max(max(lengths), sum(lengths) // 3))
    assert plan.packs <= 4 and int((plan.segments >= 0).sum()) == sum(lengths)
    with torch.no_grad():
        rows = [
            {k: v[i : i + 1, :n] if torch.is_tensor(v) else v for k, v in features.items()}
            for i, n in enumerate(lengths)
        ]
        alone = torch.cat([model(row)["sentence_embedding"] for row in rows])
        with packed_encoder(model, plan, unpadding) as ran:
            packed = model(dict(features))["sentence_embedding"]
    assert ran.count == 1
    assert _row_rel(packed, alone).max() <= 1e-5
    assert _row_rel(alone[1:], alone[:-1]).min() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,rows,mbs", [(kind, 24, 5) for kind in KINDS] + [("bert", 96, 80), ("qwen2_lora", 96, 80)]
)
def test_cached_loss_packed_equals_padded(checkpoints, kind, rows, mbs):
    """Training mode, no dropout: the cached loss's loss and gradients over packed mini-batches (80
    rows: dealt, not best-fit) equal those over sorted padded mini-batches within 1e-5, with fewer
    positions processed."""
    model = _load(checkpoints, kind)
    model.train()
    features = [model.tokenize(_texts(rows, seed)) for seed in (2, 3)]
    padded = build_loss(model, loss_config(), mbs, unpad=False)
    packed = build_loss(model, loss_config(), mbs, unpad=True)
    assert packed.unpadding.mode == KINDS[kind][2]
    results = []
    for built in (padded, packed):
        model.zero_grad()
        value = built.module([dict(f) for f in features], labels=None)
        value.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((value.detach(), grads))
    (ref_loss, ref_grads), (loss, grads) = results
    assert ref_grads.abs().sum() > 0
    assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5
    assert packed.token_counts.processed < padded.token_counts.processed


@pytest.mark.slow
@pytest.mark.parametrize("kind,base_dropout", [("bert_lora", 0.1), ("qwen2_lora", 0.0)])
def test_lora_packed_checkpointed_dropout_replays_exactly(checkpoints, kind, base_dropout):
    """LoRA + packing + gradient checkpointing + dropout: the cached loss replays each packed
    mini-batch (same packing, same RNG state) in its gradient pass, so it equals the plain loss over
    the same packed mini-batches drawn from the same seed; another seed changes the gradients."""
    model = _load(checkpoints, kind, lora_dropout=0.2, base_dropout=base_dropout, gradient_checkpointing=True)
    model.train()
    features = [model.tokenize(_texts(12, seed)) for seed in (4, 5)]
    mbs = 5
    cached = build_loss(model, loss_config(), mbs, sort_by_length=False, unpad=True)
    unpadding = cached.unpadding
    assert unpadding.mode == "position_ids" and "through Peft" in unpadding.description

    def grads():
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    model.zero_grad()
    torch.manual_seed(11)
    reps = []
    for feature in features:
        chunks = []
        for b in range(0, len(feature["input_ids"]), mbs):
            mb = _create_minibatch(feature, b, b + mbs)
            plan = plan_packing(mb["attention_mask"].sum(1).tolist(), unpadding.cost_per_width)
            with packed_encoder(model, plan, unpadding):
                chunks.append(model(mb)["sentence_embedding"])
        reps.append(torch.cat(chunks))
    ref_loss = MultipleNegativesRankingLoss(model).compute_loss_from_embeddings(reps, None)
    ref_loss.backward()
    ref = grads()

    model.zero_grad()
    torch.manual_seed(11)
    loss = cached.module([dict(f) for f in features], labels=None)
    loss.backward()
    assert rel_diff(loss.detach(), ref_loss.detach()) <= 1e-5 and rel_diff(grads(), ref) <= 1e-5
    model.zero_grad()
    torch.manual_seed(12)
    cached.module([dict(f) for f in features], labels=None).backward()
    assert rel_diff(grads(), ref) > 1e-3  # dropout is really on


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bert_library_masks_equal_the_hand_built_block_mask(checkpoints, monkeypatch, attn):
    """BERT (the demo's MiniLM path) moved from the hand-built block-diagonal mask to transformers'
    packed-sequence masks: the same boolean (sdpa) or additive (eager) mask over the real tokens, so
    the packed embeddings are bit for bit the former path's (make demo's numbers stay)."""
    from cembed.model import unpad

    model = _load(checkpoints, "bert", attn)
    model.eval()
    features = model.preprocess(_texts(14, seed=6))
    plan = plan_packing(features["attention_mask"].sum(1).tolist(), 0.0, capacity=80)
    embedded = {}
    for modes in (("position_ids",), ("block",)):
        monkeypatch.setattr(unpad, "PACK_MODES", modes)
        unpadding = resolve_unpad(model, True)
        with torch.no_grad(), packed_encoder(model, plan, unpadding):
            embedded[unpadding.mode] = model(dict(features))["sentence_embedding"]
    assert torch.equal(embedded["position_ids"], embedded["block"])


def test_lora_is_judged_by_its_base_model(checkpoints):
    """PeftModel.forward takes ``*args, **kwargs``: the decision looks through it to BertModel, whose
    forward takes position_ids, and says so."""
    model = _load(checkpoints, "bert_lora")
    unpadding = resolve_unpad(model, "auto")
    assert unpadding.enabled, unpadding.description
    assert unpadding.description.endswith("to BertModel)") and "through PeftModel" in unpadding.description


@pytest.mark.slow
def test_positions_that_do_not_restart_are_refused(checkpoints, monkeypatch):
    """A pack whose positions run on across its rows is one sequence to transformers (a causal row
    then sees the rows before it, a bidirectional one all of its pack): the start-up check measures the
    difference and the model pads, the reason naming it for each mode tried."""
    from cembed.model import unpad

    def running_on(plan, offset):
        return torch.arange(plan.pack_width).expand(plan.packs, -1) + offset

    monkeypatch.setattr(unpad, "packed_positions", running_on)
    for kind in ("qwen2", "bert"):
        refused = resolve_unpad(_load(checkpoints, kind), "auto")
        assert not refused.enabled
        assert (
            "position_ids: a packed row" in refused.description
            and "differs from the row embedded alone" in refused.description
        )


def _config(write_config, tmp_path, model_dir, name: str, **model):
    return str(
        write_config(
            {
                "model": {"name_or_path": str(model_dir), "device": "cpu", "max_seq_length": 32, **model},
                "data": {"train": "cembed:coco-captions", "max_samples": 256},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
                "train": {"max_steps": 1, "output_dir": str(tmp_path / name)},
            },
            name=f"{name}.yaml",
        )
    )


@pytest.mark.slow
def test_validate_names_the_packed_path_for_qwen2_lora(checkpoints, write_config, tmp_path):
    """``cembed validate`` on a Qwen2 + LoRA config prints the packed attention line naming the path
    through the PEFT wrapper to Qwen2Model."""
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    cfg = _config(write_config, tmp_path, checkpoints["qwen2"], "qwen", pooling="lasttoken", lora=lora)
    r = CliRunner().invoke(app, ["validate", cfg])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "attention: packed rows, no padding (sdpa attention, transformers' packed-sequence masks" in text
    assert "to Qwen2Model)" in text
