"""The batch side of pre-tokenized data: a batch's token ids fetched from the Arrow table, padded.

The trainer reads training batches through :class:`TokenIdRows`: a batch's rows are taken from the
Arrow table at once (offsets and values as numpy views, :class:`IdColumn`) and padded with numpy by
:class:`PaddingCollator`, with no per-row Python (65,536 rows x 256 tokens in about 1 s on 2 cores,
against 5.6-7.6 s for ``datasets``' row fetch plus per-row padding; ``scripts/bench_throughput.py``,
section ``produce``). The collator only pads and stacks ids and holds no reference to the model, so
it pickles cheaply into ``dataloader_num_workers`` worker processes. :func:`collator_for` builds one
that matches a model's own preprocessing keys (or says that none can).

The ids come from :func:`cembed.data.tokens.tokenize.pretokenize`, in ``<role>`` + :data:`TOKEN_SUFFIX` columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

from cembed.data.identity import PROMPT_SUFFIX, TOKEN_SUFFIX


@dataclass(frozen=True)
class RaggedIds:
    """One column's token ids for a batch's rows, without padding: row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``.

    Attributes:
        offsets: shape ``(rows + 1,)``, int64, starting at 0.
        values: shape ``(offsets[-1],)``, the ids of all rows back to back (int32 as stored).
    """

    offsets: np.ndarray
    values: np.ndarray

    @classmethod
    def from_lists(cls, seqs: list) -> RaggedIds:
        """From one id list per row (the per-row path; used for a plain list of row dicts)."""
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(offsets[-1]))
        return cls(offsets, values)


def ragged_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))`` without a Python loop, int64."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum(lengths) - lengths  # where each row's run begins in the output
    return np.repeat(starts.astype(np.int64) - first, lengths) + np.arange(total, dtype=np.int64)


def _root(buffer):
    """The buffer ``buffer`` is a slice of, followed to the top (a memory-mapped file's whole map)."""
    while buffer.parent is not None:
        buffer = buffer.parent
    return buffer


class IdColumn:
    """Zero-copy numpy views of one pre-tokenized ``list<int>`` column, and a batch gather over them.

    Args:
        column: a ``pyarrow.ChunkedArray`` (or Array) of int lists without nulls (memory-mapped).

    ``pyarrow``'s ``take`` concatenates every chunk of a list column first (a copy of the whole
    column per batch). Here a batch is gathered with numpy indexing straight from the memory the
    chunks live in: the record batches of one memory-mapped Arrow file are slices of one buffer (the
    file's map), so one view of that buffer (a *region*) serves all of them, and a batch costs one
    vectorised gather per file whatever the number of record batches (``datasets`` writes 1,000
    rows per record batch: 100,000 of them at 100M rows). A chunk whose buffers are not inside one
    root buffer, or not aligned to the element size there, is a region of its own.

    State per chunk: three int64s (its first row, and where its offsets and values start in its
    region); no per-row array is built.
    """

    def __init__(self, column) -> None:
        chunks = [c for c in getattr(column, "chunks", [column]) if len(c)]
        self.first_row = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in chunks], out=self.first_row[1:])
        self.regions: list[tuple[np.ndarray, np.ndarray]] = []  # (offsets view, values view)
        self.region = np.zeros(len(chunks), dtype=np.int64)
        self.offsets_at = np.zeros(len(chunks), dtype=np.int64)  # the chunk's offsets[0] in its region
        self.values_at = np.zeros(len(chunks), dtype=np.int64)  # the chunk's values[0] in its region
        roots: dict[tuple[int, int], int] = {}
        for i, chunk in enumerate(chunks):
            offsets, values = chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False)
            at = self._in_root(chunk, offsets.dtype, values.dtype)
            if at is None:  # a region of its own
                self.region[i] = len(self.regions)
                self.regions.append((offsets, values))
                continue
            root, self.offsets_at[i], self.values_at[i] = at
            key = (root.address, root.size)
            if key not in roots:
                roots[key] = len(self.regions)
                self.regions.append(
                    (
                        np.frombuffer(root, dtype=offsets.dtype, count=root.size // offsets.dtype.itemsize),
                        np.frombuffer(root, dtype=values.dtype, count=root.size // values.dtype.itemsize),
                    )
                )
            self.region[i] = roots[key]

    @staticmethod
    def _in_root(chunk, offsets_dtype, values_dtype):
        # (root buffer, offsets[0] and values[0] as element positions in it), or None.
        offsets_buf, values = chunk.buffers()[1], chunk.values
        values_buf = values.buffers()[1]
        if offsets_buf is None or values_buf is None:
            return None
        root = _root(offsets_buf)
        if _root(values_buf).address != root.address:
            return None
        o = offsets_buf.address + chunk.offset * offsets_dtype.itemsize - root.address
        v = values_buf.address + values.offset * values_dtype.itemsize - root.address
        if o % offsets_dtype.itemsize or v % values_dtype.itemsize or root.size % values_dtype.itemsize:
            return None
        return root, o // offsets_dtype.itemsize, v // values_dtype.itemsize

    def take(self, rows: np.ndarray) -> RaggedIds:
        """The ids of ``rows`` (int64 global row numbers, any order, repeats allowed), in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        offsets = np.zeros(n + 1, dtype=np.int64)
        dtype = self.regions[0][1].dtype if self.regions else np.int64
        if n == 0:
            return RaggedIds(offsets, np.empty(0, dtype=dtype))
        chunk = np.searchsorted(self.first_row, rows, side="right") - 1
        local = rows - self.first_row[chunk]
        if len(self.regions) == 1:
            groups: list = [(0, slice(None))]
        else:
            region = self.region[chunk]
            groups = [(int(r), np.flatnonzero(region == r)) for r in np.unique(region)]
        begin, lengths = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        for r, sel in groups:
            offs = self.regions[r][0]
            at = self.offsets_at[chunk[sel]] + local[sel]
            first = offs[at].astype(np.int64)
            begin[sel] = self.values_at[chunk[sel]] + first
            lengths[sel] = offs[at + 1] - first
        np.cumsum(lengths, out=offsets[1:])
        values = np.empty(int(offsets[-1]), dtype=dtype)
        for r, sel in groups:
            src = ragged_positions(begin[sel], lengths[sel])
            values[ragged_positions(offsets[:-1][sel], lengths[sel])] = self.regions[r][1][src]
        return RaggedIds(offsets, values)


class TokenIdRows(torch.utils.data.Dataset):
    """A pre-tokenized ``datasets.Dataset`` as the training data loader reads it: a batch's rows are
    fetched at once (``__getitems__``, which torch's fetcher calls with the batch sampler's index
    list) as one :class:`RaggedIds` per role, straight from the Arrow table's offsets and values;
    no per-row Python objects are built (``datasets``' own ``__getitems__`` makes a dict of Python
    lists per row). :class:`PaddingCollator` pads the result.

    Args:
        dataset: the pre-tokenized dataset (``<role>_input_ids`` columns), the trainer's
            ``train_dataset``; indices are its row numbers (a ``select``/``shuffle`` mapping is applied).
        roles: the text columns, in loss order.

    Pickles as the dataset (memory-mapped tables pickle by file path) and rebuilds its views in
    each data-loader worker.
    """

    def __init__(self, dataset, roles: list[str]) -> None:
        self.dataset = dataset
        self.roles = list(roles)
        self._columns: dict[str, IdColumn] | None = None
        self._mapping: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {"dataset": self.dataset, "roles": self.roles, "_columns": None, "_mapping": None}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.dataset[index]

    def _views(self) -> dict[str, IdColumn]:
        if self._columns is None:
            table = self.dataset.data.table
            indices = getattr(self.dataset, "_indices", None)  # select/shuffle/filter mapping
            if indices is not None:
                self._mapping = indices.column(0).to_numpy().astype(np.int64)
            self._columns = {r: IdColumn(table.column(r + TOKEN_SUFFIX)) for r in self.roles}
        return self._columns

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        """``{role: RaggedIds}`` for the rows ``indices`` (in that order), plus ``<role>_prompt_length``
        (an int, the first row's) for a prompted role. A batch holds one source's rows, so the first
        row tells the batch's layout and prompts: a role whose first cell is null (a source that does
        not map it) is left out, and so is the prompt length of a role its source has no prompt for."""
        columns = self._views()
        rows = np.asarray(indices, dtype=np.int64)
        if self._mapping is not None:
            rows = self._mapping[rows]
        table = self.dataset.data.table
        first = int(rows[0]) if len(rows) else None
        out: dict[str, Any] = {}
        for role, column in columns.items():
            if first is not None and not table.column(role + TOKEN_SUFFIX)[first].is_valid:
                continue
            out[role] = column.take(rows)
            if first is not None and role + PROMPT_SUFFIX in table.column_names:
                length = table.column(role + PROMPT_SUFFIX)[first].as_py()
                if length is not None:
                    out[role + PROMPT_SUFFIX] = int(length)
        return out


@dataclass
class PaddingCollator:
    """Pad pre-tokenized ids into the batch layout sentence-transformers' collator produces.

    For each role: ``<role>_input_ids`` and ``<role>_attention_mask`` (int64, shape ``(rows,
    width)``, right padding), ``<role>_token_type_ids`` (zeros) if the model uses them, plus the
    model's constant non-tensor features (e.g. ``modality: 'text'``). Text columns are ignored.
    ``width`` is the longest row, rounded up to a multiple of ``pad_to_multiple_of`` (but at most
    ``max_length``) when that is set.

    Takes either ``{role: RaggedIds}`` (:meth:`TokenIdRows.__getitems__`, vectorised: no per-row
    Python) or a list of row dicts with ``<role>_input_ids`` lists (``datasets``' rows). For a
    prompted role, the int ``<role>_prompt_length`` read from the rows (as sentence-transformers'
    collator passes it).
    """

    roles: list[str]
    pad_token_id: int
    token_type_ids: bool = True
    constants: dict[str, Any] = field(default_factory=dict)
    valid_label_columns: list[str] = field(default_factory=list)  # read by the trainer
    pad_to_multiple_of: int | None = None  # batch.pad_to_multiple_of
    max_length: int | None = None  # the width's bound for pad_to_multiple_of (the model's max_seq_length)
    # role -> its query expansion (cembed.model.kinds.registry.Expansion): the role's rows are padded to
    # the expansion's length with its token, as the model's preprocess pads a query (ColBERT).
    expansions: dict[str, Any] = field(default_factory=dict)

    def width(self, longest: int) -> int:
        """The padded width for a batch whose longest row has ``longest`` tokens."""
        m = self.pad_to_multiple_of
        if not m or longest == 0:
            return longest
        rounded = -(-longest // m) * m
        return max(longest, min(rounded, self.max_length)) if self.max_length else rounded

    def pad(self, seqs: RaggedIds | list) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)``, both ``(rows, width)`` int64 (:meth:`width`)."""
        ragged = seqs if isinstance(seqs, RaggedIds) else RaggedIds.from_lists(seqs)
        lengths = np.diff(ragged.offsets)
        width = self.width(int(lengths.max()) if len(lengths) else 0)
        mask = np.arange(width)[None, :] < lengths[:, None]
        ids, ids_np = _zeros((len(lengths), width))
        if self.pad_token_id != 0:
            ids_np.fill(self.pad_token_id)
        # Boolean assignment fills row-major, i.e. each row's first len(row) slots, in order.
        ids_np[mask] = ragged.values
        attention, attention_np = _zeros((len(lengths), width))
        np.copyto(attention_np, mask)
        return ids, attention

    def expand(self, ids: torch.Tensor, mask: torch.Tensor, expansion) -> tuple[torch.Tensor, ...]:
        """A query role's ``(input_ids, attention_mask, query_expansion_positions)`` at the expansion's
        fixed width: every position after a row's tokens holds the expansion token, is marked in
        ``query_expansion_positions`` (bool) and attended to only when the expansion says so
        (sentence-transformers' ``Transformer.preprocess``, strategy ``fixed``)."""
        rows, width = ids.shape
        if width < expansion.length:  # the stored ids are cut at the expansion length: never wider
            ids = torch.nn.functional.pad(ids, (0, expansion.length - width), value=self.pad_token_id)
            mask = torch.nn.functional.pad(mask, (0, expansion.length - width), value=0)
        positions = mask == 0
        ids = ids.masked_fill(positions, expansion.token_id)
        if expansion.attend:
            mask = mask.masked_fill(positions, 1)
        return ids, mask, positions

    def present(self, rows: dict[str, RaggedIds] | list[dict[str, Any]]) -> list[str]:
        """The roles the batch carries, in loss order: a batch holds one source's rows, and a role
        that source does not map (null ids, see :func:`cembed.data.load.load_training_data`) is left
        out, so the loss embeds only the source's own columns."""
        if isinstance(rows, dict):
            return [r for r in self.roles if r in rows]
        return [r for r in self.roles if not rows or rows[0].get(r + TOKEN_SUFFIX) is not None]

    def __call__(self, rows: dict[str, RaggedIds] | list[dict[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        for role in self.present(rows):
            seqs = rows[role] if isinstance(rows, dict) else [r[role + TOKEN_SUFFIX] for r in rows]
            ids, mask = self.pad(seqs)
            if role in self.expansions:
                ids, mask, positions = self.expand(ids, mask, self.expansions[role])
                batch[f"{role}_query_expansion_positions"] = positions
            batch[f"{role}_input_ids"] = ids
            if self.token_type_ids:
                batch[f"{role}_token_type_ids"] = _zeros(tuple(ids.shape))[0]
            batch[f"{role}_attention_mask"] = mask
            for key, value in self.constants.items():
                batch[f"{role}_{key}"] = value
            if isinstance(rows, dict) and role + PROMPT_SUFFIX in rows:
                batch[role + PROMPT_SUFFIX] = rows[role + PROMPT_SUFFIX]
            elif isinstance(rows, list) and rows and rows[0].get(role + PROMPT_SUFFIX) is not None:
                batch[role + PROMPT_SUFFIX] = int(rows[0][role + PROMPT_SUFFIX])
        return batch


def _zeros(shape: tuple[int, int]) -> tuple[torch.Tensor, np.ndarray]:
    """An int64 zero tensor and a numpy view of it, allocated without writing its memory: zero pages
    from the OS (calloc), or in a data-loader worker a shared-memory segment, which is how the batch
    travels to the training process anyway (torch's ``default_collate`` does the same), so it is
    not copied there a second time. Writing a fresh 134 MB array costs more than the padding itself
    where first-touch page faults are slow (VMs)."""
    if torch.utils.data.get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(8 * shape[0] * shape[1])
        tensor = torch.empty(0, dtype=torch.int64).set_(storage).view(shape)
    else:
        tensor = torch.from_numpy(np.zeros(shape, dtype=np.int64))
    return tensor, tensor.numpy()


def collator_for(
    model, roles: list[str], pad_to_multiple_of: int | None = None, expansions: dict[str, Any] | None = None
) -> PaddingCollator | None:
    """A :class:`PaddingCollator` matching ``model.preprocess`` output keys, or ``None`` when the
    model's text features are more than ids/mask/token types (then pre-tokenization is not used).
    ``pad_to_multiple_of`` (``batch.pad_to_multiple_of``) rounds each batch's width up, to at most
    ``model.max_seq_length``; ``expansions``: the roles padded with query expansion
    (:attr:`PaddingCollator.expansions`)."""
    sample = model.preprocess(["a"])
    tensors = {k for k, v in sample.items() if isinstance(v, torch.Tensor)}
    if not tensors <= {"input_ids", "attention_mask", "token_type_ids"} or "input_ids" not in tensors:
        return None
    tokenizer = model.tokenizer
    if getattr(tokenizer, "padding_side", "right") != "right" or tokenizer.pad_token_id is None:
        return None
    constants = {k: v for k, v in sample.items() if not isinstance(v, torch.Tensor)}
    return PaddingCollator(
        roles,
        tokenizer.pad_token_id,
        "token_type_ids" in tensors,
        constants,
        pad_to_multiple_of=pad_to_multiple_of,
        max_length=getattr(model, "max_seq_length", None),
        expansions=dict(expansions or {}),
    )


@dataclass
class TextCollator(SentenceTransformerDataCollator):
    """sentence-transformers' collator (tokenizing texts as it goes, ``data.pretokenize: false``) for
    batches of one source each: a column the batch's source does not map (null in the batch's rows,
    see :func:`cembed.data.load.load_training_data`) is left out before tokenizing, so the loss embeds
    the source's own columns. Per-source prompts use sentence-transformers' own per-dataset form
    (``prompts = {source name: {column: prompt}}`` with a ``dataset_name`` in each row,
    :class:`SourceNamedRows`)."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if features:
            absent = [k for k, v in features[0].items() if v is None]
            if absent:
                features = [{k: v for k, v in row.items() if k not in absent} for row in features]
        return super().__call__(features)


class SourceNamedRows(torch.utils.data.Dataset):
    """A dataset whose rows also carry ``dataset_name``: the name of the source that holds the row
    (sources' rows are consecutive, in ``names`` order, ``sizes`` rows each), which
    sentence-transformers' collator reads to pick that source's prompts.

    Args:
        dataset: the training dataset (row indices as the sampler gives them).
        names: each source's name.
        sizes: each source's rows.
    """

    def __init__(self, dataset, names: list[str], sizes: list[int]) -> None:
        self.dataset = dataset
        self.names = list(names)
        self.ends = np.cumsum(sizes)

    def __len__(self) -> int:
        return len(self.dataset)

    def _name(self, index: int) -> str:
        return self.names[int(np.searchsorted(self.ends, index, side="right"))]

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], "dataset_name": self._name(index)}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        rows = self.dataset.__getitems__(list(indices))
        return [{**row, "dataset_name": self._name(i)} for row, i in zip(rows, indices)]
