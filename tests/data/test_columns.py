"""cembed.data.column_mapping: the notes about columns a mapping leaves out (exact wording, the mapping
to add) and the expansion of list-of-texts negatives columns into one column per position."""

from __future__ import annotations

import pytest
from datasets import Dataset

from cembed.config.columns import ColumnMap
from cembed.data.column_mapping import NEGATIVE_NAME, expand_list_columns, mapped_columns, unmapped_column_notes
from cembed.errors import UserError


def test_mapped_columns_order():
    assert mapped_columns(ColumnMap(anchor="q", positive="p", negatives=["n2", "n1"])) == ["q", "p", "n2", "n1"]


@pytest.mark.parametrize(
    "name", ["negative", "negatives", "neg", "Negative_3", "hard_negative", "hardneg", "negative_passages", "neg doc 2"]
)
def test_negative_like_names(name):
    assert NEGATIVE_NAME.match(name)


@pytest.mark.parametrize("name", ["negotiation", "anti_negative", "score", "positive", "negative_score"])
def test_other_names(name):
    assert not NEGATIVE_NAME.match(name)


def test_unmapped_columns_listed_with_the_mapping_to_add():
    names = ["query", "pos", "negative", "score", "hard_negative_2", "id"]
    notes = unmapped_column_notes(names, ColumnMap(anchor="query", positive="pos"), "data.train", "train.jsonl")
    assert notes == [
        "train.jsonl: column(s) negative, hard_negative_2 look like hard negatives but are not trained on; to use "
        "them add data.columns.negatives: [negative, hard_negative_2]",
        "train.jsonl: column(s) score, id are not mapped in data.columns and are not trained on; if that is "
        "intended, say so: data.columns.ignore: [score, id]",
    ]


def test_named_source_keeps_its_mapped_negatives_in_the_fix():
    columns = ColumnMap(negatives=["neg1"])
    notes = unmapped_column_notes(
        ["anchor", "positive", "neg1", "negative_passages"], columns, "data.train.nli", "nli.parquet"
    )
    assert notes == [
        "nli.parquet: column(s) negative_passages look like hard negatives but are not trained on; to use them add "
        "data.train.nli.columns.negatives: [neg1, negative_passages]"
    ]


def test_no_notes_when_everything_is_mapped_or_generated():
    assert unmapped_column_notes(["anchor", "positive"], ColumnMap(), "data.train", "x") == []
    beir = ["anchor", "positive", "query_id", "doc_id"]
    assert unmapped_column_notes(beir, ColumnMap(), "data.train", "scifact", kind="beir") == []
    assert unmapped_column_notes(beir, ColumnMap(), "data.train", "f") == [
        "f: column(s) query_id, doc_id are not mapped in data.columns and are not trained on; if that is "
        "intended, say so: data.columns.ignore: [query_id, doc_id]"
    ]


def test_ignored_columns_are_not_listed():
    # Issue 23 item 11: id columns a user knows about (the packaged COCO file's image_id ...) are
    # declared once in columns.ignore and no longer warned about; the others still are.
    names = ["anchor", "positive", "image_id", "negative", "score"]
    columns = ColumnMap(ignore=["image_id", "negative"])
    assert unmapped_column_notes(names, columns, "data.train.coco", "coco.jsonl") == [
        "coco.jsonl: column(s) score are not mapped in data.train.coco.columns and are not trained on; if that "
        "is intended, say so: data.train.coco.columns.ignore: [image_id, negative, score]"
    ]
    assert unmapped_column_notes(names, ColumnMap(ignore=["image_id", "negative", "score"]), "data.train", "x") == []


def test_ignoring_a_column_the_data_lacks_names_the_closest():
    with pytest.raises(UserError) as err:
        unmapped_column_notes(
            ["anchor", "positive", "image_id"], ColumnMap(ignore=["imageid"]), "data.train", "c.jsonl"
        )
    assert str(err.value) == (
        "c.jsonl: data.columns.ignore: no column 'imageid' in the data; did you mean 'image_id'? "
        "(the data has columns: anchor, positive, image_id)"
    )


def test_a_column_both_mapped_and_ignored_is_refused():
    with pytest.raises(ValueError, match="ignore: column 'q' is mapped as anchor; remove it from ignore"):
        ColumnMap(anchor="q", ignore=["id", "q"])


def _rows(negs):
    n = len(negs)
    return Dataset.from_dict(
        {"anchor": [f"a{i}" for i in range(n)], "positive": [f"p{i}" for i in range(n)], "negs": negs}
    )


def test_list_column_expanded_to_the_shortest_list():
    data = _rows([["x1", "x2", "x3"], ["y1", "y2"], ["z1", "z2", "z3", "z4"]])
    out, columns, notes = expand_list_columns(data, ColumnMap(negatives=["negs"]), "src.jsonl", "data.train")
    assert columns.negatives == ["negs[1]", "negs[2]"]
    assert (columns.anchor, columns.positive) == ("anchor", "positive")
    assert out.column_names == ["anchor", "positive", "negs", "negs[1]", "negs[2]"]
    assert out["negs[1]"] == ["x1", "y1", "z1"] and out["negs[2]"] == ["x2", "y2", "z2"]
    # texts beyond the first two of a row: 1 (x3) + 0 + 2 (z3, z4)
    assert notes == [
        "src.jsonl: column 'negs' holds lists of 2 to 4 negatives: expanded into 2 columns (negs[1]..negs[2]); "
        "3 texts beyond the first 2 of a row are left out"
    ]


def test_single_negative_lists_and_text_columns_kept_in_place():
    data = _rows([["x"], ["y"]]).add_column("hard", ["h0", "h1"])
    out, columns, notes = expand_list_columns(
        data, ColumnMap(negatives=["hard", "negs", "missing"]), "src", "data.train.a"
    )
    assert columns.negatives == ["hard", "negs[1]", "missing"]  # text and absent columns untouched, in order
    assert out["negs[1]"] == ["x", "y"]
    assert notes == ["src: column 'negs' holds lists of 1 negatives: expanded into 1 columns (negs[1])"]


def test_no_negatives_no_change():
    data = _rows([["x"]])
    out, columns, notes = expand_list_columns(data, ColumnMap(), "src", "data.train")
    assert out is data and columns == ColumnMap() and notes == []


def test_null_list_gives_null_cells():
    out, columns, _ = expand_list_columns(_rows([["x1", "x2"], None]), ColumnMap(negatives=["negs"]), "s", "data.train")
    assert columns.negatives == ["negs[1]", "negs[2]"]
    assert out["negs[1]"] == ["x1", None] and out["negs[2]"] == ["x2", None]


def test_empty_or_all_null_lists_refused():
    with pytest.raises(UserError, match=r"^s: row 2: column 'negs' \(data.train.b: negatives\) holds an empty list"):
        expand_list_columns(_rows([["x"], [], ["y"]]), ColumnMap(negatives=["negs"]), "s", "data.train.b")
    with pytest.raises(UserError, match="every cell is null"):
        expand_list_columns(
            Dataset.from_dict({"anchor": ["a"], "positive": ["p"], "negs": [None]}).cast_column(
                "negs", _rows([["x"]]).features["negs"]
            ),
            ColumnMap(negatives=["negs"]),
            "s",
            "data.train",
        )
