"""``rows_digest``: a table's rows by value, whatever the storage (issue 39 item 4: the sweep's record
of the data a study's trials trained on)."""

from __future__ import annotations

import datasets
import pyarrow as pa

from cembed.data.identity import rows_digest


def _rows(n: int) -> dict[str, list]:
    return {
        "anchor": [f"question {i}" for i in range(n)],
        "positive": [f"answer {i}" for i in range(n)],
        "anchor_input_ids": [[101, i, 102] for i in range(n)],
        "label": [i % 3 for i in range(n)],
        "meta": [{"i": i} for i in range(n)],
    }


def test_equal_rows_give_equal_digests_however_stored(tmp_path):
    whole = datasets.Dataset.from_dict(_rows(10))
    chunked = pa.concat_tables([pa.table(_rows(10)).slice(0, 4), pa.table(_rows(10)).slice(4)])
    assert chunked.column("anchor").num_chunks == 2
    whole.save_to_disk(str(tmp_path / "saved"))
    mapped = datasets.load_from_disk(str(tmp_path / "saved"))  # memory-mapped
    selected = datasets.Dataset.from_dict(_rows(12)).select(range(10))  # behind an indices mapping
    digest = rows_digest(whole)
    assert len(digest) == 32
    assert rows_digest(chunked) == rows_digest(mapped) == rows_digest(selected) == digest
    assert rows_digest(whole, 2, 5) == rows_digest(datasets.Dataset.from_dict(_rows(10)).select(range(2, 5)))


def test_a_changed_cell_row_order_or_column_changes_the_digest():
    rows = _rows(10)
    digest = rows_digest(datasets.Dataset.from_dict(rows))
    for column, value in [
        ("anchor", "question 7 edited"),
        ("anchor_input_ids", [101, 8, 102]),
        ("label", 2),
        ("meta", {"i": 70}),
    ]:
        edited = {k: list(v) for k, v in rows.items()}
        edited[column][7] = value
        assert rows_digest(datasets.Dataset.from_dict(edited)) != digest, column
    swapped = {k: [*v[1::-1], *v[2:]] for k, v in rows.items()}
    assert rows_digest(datasets.Dataset.from_dict(swapped)) != digest
    renamed = {("query" if k == "anchor" else k): v for k, v in rows.items()}
    assert rows_digest(datasets.Dataset.from_dict(renamed)) != digest
    assert rows_digest(datasets.Dataset.from_dict(rows), 0, 9) != digest
