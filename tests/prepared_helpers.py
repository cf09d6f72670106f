"""Build a prepared source the way an engine other than cembed would (issue 24 item 4): tokenize
rows with the model's tokenizer (special tokens, truncation at max_seq_length), write Arrow stream
parts with ``pyarrow.ipc.new_stream`` (no hash columns), then the manifest with ``write_manifest``."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from cembed.data.tokens.format import SAMPLE_ROWS, PreparedManifest, PreparedPart, write_manifest
from cembed.model.fingerprint import tokenizer_fingerprint


def pair_rows(n: int) -> list[dict]:
    """Pairs whose positives repeat in a third of the rows (each twice: the sampler defers rows) and long texts (truncated at 64)."""
    rows = []
    for i in range(n):
        long = " and a red car on the street" * (12 if i % 7 == 0 else 0)
        positive = f"answer {i % 20} on the street" if i % 3 == 0 else f"answer text {i} with a dog{long}"
        rows.append({"anchor": f"question {i} about a {'red ' * (i % 4)}car", "positive": positive})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_prepared(
    folder: Path, rows: list[dict], tokenizer, max_seq_length: int, split: int | None = None, columns=None
) -> PreparedManifest:
    """``rows`` tokenized by ``tokenizer`` into ``folder`` as two parts (rows ``[:split]`` and
    ``[split:]``), each role's ids in ``<role>_input_ids`` (list<int32>), then the manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    columns = columns or ["anchor", "positive"]
    split = len(rows) // 2 if split is None else split
    parts = []
    for k, chunk in enumerate((rows[:split], rows[split:])):
        arrays = {}
        for role in columns:
            ids = tokenizer(
                [r[role] for r in chunk], truncation=True, max_length=max_seq_length, add_special_tokens=True
            )["input_ids"]
            arrays[role + "_input_ids"] = pa.array(ids, type=pa.list_(pa.int32()))
        table = pa.table(arrays)
        name = f"part-{k:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=7)  # several record batches per part
        parts.append(PreparedPart(name, len(chunk), (folder / name).stat().st_size))
    manifest = PreparedManifest(
        columns=list(columns),
        tokenizer=tokenizer_fingerprint(tokenizer),
        max_seq_length=max_seq_length,
        rows=len(rows),
        parts=parts,
        samples={c: [r[c] for r in rows[:SAMPLE_ROWS]] for c in columns},
        model="tiny",
        source="pairs.jsonl",
    )
    write_manifest(folder, manifest)
    return manifest
