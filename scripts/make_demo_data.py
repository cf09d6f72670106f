#!/usr/bin/env python
"""Build the packaged COCO captions demo data in cembed/samples/coco_captions/ from the official
COCO 2017 val caption annotations (25,014 captions of 5,000 images; CC BY 4.0).

- 1,000 images are held out (a seeded choice among the images none of whose captions occurs, after
  normalisation, as a caption of any other image) as a caption-to-caption retrieval set in BEIR
  layout, ``heldout/``: for each held-out image its first caption (lowest caption id) is a query
  and its second caption is the query's one relevant document; the corpus is the 1,000 second
  captions (so each evaluation encodes 2,000 short texts: well under a minute on 2 CPU cores). The
  held-out images' other captions are used nowhere. No held-out text (lowercased, whitespace collapsed, final period dropped)
  occurs in the training rows; the script checks it.
- ``train_pairs.jsonl.gz``: the (anchor, positive) pairs of the other 4,000 images, built as the
  shared ``caption_pairs_val2017.jsonl.gz``: per image, captions sorted by caption id, every
  unordered pair (i < j) in that order, ``caption.strip()``, rows sorted by image id. The script
  checks the rows equal that file's rows of the same images when it is present.

Usage: python scripts/make_demo_data.py [--captions ../shared/data/coco_captions/captions_val2017.json.gz]
The output is deterministic (gzip without a timestamp).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "coco_captions"
OUT = REPO / "cembed" / "samples" / "coco_captions"
HELD_OUT_IMAGES = 1000
SEED = 11


def normalise(text: str) -> str:
    """The form in which two captions count as the same text."""
    return " ".join(text.lower().split()).rstrip(".").strip()


def write_gz(path: Path, lines: list[str]) -> None:
    """Write text lines gzip-compressed, byte-identical on every run (no name, mtime 0)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write("".join(lines).encode("utf-8"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--captions", default=str(SHARED / "captions_val2017.json.gz"))
    p.add_argument(
        "--pairs", default=str(SHARED / "caption_pairs_val2017.jsonl.gz"), help="checked against, if present"
    )
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    out = Path(args.out)

    with gzip.open(args.captions, "rt", encoding="utf-8") as f:
        annotations = json.load(f)["annotations"]
    by_image: dict[int, list[dict]] = defaultdict(list)
    for a in annotations:
        by_image[a["image_id"]].append(a)
    for caps in by_image.values():
        caps.sort(key=lambda a: a["id"])
    counts = Counter(normalise(a["caption"]) for a in annotations)
    eligible = sorted(i for i, caps in by_image.items() if all(counts[normalise(a["caption"])] == 1 for a in caps))
    held = set(random.Random(SEED).sample(eligible, HELD_OUT_IMAGES))
    train_images = sorted(set(by_image) - held)

    rows = []
    for image_id in train_images:
        caps = by_image[image_id]
        for i in range(len(caps)):
            for j in range(i + 1, len(caps)):
                rows.append(
                    {
                        "anchor": caps[i]["caption"].strip(),
                        "positive": caps[j]["caption"].strip(),
                        "image_id": image_id,
                        "anchor_caption_id": caps[i]["id"],
                        "positive_caption_id": caps[j]["id"],
                    }
                )
    train_texts = {normalise(t) for r in rows for t in (r["anchor"], r["positive"])}

    queries, corpus, qrels = [], [], []
    for image_id in sorted(held):
        first, second, *_ = by_image[image_id]
        queries.append({"_id": f"q{first['id']}", "text": first["caption"].strip()})
        corpus.append({"_id": f"d{second['id']}", "title": "", "text": second["caption"].strip()})
        qrels.append(f"q{first['id']}\td{second['id']}\t1\n")
    held_texts = [normalise(a["caption"]) for i in held for a in by_image[i]]
    assert not set(held_texts) & train_texts, "a held-out caption occurs in the training rows"
    assert len(set(held_texts)) == len(held_texts), "a held-out caption occurs twice"

    pairs_path = Path(args.pairs)
    if pairs_path.exists():
        keep = set(train_images)
        with gzip.open(pairs_path, "rt", encoding="utf-8") as f:
            reference = [r for r in map(json.loads, f) if r["image_id"] in keep]
        assert reference == rows, "pair construction differs from the shared caption_pairs_val2017.jsonl.gz"

    write_gz(out / "train_pairs.jsonl.gz", [json.dumps(r) + "\n" for r in rows])
    held_dir = out / "heldout"
    write_gz(held_dir / "corpus.jsonl.gz", [json.dumps(d) + "\n" for d in corpus])
    (held_dir / "qrels").mkdir(parents=True, exist_ok=True)
    (held_dir / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries), encoding="utf-8")
    (held_dir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(qrels), encoding="utf-8")
    print(
        f"train: {len(rows)} pairs of {len(train_images)} images; held out: {len(held)} images "
        f"({len(eligible)} eligible), {len(queries)} queries, {len(corpus)} documents, {len(qrels)} qrels -> {out}"
    )


if __name__ == "__main__":
    main()
