"""No column silently ignored: what a source's columns are used for before they are mapped to roles.

- :func:`unmapped_column_notes`: the columns the mapping leaves out and does not declare in
  ``ignore`` (ids, labels), listed; a column whose name looks like a role the config does not use
  (``negative``, ``negative_1``, ``hard_negative``, ``neg`` ...) gets a warning naming the mapping
  to add (``data.columns.negatives: [negative]``).
- :func:`expand_list_columns`: a mapped negatives column whose cells are lists of texts (several
  negatives per row) becomes one column per position (``negatives[1]``, ``negatives[2]`` ...), as
  many as the shortest list holds, instead of being refused as non-text (or trained as text).
"""

from __future__ import annotations

import difflib
import re

import pyarrow as pa
import pyarrow.compute as pc

from cembed.config.columns import ColumnMap
from cembed.config.sources import SOURCE_CONFIGS
from cembed.errors import UserError

# Column names that hold hard negatives by the usual conventions (sentence-transformers' datasets,
# BGE/FlagEmbedding's `neg`, MTEB-style `negative_passages`, `hard_negative_3` ...).
NEGATIVE_NAME = re.compile(r"^(hard[_ ]?)?neg(ative)?s?([_ ]?(passages?|docs?|documents?|texts?))?([_ ]?\d+)?$", re.I)


def mapped_columns(columns: ColumnMap) -> list[str]:
    """The data columns a mapping reads: anchor, positive, then the negatives."""
    return [columns.anchor, columns.positive, *columns.negatives]


def unmapped_column_notes(names: list[str], columns: ColumnMap, key: str, label: str, kind: str = "file") -> list[str]:
    """Warnings about the columns of ``names`` (a source's columns) that ``columns`` does not map.

    Args:
        names: the source's column names, in file order.
        columns: the effective mapping of the source; its ``ignore`` columns are left out of the notes.
        key: the config field holding the source (``data.train`` or ``data.train.<name>``), to name
            the mapping to add: ``data.columns`` for ``data.train``, else ``<key>.columns``.
        label: how messages name the source (its path).
        kind: the source kind; the columns its loader adds itself (the kind's
            :attr:`~cembed.config.sources.SourceConfig.generated_columns`) are not listed.

    Returns:
        Up to two lines: one naming the columns that look like negatives and the mapping that trains
        them, one listing the other unmapped columns (left out of training) and the ``ignore`` list that
        says so. Empty when every column is mapped or ignored.

    Raises:
        UserError: an ``ignore`` column the source does not have (naming the closest column it has).
    """
    field = "data.columns" if key == "data.train" else f"{key}.columns"
    ignored = list(columns.ignore or ())
    missing = next((n for n in ignored if n not in names), None)
    if missing is not None:
        close = difflib.get_close_matches(missing, names, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(
            f"{label}: {field}.ignore: no column {missing!r} in the data{hint} (the data has columns: {', '.join(names)})"
        )
    kind_class = SOURCE_CONFIGS.get(kind)
    used = set(mapped_columns(columns)) | (kind_class.generated_columns if kind_class is not None else set())
    unused = [n for n in names if n not in used and n not in ignored]
    if not unused:
        return []
    negatives = [n for n in unused if NEGATIVE_NAME.match(n)]
    others = [n for n in unused if n not in negatives]
    notes = []
    if negatives:
        shown = ", ".join(columns.negatives + negatives)
        notes.append(
            f"{label}: column(s) {', '.join(negatives)} look like hard negatives but are not trained on; to use "
            f"them add {field}.negatives: [{shown}]"
        )
    if others:
        notes.append(
            f"{label}: column(s) {', '.join(others)} are not mapped in {field} and are not trained on; if that is "
            f"intended, say so: {field}.ignore: [{', '.join(ignored + others)}]"
        )
    return notes


def _is_text_list(arrow_type) -> bool:
    return (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and (
        pa.types.is_string(arrow_type.value_type) or pa.types.is_large_string(arrow_type.value_type)
    )


def expand_list_columns(dataset, columns: ColumnMap, label: str, key: str) -> tuple[object, ColumnMap, list[str]]:
    """Expand each mapped negatives column whose cells are lists of texts into one column per
    position: ``negs`` holding lists of at least 3 texts becomes ``negs[1]``, ``negs[2]``,
    ``negs[3]`` (roles ``negative_1..3`` when it is the only negatives column). Rows with longer lists
    keep only their first texts, and a note says how many texts that leaves out. A row with a null
    list gets null cells (refused or dropped by the cell check as empty).

    Args:
        dataset: the source's ``datasets.Dataset`` (all its columns).
        columns: the source's mapping.
        label: the source's name in messages.
        key: the config field holding the source (for the fix in messages).

    Returns:
        ``(dataset, columns, notes)``: the dataset with the expanded columns added, the mapping
        naming them instead of the list column, one note per expanded column.

    Raises:
        UserError: a row whose list is empty (no negative to train on), naming the row and the fix.
    """
    names = set(dataset.column_names)
    table = None
    negatives: list[str] = []
    notes: list[str] = []
    for src in columns.negatives:
        if src not in names:
            negatives.append(src)
            continue
        if table is None:
            table = dataset.with_format("arrow")[:]
        arr = table.column(src)
        if not _is_text_list(arr.type):
            negatives.append(src)
            continue
        lengths = pc.list_value_length(arr)
        shortest = pc.min(lengths).as_py()
        if shortest is None:
            raise UserError(f"{label}: column {src!r} holds no list of texts (every cell is null)")
        if shortest == 0:
            row = pc.index(pc.equal(lengths, 0), True).as_py()
            raise UserError(
                f"{label}: row {row + 1}: column {src!r} ({key}: negatives) holds an empty list; every row needs at "
                f"least one negative: remove such rows, or drop {src!r} from the negatives"
            )
        new = [f"{src}[{j + 1}]" for j in range(shortest)]
        for j, name in enumerate(new):
            dataset = dataset.add_column(name, pc.list_element(arr, j).combine_chunks())
        negatives += new
        left = pc.sum(pc.subtract(lengths, shortest)).as_py() or 0
        longest = pc.max(lengths).as_py()
        span = f"{shortest}" if longest == shortest else f"{shortest} to {longest}"
        note = f"{label}: column {src!r} holds lists of {span} negatives: expanded into {shortest} columns ({new[0]}"
        note += f"..{new[-1]})" if shortest > 1 else ")"
        if left:
            note += f"; {left} texts beyond the first {shortest} of a row are left out"
        notes.append(note)
    return dataset, columns.model_copy(update={"negatives": negatives}), notes
