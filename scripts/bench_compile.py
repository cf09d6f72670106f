#!/usr/bin/env python
"""``train.torch_compile`` measured: cembed's cached-loss training step (forward without grad,
loss, replayed forward + backward) on all-MiniLM-L6-v2, eager vs ``torch.compile``'d model (what the
trainer's ``torch_compile`` does: inductor over the whole model), on real COCO caption pairs.

Prints the one-off compile time (first step) and the median of the later steps for both, with
padded mini-batches (``batch.unpad: false``; widths padded to a multiple of ``--pad-multiple``, what
``batch.pad_to_multiple_of`` does, which bounds the shapes the compiled graph sees) and with packed
rows (``batch.unpad: auto``, the default; the packs' widths vary per mini-batch).

Usage: ``python scripts/bench_compile.py [--batch 256] [--mini 64] [--seq 64] [--steps 6]``
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COCO = REPO.parent / "shared" / "data" / "coco_captions" / "caption_pairs_val2017.jsonl.gz"


def batches(model, n_batches: int, batch: int, pad_multiple: int):
    """``n_batches`` disjoint batches of COCO pairs as cembed's padding collator builds them."""
    from datasets import Dataset

    from cembed.data.tokens.collator import collator_for
    from cembed.data.tokens.tokenize import pretokenize

    path = COCO if COCO.is_file() else REPO / "cembed" / "samples" / "coco_captions" / "train_pairs.jsonl.gz"
    rows = {"anchor": [], "positive": []}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line, _ in zip(f, range(n_batches * batch)):
            r = json.loads(line)
            rows["anchor"].append(r["anchor"])
            rows["positive"].append(r["positive"])
    ds = pretokenize(Dataset.from_dict(rows), ["anchor", "positive"], model.tokenizer, model.max_seq_length).dataset
    collate = collator_for(model, ["anchor", "positive"])
    out = []
    for b in range(n_batches):
        flat = collate(ds.select(range(b * batch, (b + 1) * batch)).to_list())
        feats = {}
        for key, value in flat.items():
            role, _, name = key.partition("_")
            feats.setdefault(role, {})[name] = value
        for f in feats.values():  # pad the width up to a multiple, as batch.pad_to_multiple_of does
            width = f["input_ids"].shape[1]
            extra = -width % pad_multiple
            for k in f:
                if torch.is_tensor(f[k]) and f[k].dim() == 2:
                    f[k] = torch.nn.functional.pad(f[k], (0, extra))
        out.append(list(feats.values()))
    return out


def run(compiled: bool, unpad: bool, args) -> dict:
    from sentence_transformers.base.trainer import BaseTrainer  # noqa: F401  (import cost outside timing)

    from cembed.config.loss import loss_config
    from cembed.config.schema import ModelConfig
    from cembed.losses.registry import build_loss
    from cembed.model.load import load_model

    torch.manual_seed(0)
    model = load_model(ModelConfig(max_seq_length=args.seq, device="cpu"), "cpu")
    data = batches(model, args.steps, args.batch, args.pad_multiple)
    loss = build_loss(model, loss_config(), args.mini, unpad=unpad).module
    if compiled:
        # As the trainer does with torch_compile=True: the loss gets the compiled wrapper.
        loss.model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    # Train mode for every submodule, as the trainer sets it each step: a freshly loaded model's
    # transformers submodules are left in eval mode (dropout off) while the top module says train.
    model.train()
    times, values = [], []
    for feats in data:
        t0 = time.perf_counter()
        value = loss(feats, None)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        values.append(round(float(value.detach()), 5))
    # Dropout replay as the cached loss does it (RandContext): the embedding of a mini-batch without
    # gradients, then replayed with gradients, must be bit-identical (model in train mode, dropout 0.1).
    from sentence_transformers.base.losses.gradcache import RandContext

    encoder = loss.model
    model.train()
    f = {k: v[: args.mini] if torch.is_tensor(v) else v for k, v in data[0][0].items()}
    rng = RandContext(*f.values())
    with torch.no_grad():
        first = encoder(f)["sentence_embedding"]
    with rng:
        replayed = encoder(f)["sentence_embedding"]
    return {
        "first_step_s": round(times[0], 2),
        "later_median_s": round(statistics.median(times[1:]), 3),
        "losses": values,
        "replay_max_abs_diff": float((first - replayed.detach()).abs().max()),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--mini", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pad-multiple", type=int, default=16)
    args = p.parse_args()
    print(
        f"all-MiniLM-L6-v2, batch {args.batch}, mini-batch {args.mini}, max_seq_length {args.seq}, widths padded to x{args.pad_multiple}, {args.steps} steps, CPU {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    for unpad in (False, True):  # padded mini-batches (batch.unpad: false), packed rows (the default)
        for compiled in (False, True):
            r = run(compiled, unpad, args)
            print(
                f"{'packed' if unpad else 'padded'} {'compiled' if compiled else 'eager   '}: first step {r['first_step_s']} s, later steps median {r['later_median_s']} s, losses {r['losses']}, dropout replay max |diff| {r['replay_max_abs_diff']}"
            )


if __name__ == "__main__":
    main()
