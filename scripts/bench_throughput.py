#!/usr/bin/env python
"""Throughput benchmark: sentence-transformers' stock path vs cembed, side by side in one process.

Stock path: ``SentenceTransformerDataCollator`` (tokenizes every batch), ``NoDuplicatesBatchSampler``
and ``CachedMultipleNegativesRankingLoss``. cembed: pre-tokenized ids + ``PaddingCollator``,
``NoDuplicatesSampler`` and ``LengthSortedCachedMNRL``. Every section runs both on the same model,
data and batch, alternating, for several rounds, and prints medians and ratios.

Sections (``--sections``, default all):
  step      all-MiniLM-L6-v2 training step (forward + backward) at batch 1024, mini-batch 32, on
            seeded skewed-length data and on the real COCO caption pairs: stock, cembed padded
            (sorted), cembed packed (batch.unpad) and packed with token-budget mini-batches of the
            same worst-case memory, and stock with its own token budget (``mini_batch_num_tokens``,
            the same value), against a padding-free estimate (stock time scaled by its real share of
            positions; not a bound); padded share of the positions each path ran on, and the losses
            (must agree to 1e-5 relative: the script exits 1 after its tables when one does not).
            Then (``--models``, default minilm,decoder,decoder-lora) a small random Qwen2 decoder
            (hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 512, MiniLM's WordPiece tokenizer,
            last-token pooling as cembed loads decoders) at batch 256 (``--decoder-batch``), plain and
            under LoRA (r 8 on q/k/v/o), on the skewed data: stock, cembed padded, cembed packed and
            the padding-free estimate. ``--models decoder,decoder-lora`` runs the decoder rows only.
  produce   producing one batch (fetch + collate) at batch 4096, 16384 and 65536 (max_seq_length
            256): stock (tokenizing collator), cembed's row path before issue 14 (``datasets``' row
            fetch + per-row padding) and its batch path (``TokenIdRows`` + numpy padding), on the same
            index lists.
  datawait  share of wall time a training run waits for data with a 1-layer, hidden-32 model at
            batch 16384 (a model whose step is faster than stock batch production): stock, the row
            path, the batch path without workers, and the default (``dataloader_num_workers: auto``
            as resolved on this machine); the whole run and steps 2+ (the first batch is always waited for).
  sampler   one epoch of the sampler over 1M rows at batch 65536.

Usage: ``python scripts/bench_throughput.py [--rounds 3] [--sections step,produce,datawait,sampler]
[--models minilm,decoder,decoder-lora]``
(``--quick`` shrinks every size for a smoke run).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COCO = REPO.parent / "shared" / "data" / "coco_captions" / "caption_pairs_val2017.jsonl.gz"
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so what can more about model data protein cell "
    "patients study results method analysis system network learning training retrieval embedding query document"
).split()


def skewed_pairs(n: int, seed: int = 0) -> dict[str, list[str]]:
    """Seeded (anchor, positive) pairs with realistic, skewed lengths: short queries (lognormal,
    median ~8 words) and long-tailed passages (lognormal, median ~40 words, up to ~400)."""
    rng = np.random.default_rng(seed)
    vocab = np.array(WORDS)

    def texts(median: float, sigma: float, cap: int, tag: str) -> list[str]:
        lengths = np.clip(rng.lognormal(np.log(median), sigma, n).astype(int), 1, cap)
        return [f"{tag}{i} " + " ".join(rng.choice(vocab, size=k)) for i, k in enumerate(lengths)]

    return {"anchor": texts(8, 0.6, 64, "q"), "positive": texts(40, 0.9, 400, "d")}


def coco_pairs(n: int) -> dict[str, list[str]]:
    rows = {"anchor": [], "positive": []}
    with gzip.open(COCO, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rows["anchor"].append(r["anchor"])
            rows["positive"].append(r["positive"])
            if len(rows["anchor"]) >= n:
                break
    return rows


def median(xs):
    return statistics.median(xs)


def load_minilm():
    from sentence_transformers import SentenceTransformer

    from cembed.model.load import resolve_model_path

    model = SentenceTransformer(resolve_model_path("all-MiniLM-L6-v2"), device="cpu")
    model.max_seq_length = 256
    return model


def tiny_model(tmp: Path):
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_tiny_model
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(make_tiny_model(tmp / "tiny", hidden=32, layers=1)), device="cpu")


def prepare_paths(model, data: dict[str, list[str]], cache: Path):
    """The two datasets and collators: stock (texts, tokenizing collator) and cembed (pre-tokenized)."""
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

    from cembed.data.tokens.collator import collator_for
    from cembed.data.tokens.tokenize import pretokenize

    ds = Dataset.from_dict(data)
    started = time.perf_counter()
    pt = pretokenize(ds, ["anchor", "positive"], model.tokenizer, model.max_seq_length, cache)
    tok_s = time.perf_counter() - started
    return (
        ds,
        SentenceTransformerDataCollator(preprocess_fn=model.preprocess),
        pt.dataset,
        collator_for(model, ["anchor", "positive"]),
        tok_s,
    )


def features_of(batch: dict) -> list[dict]:
    out = {}
    for key, value in batch.items():
        role, _, name = key.partition("_")
        out.setdefault(role, {})[name] = value
    return list(out.values())


def stock_positions(features, mbs: int, num_tokens: int | None = None) -> tuple[int, int]:
    """``(real, processed)`` token positions of stock ``CachedMultipleNegativesRankingLoss``'s
    mini-batches over ``features``: its own ranges (``mbs`` rows, or ``num_tokens`` real tokens when
    given), each padded to its longest row (it trims the padding a whole mini-batch shares)."""
    from sentence_transformers.base.losses.gradcache import _minibatch_ranges

    real = processed = 0
    for f in features:
        lengths = f["attention_mask"].sum(1)
        for begin, end in _minibatch_ranges(f, mbs, num_tokens):
            real += int(lengths[begin:end].sum())
            processed += (end - begin) * int(lengths[begin:end].max())
    return real, processed


# The step section's paths, by name: each a loss over the model. ``+tokens``: mini-batches cut by a
# token budget instead of a row count.
ALL_STEP_PATHS = ("stock", "stock+tokens", "cembed padded", "cembed packed", "cembed packed+tokens")
# The decoder rows run the three paths the targets are stated for (issue 34), to stay within minutes.
DECODER_STEP_PATHS = ("stock", "cembed padded", "cembed packed")
LOSS_TOLERANCE = 1e-5  # every path computes the same loss (dropout off): relative to stock's
STEP_MODELS = ("minilm", "decoder", "decoder-lora")
# The decoder of the step section: Qwen2-style (grouped-query attention, rotary positions), small
# enough for CPU, with last-token pooling as cembed builds decoders (cembed/model/load.py).
DECODER_SIZE = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 512}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# The decoder's tokenizer keeps MiniLM's WordPiece class; it has no EOS token, so its own last token
# ([SEP]) is the one pooled (cembed/model/decoder.py), one special token at the end as EOS would be.
DECODER_TOKENIZER = {"tokenizer_type": "bert"}


def decoder_checkpoint(
    folder: Path, tokenizer_dir: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int
) -> Path:
    """Save a seeded random ``Qwen2Model`` of these sizes at ``folder`` (a plain transformers checkpoint,
    as cembed loads a decoder) with the tokenizer of ``tokenizer_dir``: all-MiniLM-L6-v2's, so the
    skewed texts get the lengths they have in the MiniLM rows (its vocabulary sizes the embedding).
    Loaded as BERT's WordPiece class (:data:`DECODER_TOKENIZER`): beside a Qwen2 config transformers 5
    loads a tokenizer as Qwen2's byte-level class, which splits these texts into single characters
    (most positives then fill all 256 positions and stock pads 46 % of them instead of 70 %)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model

    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
    )
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, **DECODER_TOKENIZER)
    config.vocab_size, config.pad_token_id = len(tokenizer), tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2Model(config).save_pretrained(folder)
    return folder


def load_decoder(folder: Path, lora: bool, max_seq_length: int = 256):
    """The checkpoint at ``folder`` loaded by cembed as it loads any decoder (``model.pooling:
    lasttoken``: Transformer + last-token Pooling, the tokenizer set up for it), under LoRA (r 8 on
    q/k/v/o, peft's initialisation: B = 0) when ``lora``."""
    from cembed.config.schema import LoraOptions, ModelConfig
    from cembed.model.load import load_model

    options = LoraOptions(r=8, alpha=16, dropout=0.0, target_modules=LORA_TARGETS) if lora else None
    cfg = ModelConfig(
        name_or_path=str(folder),
        device="cpu",
        pooling="lasttoken",
        max_seq_length=max_seq_length,
        lora=options,
        tokenizer_kwargs=DECODER_TOKENIZER,
    )
    return load_model(cfg, "cpu")


def step_losses(model, names, mbs: int, budget: int) -> list[tuple[str, object]]:
    """``(name, loss)`` for each path in ``names`` (of ``ALL_STEP_PATHS``) over ``model``."""
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from cembed.losses.mnrl import LengthSortedCachedMNRL

    make = {
        "stock": lambda: CachedMultipleNegativesRankingLoss(model, mini_batch_size=mbs),
        "stock+tokens": lambda: CachedMultipleNegativesRankingLoss(
            model, mini_batch_size=mbs, mini_batch_num_tokens=budget
        ),
        "cembed padded": lambda: LengthSortedCachedMNRL(model, mini_batch_size=mbs, unpad=False),
        "cembed packed": lambda: LengthSortedCachedMNRL(model, mini_batch_size=mbs, unpad=True),
        "cembed packed+tokens": lambda: LengthSortedCachedMNRL(
            model, mini_batch_size=mbs, mini_batch_num_tokens=budget, unpad=True
        ),
    }
    return [(name, make[name]()) for name in names]


def time_paths(model, paths, stock_feats, our_feats, rounds: int) -> tuple[dict, dict, dict]:
    """Run each path's loss forward + backward ``rounds`` times, alternating the order each round.

    Returns:
        ``(times, losses, padding)``: per path its step seconds (a list), its loss, and (cembed's
        paths, which count their tokens) the padded share of the positions it ran on.
    """
    times = {label: [] for label, _ in paths}
    losses, padding = {}, {}
    for r in range(rounds):
        for label, loss_fn in paths[:: 1 if r % 2 == 0 else -1]:
            feats = stock_feats if label.startswith("stock") else our_feats
            model.zero_grad(set_to_none=True)
            counts = getattr(loss_fn, "token_counts", None)
            if counts is not None:
                counts.reset()
            t0 = time.perf_counter()
            value = loss_fn([dict(f) for f in feats], None)
            value.backward()
            times[label].append(time.perf_counter() - t0)
            losses[label] = float(value.detach())
            if counts is not None:
                real, processed, _ = counts.read()
                padding[label] = 1 - real / processed
    return times, losses, padding


def step_rows(model, name: str, data: dict, paths, mbs: int, budget: int, rounds: int, cache: Path) -> list[str]:
    """Time ``paths`` (``step_losses``) on one batch of ``data`` and print a table row per path and
    the padding-free estimate's.

    Returns:
        One line per path whose loss is not within ``LOSS_TOLERANCE`` of stock's (empty: all agree).
    """
    bs = len(data["anchor"])
    _, stock_coll, pt_ds, our_coll, _ = prepare_paths(model, data, cache)
    stock_feats = features_of(
        stock_coll([{"anchor": a, "positive": p} for a, p in zip(data["anchor"], data["positive"])])
    )
    our_feats = features_of(our_coll(pt_ds.select(range(bs)).to_list()))
    times, losses, padding = time_paths(model, paths, stock_feats, our_feats, rounds)
    s_real, s_proc = stock_positions(stock_feats, mbs)
    padding["stock"] = 1 - s_real / s_proc
    t_real, t_proc = stock_positions(stock_feats, mbs, budget)
    padding["stock+tokens"] = 1 - t_real / t_proc
    ts = median(times["stock"])
    estimate = ts * s_real / s_proc  # stock time scaled to zero padding: an estimate (see the legend)
    disagree = []
    for label, _ in paths:
        t = median(times[label])
        rel = abs(losses[label] - losses["stock"]) / abs(losses["stock"])
        if not rel <= LOSS_TOLERANCE:
            disagree.append(f"{name}, {label}: loss {losses[label]:.6f} vs stock {losses['stock']:.6f} ({rel:.1e})")
        print(
            f"| {name} | {label} | {t:.2f} | {ts / t:.2f}x | {100 * padding[label]:.1f}% | {t / estimate:.2f}x | "
            f"{losses[label]:.6f} | {rel:.1e} |"
        )
    print(f"| {name} | padding-free estimate | {estimate:.2f} | {ts / estimate:.2f}x | 0.0% | 1.00x | | |")
    return disagree


def step_legend(mbs: int, budget: int) -> str:
    return (
        "stock = sentence-transformers' CachedMultipleNegativesRankingLoss (its tokenizing collator), mini-batches of "
        f"{mbs} rows; stock+tokens = the same with its own mini_batch_num_tokens = {budget} real tokens (each "
        "mini-batch still padded to its longest row, unsorted). cembed paths: padded = length-sorted "
        "mini-batches padded to their longest row (batch.unpad: false); packed = rows packed without padding "
        f"(batch.unpad: auto); packed+tokens = packed, mini-batches of <= {budget} real tokens "
        f"(mini_batch_num_tokens = {mbs} x max_seq_length: the same worst-case memory as {mbs} full rows). "
        "padding = share of the positions the encoder ran on that were padding; padding-free estimate = "
        "stock time x its real / processed positions (an estimate, not a bound: attention's cost grows "
        "with width and per-mini-batch overheads stay, so a path can beat it or fall short of it); "
        f"x est. = path time / estimate; rel. diff = |loss - stock's| / stock's (must be <= {LOSS_TOLERANCE:.0e}: "
        "dropout is off, every path computes the same loss)."
    )


def step_models(args, tmp: Path):
    """``(key, title, model, paths, batch, datasets)`` of each model of ``args.models``, built when
    its turn comes (one model in memory at a time)."""
    keys = args.models.split(",")
    unknown = sorted(set(keys) - set(STEP_MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)} (choose from {', '.join(STEP_MODELS)})")
    for key in keys:
        if key == "minilm":
            datasets_ = [("skewed (seeded)", skewed_pairs(args.step_batch, seed=1))]
            if COCO.exists():
                datasets_.append(("COCO pairs", coco_pairs(args.step_batch)))
            yield key, "all-MiniLM-L6-v2", load_minilm(), ALL_STEP_PATHS, args.step_batch, datasets_
            continue
        folder = tmp / "decoder"
        if not folder.exists():
            from cembed.model.load import resolve_model_path

            decoder_checkpoint(folder, resolve_model_path("all-MiniLM-L6-v2"), **DECODER_SIZE)
        lora = key == "decoder-lora"
        size = ", ".join(f"{k} {v}" for k, v in DECODER_SIZE.items())
        title = f"random Qwen2 decoder ({size}; MiniLM's WordPiece tokenizer; last-token pooling){' + LoRA r 8 on q/k/v/o' if lora else ''}"
        datasets_ = [("skewed (seeded)", skewed_pairs(args.decoder_batch, seed=1))]
        yield key, title, load_decoder(folder, lora), DECODER_STEP_PATHS, args.decoder_batch, datasets_


def section_step(args, cache: Path, tmp: Path) -> list[str]:
    """Returns the lines of any path whose loss disagreed with stock's (``step_rows``)."""
    mbs = 32
    budget = mbs * 256  # the same worst-case memory as mbs rows at max_seq_length 256
    print(
        f"\n## step: training step (forward + backward), mini-batch {mbs}, max_seq_length 256, {args.rounds} rounds "
        f"(CPU, {torch.get_num_threads()} threads)"
    )
    print(step_legend(mbs, budget))
    disagree = []
    for _, title, model, names, bs, datasets_ in step_models(args, tmp):
        model.eval()  # dropout off, so every path must give the same loss; gradients still flow
        paths = step_losses(model, names, mbs, budget)
        print(f"\n### {title}, batch {bs}")
        print("| data | path | step s | speed-up vs stock | padding | x est. | loss | rel. diff |")
        print("|---|---|---|---|---|---|---|---|")
        for name, data in datasets_:
            disagree += step_rows(model, name, data, paths, mbs, budget, args.rounds, cache)
        del model, paths
    print(f"\nlosses within {LOSS_TOLERANCE:.0e} of stock's: {'all' if not disagree else 'NO'}")
    for line in disagree:
        print(f"  {line}")
    return disagree


class RowPaddingCollator:
    """cembed's collator before issue 14, for the side-by-side numbers: pads the row dicts that
    ``datasets``' ``__getitems__`` builds, flattening each row's ids in Python. Not a
    ``PaddingCollator``, so the trainer keeps the row fetch for it."""

    def __init__(self, collator) -> None:
        self.c = collator
        self.valid_label_columns = []

    def pad(self, seqs):
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        width = int(lengths.max()) if len(seqs) else 0
        mask = np.arange(width)[None, :] < lengths[:, None]
        ids = np.full((len(seqs), width), self.c.pad_token_id, dtype=np.int64)
        ids[mask] = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lengths.sum()))
        return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))

    def __call__(self, rows):
        batch = {}
        for role in self.c.roles:
            ids, mask = self.pad([r[role + "_input_ids"] for r in rows])
            batch[f"{role}_input_ids"] = ids
            if self.c.token_type_ids:
                batch[f"{role}_token_type_ids"] = torch.zeros_like(ids)
            batch[f"{role}_attention_mask"] = mask
            for key, value in self.c.constants.items():
                batch[f"{role}_{key}"] = value
        return batch


def timed(fetch, collate, idx) -> tuple[float, float, dict]:
    t0 = time.perf_counter()
    rows = fetch(idx)
    t1 = time.perf_counter()
    batch = collate(rows)
    return t1 - t0, time.perf_counter() - t1, batch


def section_produce(args, cache: Path) -> None:
    from cembed.data.tokens.collator import TokenIdRows

    model = load_minilm()
    sizes = [int(s) for s in args.produce_batches.split(",")]
    n = max(sizes) + max(sizes) // 16
    data = skewed_pairs(n, seed=2)
    ds, stock_coll, pt_ds, our_coll, tok_s = prepare_paths(model, data, cache)
    rows_path, batch_path = RowPaddingCollator(our_coll), TokenIdRows(pt_ds, our_coll.roles)
    print(
        f"\n## produce: one batch = fetch + collate, skewed data, {n} rows, all-MiniLM-L6-v2 tokenizer, "
        f"max_seq_length {model.max_seq_length}, median of {args.rounds} random batches, {os.cpu_count()} CPUs"
    )
    print(f"(one-off pre-tokenization of the {n} rows: {tok_s:.1f} s, cached for later runs)")
    print(
        "| batch | width | stock s (tokenize) | row path s (fetch + pad) | batch path s (fetch + pad) | "
        "batch vs row | batch vs stock | same tensors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(5)
    batch_path.__getitems__([0])  # open the table's views once (each worker does it once too)
    for bs in sizes:
        res = {"stock": [], "row": [], "batch": []}
        same = True
        for r in range(args.rounds):
            idx = rng.choice(n, size=bs, replace=False).tolist()
            if bs <= args.stock_max:
                f, c, _ = timed(ds.__getitems__, stock_coll, idx)
                res["stock"].append((f, c))
            f, c, ref = timed(pt_ds.__getitems__, rows_path, idx)
            res["row"].append((f, c))
            del ref  # the two batches of 65536 rows would not both fit well in a small machine's memory
            f, c, ours = timed(batch_path.__getitems__, our_coll, idx)
            res["batch"].append((f, c))
            if r == 0:
                ref = rows_path(pt_ds.__getitems__(idx[:4096]))
                same = all(
                    torch.equal(ref[k], ours[k][:4096, : ref[k].shape[1]])
                    for k in ref
                    if isinstance(ref[k], torch.Tensor)
                ) and all(ours[k][:4096, ref[k].shape[1] :].eq(0).all() for k in ref if k.endswith("attention_mask"))
            width = ours["positive_input_ids"].shape[1]
            del ours

        def cell(key):
            if not res[key]:
                return "-", float("nan")
            tot = median([f + c for f, c in res[key]])
            return f"{tot:.3f} ({median([f for f, _ in res[key]]):.3f} + {median([c for _, c in res[key]]):.3f})", tot

        (st, ts), (rt, tr), (bt, tb) = cell("stock"), cell("row"), cell("batch")
        vs_stock = f"{ts / tb:.1f}x" if res["stock"] else "-"
        print(f"| {bs} | {width} | {st} | {rt} | {bt} | {tr / tb:.1f}x | {vs_stock} | {same} |")


def section_datawait(args, cache: Path, tmp: Path) -> None:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
    from transformers.trainer_callback import PrinterCallback

    from cembed.data.batching.full_table import NoDuplicatesSampler
    from cembed.data.tokens.collator import collator_for
    from cembed.data.tokens.tokenize import pretokenize
    from cembed.losses.counts import TokenCounts
    from cembed.losses.mnrl import LengthSortedCachedMNRL
    from cembed.plan.resolve import resolve_workers
    from cembed.train.meter import ThroughputMeter
    from cembed.train.trainer import CembedTrainer

    model = tiny_model(tmp)
    # Short sequences keep this model's CPU step below stock batch production, as a fast GPU's is.
    model.max_seq_length = args.wait_seq
    bs, steps = args.wait_batch, args.wait_steps
    data = skewed_pairs(bs * steps + 7, seed=3)
    ds = Dataset.from_dict(data)
    pt = pretokenize(ds, ["anchor", "positive"], model.tokenizer, model.max_seq_length, cache).dataset
    auto, how, warning = resolve_workers("auto", bs, 2, model.max_seq_length)
    print(
        f"\n## datawait: 1-layer hidden-32 BERT, max_seq_length {args.wait_seq}, batch {bs}, mini-batch {bs}, {steps} steps, CPU"
    )
    print(f"(default train.dataloader_num_workers: {how}{'; ' + warning if warning else ''})")
    print("| path | workers | data-wait share | data-wait steps 2+ | wall s | s/step |")
    print("|---|---|---|---|---|---|")
    collator = collator_for(model, ["anchor", "positive"])
    runs = {
        "stock": ("stock", 0, ds, None, BatchSamplers.NO_DUPLICATES),
        "row": ("cembed row path (before)", 0, pt, RowPaddingCollator(collator), NoDuplicatesSampler),
        "batch": ("cembed batch path", 0, pt, collator, NoDuplicatesSampler),
        "auto": ("cembed default (auto)", auto, pt, collator, NoDuplicatesSampler),
    }
    for label, workers, dataset, coll, sampler in (runs[k] for k in args.wait_paths.split(",")):
        stock = label == "stock"
        loss = (CachedMultipleNegativesRankingLoss if stock else LengthSortedCachedMNRL)(model, mini_batch_size=bs)
        targs = SentenceTransformerTrainingArguments(
            output_dir=str(tmp / f"dw-{len(label)}-{workers}"),
            per_device_train_batch_size=bs,
            max_steps=steps,
            batch_sampler=sampler,
            dataloader_drop_last=True,
            dataloader_num_workers=workers,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
            use_cpu=True,
            logging_steps=steps,
            learning_rate=1e-4,
        )
        meter = ThroughputMeter(getattr(loss, "token_counts", TokenCounts()))
        trainer = CembedTrainer(
            model=model, args=targs, train_dataset=dataset, loss=loss, data_collator=coll, meter=meter
        )
        trainer.remove_callback(PrinterCallback)
        waits = []  # (seconds, when it ended) per wait
        record = meter.waited
        meter.waited = lambda seconds: waits.append((seconds, time.perf_counter())) or record(seconds)
        trainer.meter.start()
        t0 = time.perf_counter()
        trainer.train()
        end = time.perf_counter()
        wall = end - t0
        steady = sum(w for w, _ in waits[1:]) / max(end - waits[0][1], 1e-9) if waits else float("nan")
        print(
            f"| {label} | {workers} | {100 * trainer.meter.totals()['data_wait']:.1f}% | {100 * steady:.1f}% | "
            f"{wall:.1f} | {wall / steps:.2f} |"
        )


def section_sampler(args) -> None:
    from datasets import Dataset
    from sentence_transformers.base.sampler import NoDuplicatesBatchSampler

    from cembed.data.batching.full_table import NoDuplicatesSampler

    n, bs = args.sampler_rows, args.sampler_batch
    rng = np.random.default_rng(4)
    # ~2% of anchors repeat another row's text, like real query logs.
    anchors = [f"query {i}" for i in rng.integers(0, int(n * 0.98), n)]
    ds = Dataset.from_dict({"anchor": anchors, "positive": [f"passage {i}" for i in range(n)]})
    print(f"\n## sampler: one epoch over {n} rows at batch {bs}")
    print("| sampler | construct s | epoch s | batches |")
    print("|---|---|---|---|")
    for label, make in (
        ("stock NoDuplicatesBatchSampler", lambda: NoDuplicatesBatchSampler(ds, batch_size=bs, drop_last=True, seed=0)),
        (
            "stock NoDuplicatesBatchSampler (precompute_hashes)",
            lambda: NoDuplicatesBatchSampler(
                ds, batch_size=bs, drop_last=True, seed=0, precompute_hashes=True, precompute_num_proc=1
            ),
        ),
        ("cembed NoDuplicatesSampler", lambda: NoDuplicatesSampler(ds, batch_size=bs, drop_last=True, seed=0)),
    ):
        t0 = time.perf_counter()
        sampler = make()
        t1 = time.perf_counter()
        batches = sum(1 for _ in sampler)
        t2 = time.perf_counter()
        print(f"| {label} | {t1 - t0:.2f} | {t2 - t1:.2f} | {batches} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sections", default="step,produce,datawait,sampler")
    p.add_argument("--step-batch", type=int, default=1024, help="the MiniLM step rows' batch")
    p.add_argument("--models", default=",".join(STEP_MODELS), help="step rows: " + ",".join(STEP_MODELS))
    p.add_argument("--decoder-batch", type=int, default=256, help="the decoder step rows' batch")
    p.add_argument("--produce-batches", default="4096,16384,65536")
    p.add_argument("--stock-max", type=int, default=16384, help="largest batch the stock path is timed at")
    p.add_argument("--wait-batch", type=int, default=16384)
    p.add_argument("--wait-steps", type=int, default=6)
    p.add_argument("--wait-seq", type=int, default=32)
    p.add_argument("--wait-paths", default="stock,row,batch,auto", help="datawait runs: stock,row,batch,auto")
    p.add_argument("--sampler-rows", type=int, default=1_000_000)
    p.add_argument("--sampler-batch", type=int, default=65536)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    p.add_argument("--cache-dir", default=None, help="keep pre-tokenized data here between runs (default: a temp dir)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.step_batch, args.decoder_batch, args.produce_batches = 1, 64, 64, "256"
        args.wait_batch, args.wait_steps, args.sampler_rows, args.sampler_batch = 256, 2, 20_000, 1024
    import transformers

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = Path(args.cache_dir) if args.cache_dir else tmp / "cache"
        sections = args.sections.split(",")
        disagree = section_step(args, cache, tmp) if "step" in sections else []
        if "produce" in sections:
            section_produce(args, cache)
        if "datawait" in sections:
            section_datawait(args, cache, tmp)
        if "sampler" in sections:
            section_sampler(args)
    if disagree:
        raise SystemExit(f"{len(disagree)} step path(s) computed another loss than stock (listed above)")


if __name__ == "__main__":
    main()
