"""How many in-batch candidates the self-guided false-negative filter masks on real COCO caption pairs.

For each margin, the share of (anchor, candidate) scores that ``cached_mnrl`` with
``loss.false_negative_filter`` leaves out of the softmax (its own ``filter_counts``), on batches drawn
as training draws them (no-duplicates sampler), embedded by all-MiniLM-L6-v2 in eval mode. COCO has
five captions per image, so a batch holds other captions of an anchor's image: the script also says
how many of the masked candidates are captions of the anchor's own image (true false negatives) and
how many same-image candidates the batch holds.

    python scripts/false_negative_share.py --batch-size 1024 --batches 2 --margins 0 0.05 0.1
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

import torch

from cembed.config.loss import loss_config
from cembed.config.schema import ModelConfig
from cembed.losses.registry import build_loss
from cembed.model.load import load_model, quiet_libraries

SHARED = Path(__file__).resolve().parents[2] / "shared/data/coco_captions/caption_pairs_val2017.jsonl.gz"


def draw_batches(rows: list[dict], batch_size: int, batches: int, seed: int) -> list[list[dict]]:
    """Shuffled rows, first fit into batches with no text twice (as the no-duplicates sampler does)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    out, current, seen = [], [], set()
    for i in order:
        texts = {rows[i]["anchor"], rows[i]["positive"]}
        if texts & seen:
            continue
        current.append(rows[i])
        seen |= texts
        if len(current) == batch_size:
            out.append(current)
            if len(out) == batches:
                break
            current, seen = [], set()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=SHARED)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--margins", type=float, nargs="+", default=[0.0, 0.05, 0.1])
    parser.add_argument("--strategy", default="absolute", choices=["absolute", "relative"])
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    quiet_libraries()
    with gzip.open(args.data, "rt") as f:
        rows = [json.loads(line) for line in f]
    model = load_model(ModelConfig(max_seq_length=args.max_seq_length), "cpu").eval()
    results = {m: {"masked": 0, "candidates": 0, "masked_same_image": 0} for m in args.margins}
    same_image_candidates = 0
    for batch in draw_batches(rows, args.batch_size, args.batches, args.seed):
        with torch.no_grad():
            reps = [
                model.encode([r[c] for r in batch], convert_to_tensor=True, batch_size=128)
                for c in ("anchor", "positive")
            ]
        image = torch.tensor([r["image_id"] for r in batch])
        same = image.view(-1, 1) == image.view(1, -1)
        same.fill_diagonal_(False)
        same_image_candidates += int(same.sum())
        for margin in args.margins:
            cfg = loss_config(false_negative_filter={"margin": margin, "strategy": args.strategy})
            built = build_loss(model, cfg, 128, sort_by_length=False)
            with torch.no_grad():  # the loss stage alone, on the batch's embeddings (guide = own, detached)
                built.module.calculate_loss([[reps[0]], [reps[1]]], [[reps[0]], [reps[1]]])
            counts = built.filter_counts
            # the same rule written out, to see which candidates it caught
            sim = torch.nn.functional.normalize(reps[0], dim=-1) @ torch.nn.functional.normalize(reps[1], dim=-1).T
            pos = sim.diagonal().view(-1, 1)
            mask = sim > pos - (margin if args.strategy == "absolute" else pos.abs() * margin)
            mask.fill_diagonal_(False)
            assert int(mask.sum()) == counts.masked, (int(mask.sum()), counts.masked)
            r = results[margin]
            r["masked"] += counts.masked
            r["candidates"] += counts.candidates
            r["masked_same_image"] += int((mask & same).sum())
    print(
        f"COCO caption pairs, batch {args.batch_size} x {args.batches}, all-MiniLM-L6-v2 (eval mode), "
        f"strategy {args.strategy}; same-image candidates in the batches: {same_image_candidates}"
    )
    print("margin | masked share | masked candidates | of them same image | same-image candidates caught")
    for margin, r in results.items():
        share = r["masked"] / r["candidates"]
        of_same = r["masked_same_image"] / max(r["masked"], 1)
        caught = r["masked_same_image"] / max(same_image_candidates, 1)
        print(f"{margin:g} | {share:.4%} | {r['masked']} | {of_same:.1%} | {caught:.1%}")


if __name__ == "__main__":
    main()
