"""Unpadded attention (batch.unpad): packed mini-batches give the padded path's loss and gradients,
the meter counts the positions the encoder really ran on, and a model that cannot run packed rows
falls back to sorted padding (or is refused with batch.unpad: true)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import distinct_pairs, make_tiny_model
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.gradcache import _create_minibatch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import load_config
from cembed.config.loss import CachedMNRLLossConfig
from cembed.errors import ModelRefused
from cembed.losses.registry import build_loss
from cembed.model.packing import attention_cost, pack_rows, plan_packing
from cembed.model.unpad import PackRegistry, Unpadding, column_lengths, packed_encoder, resolve_unpad

WORDS = "a man dog on the street with two red car cat table people sitting near white plate".split()


def _texts(n: int, seed: int, longest: int) -> list[str]:
    """Mixed lengths: 1 .. longest words, in a seeded shuffled order."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(k)) + f" {i}" for i, k in enumerate(lengths)]


def _features(model, n: int = 24, columns: int = 2):
    return [model.tokenize(_texts(n, seed, longest=10 + 25 * seed)) for seed in range(columns)]


def _loss_and_grads(model, loss, features):
    model.zero_grad()
    value = loss([dict(f) for f in features], labels=None)
    value.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return value.detach(), grads


def _rel(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


@pytest.fixture(scope="module")
def two_layer_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny2"), layers=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "attn,mbs,columns", [("sdpa", 1, 2), ("sdpa", 3, 2), ("sdpa", 8, 3), ("sdpa", 24, 2), ("eager", 5, 2)]
)
def test_packed_equals_padded(two_layer_model_dir, attn, mbs, columns):
    """Loss and gradients of the packed path equal the sorted-padded path's (fp32, no dropout), and
    the meter counts fewer processed positions (the packs') for the same real tokens."""
    model = SentenceTransformer(str(two_layer_model_dir), device="cpu", model_kwargs={"attn_implementation": attn})
    model.train()
    features = _features(model, columns=columns)
    padded = build_loss(model, CachedMNRLLossConfig(), mbs, unpad=False)
    packed = build_loss(model, CachedMNRLLossConfig(), mbs, unpad="auto")
    assert not padded.unpadding.enabled and packed.unpadding.enabled
    assert f"{attn} attention" in packed.unpadding.description
    ref_loss, ref_grads = _loss_and_grads(model, padded.module, features)
    loss, grads = _loss_and_grads(model, packed.module, features)
    assert ref_grads.abs().sum() > 0
    assert _rel(loss, ref_loss) <= 1e-5 and _rel(grads, ref_grads) <= 1e-5
    real = sum(int(f["attention_mask"].sum()) for f in features)
    assert packed.token_counts.real == padded.token_counts.real == real
    if mbs == 1:
        assert packed.token_counts.processed == real  # one row per pack, nothing to pad
    else:
        assert packed.token_counts.processed < padded.token_counts.processed


def test_processed_counts_the_packs(two_layer_model_dir):
    """With one mini-batch per column, the processed positions are exactly the two plans' packs."""
    model = SentenceTransformer(str(two_layer_model_dir), device="cpu")
    features = _features(model, n=40)
    built = build_loss(model, CachedMNRLLossConfig(), 40)
    with torch.no_grad():
        built.module([dict(f) for f in features], None)
    cost = attention_cost(model[0].auto_model.config)
    plans = [plan_packing(f["attention_mask"].sum(1).tolist(), cost) for f in features]
    assert built.token_counts.processed == sum(p.packs * p.pack_width for p in plans)
    assert built.token_counts.real == sum(p.real for p in plans)
    padded = sum(f["attention_mask"].numel() for f in features)
    assert built.token_counts.processed < 0.8 * padded  # lengths 1..35 words: much padding removed


@pytest.mark.slow
@pytest.mark.parametrize("mbs", [3, 7])
def test_dropout_cached_packed_equals_plain_packed(tiny_dropout_model_dir, mbs):
    """With dropout on, the cached loss replays each packed mini-batch (same packing, same RNG state)
    in its gradient pass: it equals embedding the same packed mini-batches once with gradients from
    the same seed and applying the plain loss to them."""
    model = SentenceTransformer(str(tiny_dropout_model_dir), device="cpu")
    model.train()
    features = _features(model, n=14)
    n = 14
    cached = build_loss(model, CachedMNRLLossConfig(), mbs, sort_by_length=False, unpad=True)
    unpadding = cached.unpadding

    model.zero_grad()
    torch.manual_seed(123)
    reps = []
    for feat in features:
        chunks = []
        for b in range(0, n, mbs):
            mb = _create_minibatch(feat, b, b + mbs)
            plan = plan_packing(mb["attention_mask"].sum(1).tolist(), unpadding.cost_per_width)
            with packed_encoder(model, plan, unpadding):
                chunks.append(model(mb)["sentence_embedding"])
        reps.append(torch.cat(chunks))
    ref_loss = MultipleNegativesRankingLoss(model).compute_loss_from_embeddings(reps, None)
    ref_loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    torch.manual_seed(123)
    loss, grads = _loss_and_grads(model, cached.module, features)
    assert _rel(loss, ref_loss.detach()) <= 1e-5  # the same masks; only the summation order differs
    assert _rel(grads, ref_grads) <= 1e-5
    torch.manual_seed(999)  # dropout is really on: another seed changes the gradients
    assert _rel(_loss_and_grads(model, cached.module, features)[1], ref_grads) > 1e-3


def test_pack_rows_fits_every_row_once():
    lengths = [7, 1, 30, 12, 12, 5, 29, 3, 16, 16, 2]
    for capacity in (30, 31, 45, 60, 200):
        packs = pack_rows(lengths, capacity)
        assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in p) <= capacity for p in packs)
    assert pack_rows(lengths, 200) == [[2, 6, 8, 9, 3, 4, 0, 5, 7, 10, 1]]  # one pack, longest first
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows(lengths, 29)


def test_plan_round_trip_and_cost():
    """Packing a padded tensor and scattering it back restores every real position (padding -> 0);
    the chosen packing never costs more than padding."""
    lengths = [9, 3, 3, 8, 1, 6, 2, 9, 4]
    rows, width = len(lengths), max(lengths)
    plan = plan_packing(lengths, 0.01)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    values = torch.randn(rows, width, 5) * mask[..., None]
    packed = values.reshape(rows * width, 5)[plan.gather].view(plan.packs, plan.pack_width, 5)
    back = packed.reshape(-1, 5)[plan.scatter].view(rows, width, 5) * mask[..., None]
    assert torch.equal(back, values)
    # each packed position holds its row's token at the right position
    for p in range(plan.packs):
        for j in range(plan.pack_width):
            r = int(plan.segments[p, j])
            if r >= 0:
                assert int(plan.gather[p * plan.pack_width + j]) == r * width + int(plan.positions[p, j])
    assert plan.real == sum(lengths)
    assert plan.processed * (1 + 0.01 * plan.pack_width) <= rows * width * (1 + 0.01 * width)
    assert plan_packing(lengths, 0.0).processed == sum(lengths)  # attention free: one full pack is cheapest


@pytest.mark.parametrize("rows", [65, 300, 4096])
def test_large_minibatch_plan_round_trips_and_balances(rows):
    """More than BEST_FIT_MAX_ROWS rows take the dealt path (deal_rows): every real position comes
    back, every row lies whole in one pack at its own positions, and the packs' fills differ by at
    most the longest row (here they end within a few tokens: padding under 5 %)."""
    from cembed.model.packing import BEST_FIT_MAX_ROWS, deal_rows

    assert rows > BEST_FIT_MAX_ROWS
    rng = np.random.default_rng(rows)
    lengths = np.clip(rng.lognormal(np.log(14), 0.5, rows).astype(int), 1, 128).tolist()
    width = max(lengths)
    plan = plan_packing(lengths, 1 / 2304)  # MiniLM's attention cost
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    values = torch.randn(rows, width, 3) * mask[..., None]
    packed = values.reshape(rows * width, 3)[plan.gather].view(plan.packs, plan.pack_width, 3)
    assert torch.equal(packed.reshape(-1, 3)[plan.scatter].view(rows, width, 3) * mask[..., None], values)
    segments, positions = plan.segments.flatten(), plan.positions.flatten()
    # each row's packed positions in order (a stable sort by row; one pass, not a scan per row)
    at = torch.argsort(segments, stable=True)[int((segments < 0).sum()) :]
    assert torch.equal(segments[at], torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths)))
    starts = torch.cumsum(torch.tensor(lengths), 0) - torch.tensor(lengths)  # each row's first entry in `at`
    first, last = at[starts], at[starts + torch.tensor(lengths) - 1]
    assert torch.equal(last - first + 1, torch.tensor(lengths))  # contiguous (the row's positions ascend)
    assert torch.equal(first // plan.pack_width, last // plan.pack_width)  # in one pack
    assert torch.equal(positions[at], torch.cat([torch.arange(n) for n in lengths]))
    fills = np.bincount(deal_rows(np.asarray(lengths), plan.packs), weights=lengths, minlength=plan.packs)
    assert fills.max() - fills.min() <= width and fills.max() == plan.pack_width
    assert plan.real == sum(lengths) and 1 - plan.real / plan.processed < 0.05


@pytest.fixture(scope="module")
def t5_model_dir(tiny_model_dir, tmp_path_factory):
    """A tiny T5 encoder (relative position buckets, no position_ids argument) + mean pooling."""
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    folder = tmp_path_factory.mktemp("t5")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.save_pretrained(folder / "hf")
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, dropout_rate=0.0
    )
    T5EncoderModel(config).save_pretrained(folder / "hf")
    model = SentenceTransformer(modules=[Transformer(str(folder / "hf"), max_seq_length=32), Pooling(32, "mean")])
    model.save(str(folder / "st"))
    return folder / "st"


def test_unsupported_model_falls_back(t5_model_dir):
    model = SentenceTransformer(str(t5_model_dir), device="cpu")
    model.train()
    features = _features(model)
    auto = build_loss(model, CachedMNRLLossConfig(), 5, unpad="auto")
    assert not auto.unpadding.enabled
    assert "packing unsupported: T5EncoderModel takes no position_ids" in auto.unpadding.description
    off = build_loss(model, CachedMNRLLossConfig(), 5, unpad=False)
    loss, grads = _loss_and_grads(model, auto.module, features)
    ref_loss, ref_grads = _loss_and_grads(model, off.module, features)
    assert _rel(loss, ref_loss) == 0 and _rel(grads, ref_grads) == 0
    assert auto.token_counts.processed == off.token_counts.processed  # sorted padding, counted as before
    with pytest.raises(ModelRefused, match="batch.unpad: true, but this model cannot run packed rows"):
        resolve_unpad(model, True)


def _tiny_roberta(tokenizer_dir, folder):
    """A one-layer RoBERTa sentence-transformer (seed 0, no dropout) with ``tokenizer_dir``'s tokenizer,
    saved in ``folder``; RoBERTa numbers positions from ``padding_idx + 1``. Returns (model, tokenizer)."""
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, RobertaConfig, RobertaModel

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=80,
        pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    RobertaModel(config).save_pretrained(folder)
    model = SentenceTransformer(modules=[Transformer(str(folder), max_seq_length=32), Pooling(32, "mean")])
    return model, tokenizer


@pytest.mark.slow
def test_roberta_style_positions_pack(tmp_path):
    """A RoBERTa model numbers positions from padding_idx + 1: packed rows get the same offset."""
    model, tokenizer = _tiny_roberta(make_tiny_model(tmp_path / "bert"), tmp_path / "hf")
    unpadding = resolve_unpad(model, True)
    assert unpadding.enabled and unpadding.position_offset == tokenizer.pad_token_id + 1
    features = _features(model)
    ref = _loss_and_grads(model, build_loss(model, CachedMNRLLossConfig(), 6, unpad=False).module, features)
    got = _loss_and_grads(model, build_loss(model, CachedMNRLLossConfig(), 6, unpad=True).module, features)
    assert _rel(got[0], ref[0]) <= 1e-5 and _rel(got[1], ref[1]) <= 1e-5


def _cfg(write_config, pairs_file, model_dir, tmp_path, unpad) -> str:
    return str(
        write_config(
            {
                "model": {"name_or_path": str(model_dir), "device": "cpu", "max_seq_length": 32},
                "data": {"train": str(pairs_file(distinct_pairs(16)))},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4, "unpad": unpad},
                "train": {"max_steps": 1, "output_dir": str(tmp_path / "run"), "logging_steps": 1},
            }
        )
    )


@pytest.mark.slow
def test_validate_and_train_say_which_path(tiny_model_dir, t5_model_dir, write_config, pairs_file, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["validate", _cfg(write_config, pairs_file, tiny_model_dir, tmp_path, "auto")])
    assert r.exit_code == 0, r.output
    assert "attention: packed rows, no padding (sdpa attention" in r.output
    r = runner.invoke(app, ["validate", _cfg(write_config, pairs_file, t5_model_dir, tmp_path, True)])
    assert r.exit_code == 2 and "batch.unpad: true, but this model cannot run packed rows" in r.output
    r = runner.invoke(app, ["validate", _cfg(write_config, pairs_file, t5_model_dir, tmp_path, "auto")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert (
        "attention: padded mini-batches, sorted by length (packing unsupported: T5EncoderModel takes no position_ids)"
        in text
    )
    r = runner.invoke(app, ["validate", _cfg(write_config, pairs_file, tiny_model_dir, tmp_path, "maybe")])
    assert r.exit_code == 2 and "batch.unpad" in r.output and "Traceback" not in r.output

    r = runner.invoke(app, ["train", _cfg(write_config, pairs_file, tiny_model_dir, tmp_path, "auto")])
    assert r.exit_code == 0, r.output
    assert "attention: packed rows, no padding" in r.output
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["attention"]["unpadded"] is True
    # distinct_pairs' texts differ by a digit or two: packing leaves (almost) no padding
    assert summary["throughput"]["padded_share"] <= 0.05


def test_torch_compile_refuses_unpad_true(tiny_model_dir, write_config, pairs_file, tmp_path):
    """A compiled forward bypasses the packing hooks (scripts/bench_compile.py: the packed compiled run
    gave the padded compiled run's losses), so batch.unpad: true with train.torch_compile is refused
    naming both fields; with auto the run trains padded mini-batches."""
    import yaml

    path = _cfg(write_config, pairs_file, tiny_model_dir, tmp_path, True)
    cfg = yaml.safe_load(open(path))
    cfg["train"]["torch_compile"] = True
    r = CliRunner().invoke(app, ["validate", str(write_config(cfg, name="compiled.yaml"))])
    assert r.exit_code == 2 and "Traceback" not in r.output
    text = " ".join(r.output.split())
    assert "batch.unpad: true cannot run with train.torch_compile: true" in text
    cfg["batch"]["unpad"] = "auto"
    assert load_config(write_config(cfg, name="compiled_auto.yaml")).batch.unpad == "auto"


def _modes(model) -> dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


@pytest.mark.slow
def test_support_check_keeps_every_module_mode(tiny_dropout_model_dir):
    """A freshly loaded model is top-level `train` with its encoder in `eval` (from_pretrained): building
    a packed loss (whose support check runs the model in eval mode) leaves every module's mode as it
    was, so a no-grad loss on the same inputs does not change (dropout stays off)."""
    model = SentenceTransformer(str(tiny_dropout_model_dir), device="cpu")
    modes = _modes(model)
    assert modes[""] and not model[0].auto_model.training  # the mixed state the check must give back
    features = _features(model, n=12)
    padded = build_loss(model, CachedMNRLLossConfig(), 4, unpad=False)
    with torch.no_grad():
        before = padded.module([dict(f) for f in features], None)
    packed = build_loss(model, CachedMNRLLossConfig(), 4, unpad="auto")
    assert packed.unpadding.enabled
    assert _modes(model) == modes
    with torch.no_grad():
        assert padded.module([dict(f) for f in features], None) == before
    model.train()
    model[0].auto_model.encoder.eval()  # another mixed state, set by hand
    modes = _modes(model)
    torch.set_float32_matmul_precision("high")  # TF32 on, as cembed.plan.precision.enable_tf32 sets it
    try:
        resolve_unpad(model, "auto")  # the check itself runs at "highest" and gives "high" back
        assert _modes(model) == modes and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")


def _sliding_modernbert(folder, tokenizer_dir, every: int, local: int = 32, longest: int = 64):
    """A tiny ModernBERT (rotary positions, takes position_ids, sdpa): local attention of ``local`` tokens
    (half each side) in every layer but each ``every``-th; rows up to ``longest`` tokens."""
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, ModernBertConfig, ModernBertModel

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = ModernBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        local_attention=local,
        global_attn_every_n_layers=every,
        max_position_embeddings=2 * longest,
        pad_token_id=tokenizer.pad_token_id,
        cls_token_id=tokenizer.cls_token_id,
        sep_token_id=tokenizer.sep_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
    )
    ModernBertModel(config).save_pretrained(folder)
    transformer = Transformer(str(folder), max_seq_length=longest, model_kwargs={"attn_implementation": "sdpa"})
    return SentenceTransformer(modules=[transformer, Pooling(32, "mean")], device="cpu")


def test_sliding_window_modernbert_packs_with_layer_masks(tiny_model_dir, tmp_path, monkeypatch):
    """ModernBERT does not pass position_ids to its mask functions (issue 34): restarted positions
    alone leave its packs attending across rows, which the start-up check measures and rejects; the
    per-layer-type mapping (block-diagonal, and block-diagonal within the 16-token window for its local
    layers) agrees and is used. With that mode gone, the hand-built block mask is refused by the config
    rule (it would widen the window), and without the rule the check's own comparison refuses it."""
    from cembed.model import unpad

    model = _sliding_modernbert(tmp_path / "local", tiny_model_dir, every=3)
    auto = resolve_unpad(model, "auto")
    assert auto.enabled and auto.mode == "layer_masks"
    assert "per-layer-type masks (full_attention, sliding_attention)" in auto.description
    monkeypatch.setattr(unpad, "PACK_MODES", ("position_ids", "block"))
    refused = resolve_unpad(model, "auto")
    assert not refused.enabled and "sliding-window attention" in refused.description
    assert "position_ids: a packed row" in refused.description  # measured, not assumed
    with pytest.raises(ModelRefused, match=r"batch.unpad: true, but .*sliding-window attention"):
        resolve_unpad(model, True)
    monkeypatch.setattr(unpad, "PACK_MODES", ("block",))
    monkeypatch.setattr(unpad, "local_attention_reason", lambda config, max_seq_length: "")
    checked = resolve_unpad(model, "auto")
    assert not checked.enabled and "differs from the row embedded alone" in checked.description


@pytest.mark.slow
def test_full_attention_modernbert_packs(tiny_model_dir, tmp_path):
    """The same architecture with every layer global packs, and packed == padded through the loss."""
    model = _sliding_modernbert(tmp_path / "global", tiny_model_dir, every=1)
    assert resolve_unpad(model, True).enabled
    features = _features(model)
    ref = _loss_and_grads(model, build_loss(model, CachedMNRLLossConfig(), 6, unpad=False).module, features)
    got = _loss_and_grads(model, build_loss(model, CachedMNRLLossConfig(), 6, unpad=True).module, features)
    assert _rel(got[0], ref[0]) <= 1e-5 and _rel(got[1], ref[1]) <= 1e-5


def test_local_attention_config_rule():
    """Which configs declare attention that a row's window can bind (configs only, no weights)."""
    from transformers import BigBirdConfig, LongformerConfig, MistralConfig, ModernBertConfig, Qwen2Config

    from cembed.model.unpad import local_attention_reason

    assert local_attention_reason(ModernBertConfig(global_attn_every_n_layers=1), 512) == ""
    assert local_attention_reason(ModernBertConfig(), 512) == (  # 128 wide, every 3rd layer global
        "14 of its 22 layers use sliding-window attention (64-token window, rows up to 512 tokens)"
    )
    assert local_attention_reason(Qwen2Config(), 512) == ""  # use_sliding_window: false
    assert local_attention_reason(MistralConfig(sliding_window=4096), 512) == ""  # no row reaches the window
    assert local_attention_reason(MistralConfig(sliding_window=4096), 8192) == (
        "it uses sliding-window attention (sliding_window: 4096-token window, rows up to 8192 tokens)"
    )
    assert local_attention_reason(LongformerConfig(), 512) == "it uses local attention (attention_window: 512)"
    assert local_attention_reason(BigBirdConfig(attention_type="block_sparse"), 512) == (
        "it uses block-sparse attention (attention_type: block_sparse)"
    )
    assert local_attention_reason(BigBirdConfig(attention_type="original_full"), 512) == ""


def _leaky_block_mask(third_only: bool, weight: float | None):
    """``_block_mask`` with a leak: each row's queries also see the last key of the row before it in its
    pack; only for rows placed third or later in a pack (``third_only``); at additive ``-weight`` (a
    leaked share of about e^-weight) instead of fully (``weight``)."""

    def block_mask(plan, kind, dtype):
        seg = plan.segments
        same = seg[:, :, None] == seg[:, None, :]
        starts = torch.cat([torch.ones_like(seg[:, :1], dtype=torch.bool), seg[:, 1:] != seg[:, :-1]], 1)
        index = torch.arange(seg.shape[1]).expand_as(seg)
        before = (torch.where(starts, index, 0).cummax(1).values - 1).clamp_min(0)  # last key of the row before
        leaks = (before > 0) & (seg >= 0) & (seg.gather(1, before) >= 0) & ~same.gather(2, before[..., None])[..., 0]
        if third_only:
            leaks &= starts.long().cumsum(1) >= 3
        leak = torch.zeros_like(same)
        p, q = leaks.nonzero(as_tuple=True)
        leak[p, q, before[p, q]] = True
        allowed = (same | leak)[:, None]
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        if weight is not None:
            return additive.masked_fill_(leak[:, None], -weight)  # sdpa takes an additive mask too
        return allowed if kind == "bool" else additive

    return block_mask


@pytest.mark.parametrize("third_only,weight", [(True, None), (False, 4.0)], ids=["third-row-in-a-pack", "faint"])
def test_leaking_rows_are_refused(two_layer_model_dir, monkeypatch, third_only, weight):
    """Rows that see one key of their pack neighbour get embeddings a little off: the start-up check
    compares each packed row (several rows per pack) with the row embedded alone at 1e-5 and refuses
    under auto. The former check (two rows per pack at most, whole-batch difference against padded at
    1e-4) accepted both leaks: the one only from a pack's third row on, and the faint one (1.4e-4 per
    row, diluted below 1e-4 over the batch). With the real mask the same model packs."""
    from cembed.model import unpad

    model = SentenceTransformer(str(two_layer_model_dir), device="cpu")
    monkeypatch.setattr(unpad, "PACK_MODES", ("block",))  # BERT's preferred mode builds no mask here
    assert resolve_unpad(model, "auto").enabled
    monkeypatch.setattr(unpad, "_block_mask", _leaky_block_mask(third_only, weight))
    leaky = resolve_unpad(model, "auto")
    assert not leaky.enabled and "differs from the row embedded alone" in leaky.description


@pytest.mark.parametrize("window", [4, 16])
def test_a_sliding_window_binds_from_one_token_past_its_length(window):
    """The boundary at exactly the window's length: transformers' causal sliding window of ``w``
    (``kv > q - w``) lets a row of ``w`` tokens attend as full causal attention and cuts a row of
    ``w + 1``; so rows up to ``max_seq_length == w`` may take the block mask (full attention within a
    row) and ``w + 1`` may not, for a ``sliding_window`` config (Mistral) and a ``layer_types`` one
    (Qwen2 with its window on)."""
    from transformers import MistralConfig, Qwen2Config
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    from cembed.model.unpad import local_attention_reason

    def grid(fn, n):  # the (query, key) mask of a row of n tokens, as the library evaluates it
        zero, positions = torch.tensor(0), torch.arange(n)
        return fn(zero, zero, positions[:, None], positions[None, :]).tolist()

    windowed = sliding_window_causal_mask_function(window)
    assert grid(windowed, window) == grid(causal_mask_function, window)
    assert grid(windowed, window + 1) != grid(causal_mask_function, window + 1)
    qwen2 = Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=0, num_hidden_layers=2)
    assert qwen2.layer_types == ["sliding_attention"] * 2
    for config in (MistralConfig(sliding_window=window), qwen2):
        assert local_attention_reason(config, window) == ""
        assert f"{window}-token window, rows up to {window + 1} tokens" in local_attention_reason(config, window + 1)


# --- which columns pack, read from the features alone (no model): every row right-padded and not empty,
# every other tensor per token, no embedded position outside the mask


def _column(mask, **extra):
    mask = torch.tensor(mask)
    return {"input_ids": torch.arange(mask.numel()).view(mask.shape), "attention_mask": mask, **extra}


def test_column_lengths_are_each_rows_tokens_where_the_column_packs():
    mask = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    plain = column_lengths(_column(mask))
    assert plain == [3, 1, 4] and all(type(n) is int for n in plain)
    per_token = {"token_type_ids": torch.zeros(3, 4, dtype=torch.long), "inputs_embeds": torch.zeros(3, 4, 2)}
    bookkeeping = {"task": "query", "modality": "text", "prompt_length": torch.tensor([1, 1, 1])}
    assert column_lengths(_column(mask, **per_token, **bookkeeping)) == [3, 1, 4]
    assert column_lengths(_column(mask, sentence_ids=[7, 8, 9])) == [3, 1, 4]  # a value that is no tensor: left as is
    expanded = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 1]])  # every expansion token attended to
    assert column_lengths(_column(mask, query_expansion_positions=expanded)) == [3, 1, 4]


@pytest.mark.parametrize(
    "feature",
    [
        {"input_ids": torch.ones(2, 3, dtype=torch.long)},  # no mask
        _column([1, 1, 0]),  # a mask of one dimension
        {"input_ids": torch.ones(0, 3, dtype=torch.long), "attention_mask": torch.ones(0, 3, dtype=torch.long)},
        _column([[1, 1, 0], [0, 1, 1]]),  # left padding
        _column([[1, 0, 1], [1, 1, 1]]),  # a hole
        _column([[1, 1, 0], [0, 0, 0]]),  # an empty row
        _column([[1, 1, 0], [1, 1, 1]], labels=torch.ones(2)),  # a tensor not per token
        _column([[1, 1, 0], [1, 1, 1]], token_type_ids=torch.zeros(2, 4, dtype=torch.long)),  # another width
        _column([[1, 1, 0], [1, 1, 1]], token_type_ids=torch.zeros(3, 3, dtype=torch.long)),  # other rows
        _column([[1, 1, 0], [1, 1, 1]], query_expansion_positions=torch.tensor([[0, 1, 1], [0, 0, 1]])),
    ],
    ids=["no-mask", "1d", "no-rows", "left", "hole", "empty-row", "per-row", "width", "rows", "expansion-unattended"],
)
def test_a_column_that_cannot_pack_has_no_lengths(feature):
    assert column_lengths(feature) is None


def test_pack_registry_replays_the_plans_of_a_column_and_recomputes_a_miss():
    registry = PackRegistry(Unpadding(True, "packed", cost_per_width=0.0))
    feature = _column([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    plans = registry.plan_column(feature, [(0, 2), (2, 5), (5, 5)])  # an empty range is not planned
    assert [(p.rows, p.real) for p in plans] == [(2, 4), (3, 10)] and registry.planned() == 2
    assert registry.plan_for(feature, 0, 2) is plans[0] and registry.plan_for(feature, 2, 5) is plans[1]
    assert registry.plan_for(feature, 5, 5) is None  # registered, not planned
    again = registry.plan_for(feature, 1, 9)  # a range not registered: rows 1..4, the plan packing gives
    expected = plan_packing([1, 4, 2, 4], 0.0)
    assert (again.rows, again.real, again.packs) == (4, 11, expected.packs)
    assert torch.equal(again.gather, expected.gather) and torch.equal(again.segments, expected.segments)
    assert registry.plan_for(dict(feature), 0, 2) is not plans[0]  # another dict of the same tensors: recomputed
    assert registry.plan_for(feature, 3, 3) is None and registry.plan_for(feature, 4, 2) is None
    unpackable = _column([[0, 1], [1, 1]])
    assert registry.plan_column(unpackable, [(0, 2)]) is None and registry.plan_for(unpackable, 0, 2) is None
    assert registry.planned() == 2  # the unpackable column's range counts for nothing
    registry.reset()
    assert registry.planned() == 0 and registry.plan_for(feature, 0, 2) is not plans[0]


def test_local_attention_reasons_name_the_layers_and_the_window():
    from types import SimpleNamespace as Config

    from cembed.model.unpad import local_attention_reason

    mixed = Config(sliding_window=64, layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    assert local_attention_reason(mixed, 512) == (
        "2 of its 3 layers use sliding-window attention (64-token window, rows up to 512 tokens)"
    )
    assert local_attention_reason(Config(layer_types=["full_attention", "sliding_attention"]), 512) == (
        "1 of its 2 layers use sliding-window attention (a window, rows up to 512 tokens)"
    )
    chunked = Config(sliding_window=64, layer_types=["full_attention", "chunked_attention", "sliding_attention"])
    assert local_attention_reason(chunked, 512) == (
        "its layers include chunked_attention, sliding_attention (layer_types), not full attention within a row"
    )
    assert local_attention_reason(Config(sliding_window=16, use_sliding_window=False), 512) == ""
    assert local_attention_reason(Config(attention_chunk_size=8192), 512) == (
        "it uses chunked attention (attention_chunk_size: 8192)"
    )
    # ModernBERT-style local_attention (both sides) without layer_types: binds past half its width
    modern = Config(local_attention=128, global_attn_every_n_layers=3)
    assert local_attention_reason(modern, 64) == ""
    assert local_attention_reason(modern, 65) == "it uses sliding-window attention (local_attention: 128 tokens)"
    assert local_attention_reason(Config(local_attention=128), 512) == ""  # every layer global
    # a nested config (a text_config) is looked at after a parent whose own layers do not bind
    text = Config(model_type="text", to_dict=dict, sliding_window=16)
    reason = "it uses sliding-window attention (sliding_window: 16-token window, rows up to {} tokens)"
    assert local_attention_reason(Config(layer_types=["full_attention"], text_config=text), 512) == reason.format(512)
    windowed = Config(sliding_window=64, layer_types=["sliding_attention"], text_config=text)
    assert local_attention_reason(windowed, 64) == reason.format(64)


def test_the_summary_names_the_unpadded_path():
    assert Unpadding(True, "packed (position_ids)").to_dict() == {"unpadded": True, "path": "packed (position_ids)"}


def test_the_widest_window_a_config_declares_in_tokens_to_one_side():
    from types import SimpleNamespace as Config

    from cembed.model.unpad import widest_window

    assert widest_window(Config()) == 0
    assert widest_window(Config(sliding_window=64, attention_window=[32, 128], attention_chunk_size=96)) == 128
    assert widest_window(Config(attention_chunk_size=96, sliding_window=None)) == 96
    assert widest_window(Config(local_attention=129)) == 64  # ModernBERT's is both sides
    text = Config(model_type="text", to_dict=dict, sliding_window=200)  # nested: counted too
    assert widest_window(Config(sliding_window=16, text_config=text)) == 200


def test_a_left_padding_tokenizer_pads_saying_so(two_layer_model_dir):
    model = SentenceTransformer(str(two_layer_model_dir), device="cpu")
    model.tokenizer.padding_side = "left"
    unpadding = resolve_unpad(model, "auto")
    why = "its tokenizer pads on the left or adds features other than token ids"
    assert not unpadding.enabled
    assert unpadding.description == (
        f"padded mini-batches, sorted by length (packing unsupported: position_ids: {why}; block mask: {why})"
    )


def test_a_packed_forward_that_fails_pads_quoting_the_errors_first_line(two_layer_model_dir, monkeypatch):
    from cembed.model import unpad

    def failing_mask(plan, kind, dtype):
        raise RuntimeError("x" * 150 + "\nits second line")

    model = SentenceTransformer(str(two_layer_model_dir), device="cpu")
    monkeypatch.setattr(unpad, "PACK_MODES", ("block",))
    monkeypatch.setattr(unpad, "_block_mask", failing_mask)
    unpadding = resolve_unpad(model, "auto")
    assert not unpadding.enabled
    assert unpadding.description == (  # the first line, cut to 120 characters
        f"padded mini-batches, sorted by length (packing unsupported: block mask: the packed forward fails "
        f"(RuntimeError: {'x' * 120}))"
    )


def test_a_packed_row_of_another_shape_than_alone_pads(two_layer_model_dir, monkeypatch):
    """A kind whose rows are the padded token vectors (a packed row comes back as wide as its batch, a
    row alone as long as itself): the check compares shapes before values."""
    from types import SimpleNamespace

    from cembed.model import unpad

    padded_tokens = SimpleNamespace(text_outputs=lambda output: list(output["token_embeddings"]))
    monkeypatch.setattr(unpad, "kind_of", lambda model, default=None: padded_tokens)
    unpadding = resolve_unpad(SentenceTransformer(str(two_layer_model_dir), device="cpu"), "auto")
    assert not unpadding.enabled
    assert "position_ids: a packed row's output has another shape than the row's alone" in unpadding.description


def test_a_multi_vector_model_is_checked_on_its_token_vectors(tiny_model_dir):
    """The check compares what the model's kind outputs per row: a multi-vector model's token vectors (it
    has no sentence embedding to compare)."""
    from cembed.config.model import model_config
    from cembed.model.load import load_model

    model = load_model(model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), dim=16), "cpu", seed=7)
    unpadding = resolve_unpad(model, "auto")
    assert unpadding.enabled and unpadding.mode == "position_ids", unpadding.description


def test_the_check_packs_its_rows_two_packs_of_several_rows(two_layer_model_dir, monkeypatch):
    """The start-up check's rows (their token counts with the tiny tokenizer: 64 for the truncated 96 words,
    63, 42, 29, 20, 14, 10, 7, 5, 4, 3; 261 in all) are packed best fit at half the tokens, 131: rows 0, 1
    and 9 (64 + 63 + 4) in one pack, the 8 others (130) in the other, so a leak between a pack's rows
    shows in several rows."""
    from cembed.model import unpad

    plans = []

    def recording(lengths, cost_per_width, device="cpu", capacity=None):
        plans.append((list(lengths), capacity, plan_packing(lengths, cost_per_width, device, capacity=capacity)))
        return plans[-1][2]

    monkeypatch.setattr(unpad, "plan_packing", recording)
    unpadding = resolve_unpad(SentenceTransformer(str(two_layer_model_dir), device="cpu"), "auto")
    assert unpadding.description == (  # BertModel itself: no "through ..."
        "packed rows, no padding (sdpa attention, transformers' packed-sequence masks from position_ids restarting per row)"
    )
    [(lengths, capacity, plan)] = plans
    assert lengths == [64, 63, 42, 29, 20, 14, 10, 7, 5, 4, 3] and capacity == 131
    rows = [sorted(set(pack) - {-1}) for pack in plan.segments.tolist()]
    assert rows == [[0, 1, 9], [2, 3, 4, 5, 6, 7, 8, 10]]


def test_the_check_rows_outreach_a_window_wider_than_its_longest_text(tiny_model_dir, tmp_path, monkeypatch):
    """A ModernBERT with a 128-token window to each side and rows up to 256 tokens: the check's 96-word
    rows fit in the window, so it adds two rows of 128 + 32 words, where the hand-built block mask (full
    attention within a row) differs from the model's own window (the config rule switched off here)."""
    from cembed.model import unpad

    model = _sliding_modernbert(tmp_path / "wide", tiny_model_dir, every=3, local=256, longest=256)
    monkeypatch.setattr(unpad, "PACK_MODES", ("block",))
    monkeypatch.setattr(unpad, "local_attention_reason", lambda config, max_seq_length: "")
    checked = resolve_unpad(model, "auto")
    assert not checked.enabled and "block mask: a packed row (162 tokens) differs" in checked.description


def test_a_stand_in_model_no_kind_claims_is_checked_as_a_dense_one(two_layer_model_dir):
    """A plain torch Sequential of a SentenceTransformer's modules (as tests build stand-ins): no registered
    kind's model class matches it, and the check compares its sentence embeddings."""
    model = SentenceTransformer(str(two_layer_model_dir), device="cpu")
    stand_in = torch.nn.Sequential(*model)
    stand_in.preprocess = model.preprocess
    unpadding = resolve_unpad(stand_in, "auto")
    assert unpadding.enabled and unpadding.mode == "position_ids", unpadding.description


def test_mode_obstacles_before_any_measurement():
    from types import SimpleNamespace as Config

    from cembed.model.unpad import mode_obstacle

    full, window = Config(), Config(sliding_window=4096)
    assert (
        mode_obstacle("block", full, "flash_attention_2", 512)
        == "flash_attention_2 attention takes no hand-built 4D mask"
    )
    assert mode_obstacle("block", window, "sdpa", 512) == ""  # rows up to 512 tokens: the window never binds
    assert mode_obstacle("block", window, "eager", 8192).startswith("it uses sliding-window attention")
    for mode in ("position_ids", "layer_masks"):
        assert mode_obstacle(mode, full, "flash_attention_2", 512) == (
            "flash_attention_2 reads packed rows from position_ids only as one flattened sequence (not done here)"
        )
        assert mode_obstacle(mode, full, "custom", 512) == (
            "its attention (custom) builds no packed masks (only sdpa, eager, flex_attention do)"
        )
    assert mode_obstacle("position_ids", window, "sdpa", 8192) == ""  # the library builds the window per row
    assert mode_obstacle("layer_masks", full, "sdpa", 512) is None  # no layer_types: the mode does not concern it
    assert mode_obstacle("layer_masks", Config(layer_types=["full_attention", "sliding_attention"]), "eager", 512) == ""
    mixed = Config(layer_types=["linear_attention", "full_attention", "chunked_attention", "linear_attention"])
    assert mode_obstacle("layer_masks", mixed, "sdpa", 512) == (
        "no packed mask for its layer types chunked_attention, linear_attention"
    )


@pytest.mark.parametrize("scale,leaky", [(1e3, False), (1e-3, True)], ids=["large", "small-and-leaky"])
def test_the_check_measures_a_relative_difference(two_layer_model_dir, monkeypatch, scale, leaky):
    """Rows scaled by 1,000 (a packed row off by float rounding only) still agree, and rows scaled by 1/1,000
    that leak (the faint leak, about 1e-4 relative) are still refused: the difference is relative to each
    row's own norm, however small."""
    from types import SimpleNamespace

    from cembed.model import unpad

    scaled = SimpleNamespace(text_outputs=lambda output: list(output["sentence_embedding"] * scale))
    monkeypatch.setattr(unpad, "kind_of", lambda model, default=None: scaled)
    monkeypatch.setattr(unpad, "PACK_MODES", ("block",))
    if leaky:
        monkeypatch.setattr(unpad, "_block_mask", _leaky_block_mask(False, 4.0))
    unpadding = resolve_unpad(SentenceTransformer(str(two_layer_model_dir), device="cpu"), "auto")
    assert unpadding.enabled is not leaky, unpadding.description
    if not leaky:
        assert (
            unpadding.description
            == "packed rows, no padding (sdpa attention, block-diagonal mask, position_ids per row)"
        )
        assert unpadding.mask == "bool"  # sdpa: True = attend


def test_a_half_precision_model_is_checked_at_the_half_tolerance(two_layer_model_dir):
    model = SentenceTransformer(str(two_layer_model_dir), device="cpu").to(torch.bfloat16)
    unpadding = resolve_unpad(model, "auto")
    assert unpadding.enabled, unpadding.description


class _Wrapped(torch.nn.Module):
    """A model held as DDP holds it (``module``) or torch.compile does (``_orig_mod``)."""

    def __init__(self, inner, attribute: str):
        super().__init__()
        self.attribute = attribute
        setattr(self, attribute, inner)
        self.preprocess = inner.preprocess

    def forward(self, features):
        return getattr(self, self.attribute)(features)


@pytest.mark.parametrize("attribute", ["module", "_orig_mod"])
def test_a_wrapped_model_is_judged_by_the_model_inside(two_layer_model_dir, attribute):
    wrapped = _Wrapped(SentenceTransformer(str(two_layer_model_dir), device="cpu"), attribute)
    unpadding = resolve_unpad(wrapped, "auto")
    assert unpadding.enabled and unpadding.mode == "position_ids", unpadding.description


def test_the_decisions_made_before_any_check():
    assert resolve_unpad(None, False) == Unpadding(
        False, "padded mini-batches (batch.unpad: false, or train.torch_compile: true)"
    )
    static = torch.nn.Sequential(torch.nn.Identity())
    padded = resolve_unpad(static, "auto")
    assert padded.enabled is False and padded.description == (
        "padded mini-batches, sorted by length (packing unsupported: its first module is Identity, not a "
        "transformers encoder)"
    )
    with pytest.raises(ModelRefused) as refused:
        resolve_unpad(static, True)
    assert str(refused.value) == (
        "batch.unpad: true, but this model cannot run packed rows: its first module is Identity, not a transformers "
        "encoder; set batch.unpad: auto (pads where packing is unsupported) or false"
    )


def test_eager_attention_gets_an_additive_block_mask(two_layer_model_dir, monkeypatch):
    from cembed.model import unpad

    model = SentenceTransformer(str(two_layer_model_dir), device="cpu", model_kwargs={"attn_implementation": "eager"})
    monkeypatch.setattr(unpad, "PACK_MODES", ("block",))
    unpadding = resolve_unpad(model, "auto")
    assert unpadding.enabled and unpadding.mask == "additive", unpadding.description


def test_a_window_wider_than_every_row_allows_the_block_mask(tiny_model_dir, tmp_path, monkeypatch):
    """ModernBERT with a 128-token window to each side and rows up to 64 tokens: no row reaches the window,
    so the hand-built block mask is allowed (and agrees)."""
    from cembed.model import unpad

    model = _sliding_modernbert(tmp_path / "short", tiny_model_dir, every=3, local=256, longest=64)
    monkeypatch.setattr(unpad, "PACK_MODES", ("block",))
    unpadding = resolve_unpad(model, "auto")
    assert unpadding.enabled and unpadding.mode == "block", unpadding.description


def test_nested_configs_are_each_walked_once():
    from types import SimpleNamespace as Config

    from cembed.model.unpad import widest_window

    text = Config(model_type="text", to_dict=dict, sliding_window=16)
    vision = Config(model_type="vision", to_dict=dict, sliding_window=300)
    # the text config reached twice before the vision one is: the walk goes on past the repeat
    assert widest_window(Config(vision_config=vision, text_config=text, decoder=text)) == 300
    # a value with to_dict but no model_type (a quantization config) is not a model's config
    assert widest_window(Config(sliding_window=16, quantization_config=Config(to_dict=dict, sliding_window=999))) == 16


def test_roberta_positions_start_after_the_padding_index(tiny_model_dir, tmp_path):
    """A RoBERTa model numbers positions from padding_idx + 1: the packed rows' offset (one layer, no weights
    compared)."""
    model, tokenizer = _tiny_roberta(tiny_model_dir, tmp_path / "hf")
    unpadding = resolve_unpad(model, "auto")
    assert unpadding.enabled and unpadding.position_offset == tokenizer.pad_token_id + 1, unpadding.description
