"""``cembed init``: a commented starter config for a model and a data file (or a source of any kind
that :attr:`~cembed.config.sources.SourceConfig.can_init`).

:func:`make_starter` reads the data with cembed's own loader (:mod:`cembed.data.sources.registry`), proposes which
columns hold the anchor, the positive and hard negatives (by common column names), measures how the
no-duplicates sampler can batch the rows and suggests a ``per_device_train_batch_size`` it fills leaving
under 5 % of the rows unused (:func:`propose_batch_size`: the sampler's own placement of epoch 0, texts
compared as training compares them); :func:`write_starter` writes the YAML (never over an existing file).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cembed.config.columns import ColumnMap
from cembed.config.model import model_config, model_config_class
from cembed.config.sources import FileSource, SourceConfig, infer_source_kind, local_source
from cembed.data.batching.full_table import build_batches
from cembed.data.batching.placement import sampler_hashes
from cembed.data.column_mapping import expand_list_columns
from cembed.data.inspect import inspect_batches
from cembed.data.load import check_cells, map_columns
from cembed.data.rows import TrainingData
from cembed.data.sources.registry import load_source
from cembed.errors import UserError
from cembed.files import write_new_file

# Common column names, most specific first; a column is matched case-insensitively.
ANCHOR_NAMES = ("anchor", "query", "question", "sentence1", "sentence_1", "text1", "premise", "title", "source")
POSITIVE_NAMES = (
    "positive",
    "pos",
    "answer",
    "document",
    "passage",
    "sentence2",
    "sentence_2",
    "text2",
    "response",
    "context",
    "text",
    "target",
)
NEGATIVE_PATTERN = re.compile(r"^(hard_?)?neg(ative)?s?([_\- ]?\d+)?$", re.IGNORECASE)
MAX_SUGGESTED_BATCH = 65536
MAX_UNUSED_SHARE = 0.05  # a proposed batch leaves fewer rows than this share unused per epoch
MAX_SCANNED_SIZES = 256  # sizes tried when no power of two leaves few enough rows unused


@dataclass
class Starter:
    """What ``cembed init`` found and wrote (or would write)."""

    out: Path
    model: str
    data: Path | str  # the data file, or a source config's label
    columns: list[str]  # every column of the file
    roles: dict[str, str]  # "anchor"/"positive" -> column
    negatives: list[str]
    how: dict[str, str]  # role -> "by name" or "by position"
    rows: int
    rows_invalid: int  # rows with an empty/None/over-1-MB cell in a mapped column
    largest_batch: int  # a duplicate-free batch found greedily (lower bound of the true maximum)
    batch_size: int  # suggested per_device_train_batch_size
    mini_batch_size: int
    unused: int = 0  # rows the sampler leaves unused per epoch at batch_size (epoch 0, drop_last)
    batches: int = 0  # batches (= optimizer steps) per epoch at batch_size
    why: str | None = None  # why no batch leaves under MAX_UNUSED_SHARE of the rows unused (None: one does)
    compared_as: str = "raw text"  # how texts were compared (token ids when the model loads)
    text: str = field(repr=False, default="")  # the YAML written
    source: SourceConfig | None = None  # what data.train holds (None: the file ``data``)
    kind: str = "dense"  # the model kind the model's folder is (a MultiVectorEncoder folder: multi_vector)


def _text_columns(dataset) -> list[str]:
    """Columns whose values are strings, in file order."""
    return [
        name for name, feat in dataset.features.items() if getattr(feat, "dtype", None) in ("string", "large_string")
    ]


def _text_list_columns(dataset) -> list[str]:
    """Columns whose values are lists of strings (one row's hard negatives, as Tevatron and PyLate store
    them), in file order."""
    return [
        name
        for name, feat in dataset.features.items()
        if getattr(getattr(feat, "feature", None), "dtype", None) in ("string", "large_string")
    ]


def _by_name(columns: list[str], names: tuple[str, ...], taken: set[str]) -> str | None:
    lowered = {c.lower(): c for c in columns if c not in taken}
    return next((lowered[n] for n in names if n in lowered), None)


def propose_roles(columns: list[str], lists: list[str] = ()) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """Which text columns hold the anchor, the positive and the hard negatives.

    By name first (``query``/``question``/``anchor``/``sentence1``... for the anchor,
    ``positive``/``answer``/``document``/``passage``/``sentence2``... for the positive,
    ``negative*``/``hard_negative*``/``neg*`` for negatives, also among ``lists``, the columns holding
    lists of texts: training expands each into one column per position); a role no name matches takes
    the first unused text column (by position).

    Returns:
        ``(roles, negatives, how)``: ``roles`` maps ``anchor``/``positive`` to a column, ``how`` says
        for each role whether it was found ``by name`` or ``by position``.

    Raises:
        UserError: fewer than two text columns.
    """
    negatives = [c for c in [*columns, *lists] if NEGATIVE_PATTERN.match(c)]
    roles: dict[str, str] = {}
    how: dict[str, str] = {}
    taken = set(negatives)
    for role, names in (("anchor", ANCHOR_NAMES), ("positive", POSITIVE_NAMES)):
        found = _by_name(columns, names, taken)
        if found is not None:
            roles[role], how[role] = found, "by name"
            taken.add(found)
    for role in ("anchor", "positive"):
        if role not in roles:
            rest = [c for c in columns if c not in taken]
            if not rest:
                raise UserError(
                    f"--data: needs two text columns (anchor, positive); it has {len(columns)} text column(s): "
                    f"{', '.join(columns) or 'none'}"
                )
            roles[role], how[role] = rest[0], "by position"
            taken.add(rest[0])
    return {"anchor": roles["anchor"], "positive": roles["positive"]}, negatives, how


def suggest_batch_size(largest_batch: int, rows: int, cap: int = MAX_SUGGESTED_BATCH) -> int:
    """The largest power of two that is at most the largest duplicate-free batch, a quarter of the
    rows (so an epoch has at least four steps) and ``cap``.

    Raises:
        UserError: not even a batch of 2 fits (too few rows or too many duplicates).
    """
    bound = min(largest_batch, rows // 4, cap)
    if bound < 2:
        raise UserError(
            f"--data: {rows} rows, largest duplicate-free batch {largest_batch}: too few to fill batches of 2 "
            "with at least 4 steps per epoch; in-batch negatives need more distinct rows"
        )
    return 1 << (bound.bit_length() - 1)


@dataclass(frozen=True)
class BatchProposal:
    """:func:`propose_batch_size`'s answer."""

    batch_size: int  # per_device_train_batch_size (one process)
    unused: int  # rows the no-duplicates sampler leaves unused per epoch at that size
    batches: int  # batches per epoch at that size
    why: str | None  # why no size leaves under MAX_UNUSED_SHARE unused (None: this one does)


def propose_batch_size(
    hashes: np.ndarray, seed: int, largest_batch: int, cap: int = MAX_SUGGESTED_BATCH
) -> BatchProposal:
    """The batch size ``cembed init`` writes: the largest power of two up to
    :func:`suggest_batch_size`'s bound whose epoch 0 the no-duplicates sampler fills leaving under
    5 % (``MAX_UNUSED_SHARE``) of the rows unused, counted by the sampler's own placement
    (:func:`cembed.data.batching.full_table.build_batches`, ``drop_last`` as the config's default, ``seed`` =
    ``train.seed``); else the largest other size that does (up to ``MAX_SCANNED_SIZES`` tried); else
    the size leaving the fewest unused, with ``why`` saying none does.

    Args:
        hashes: ``(rows, columns)`` text hashes as the sampler computes them
            (:func:`cembed.data.batching.placement.sampler_hashes`).
        largest_batch: a duplicate-free batch found (:func:`cembed.data.inspect.inspect_batches`).

    Raises:
        UserError: not even a batch of 2 fits (see :func:`suggest_batch_size`).
    """
    rows = hashes.shape[0]
    top = suggest_batch_size(largest_batch, rows, cap)
    limit = MAX_UNUSED_SHARE * rows
    tried: dict[int, tuple[int, int]] = {}

    def unused(size: int) -> int:
        if size not in tried:
            batches, left = build_batches(hashes, size, True, seed)
            tried[size] = (left, len(batches))
        return tried[size][0]

    powers = [1 << e for e in range(top.bit_length() - 1, 0, -1)]  # top, top/2, ..., 2
    bound = min(largest_batch, rows // 4, cap)
    others = np.unique(np.linspace(2, bound, min(MAX_SCANNED_SIZES, bound - 1)).astype(int))[::-1]
    for size in [*powers, *(int(b) for b in others)]:
        if unused(size) < limit:
            return BatchProposal(size, *tried[size], None)
    size = min(tried, key=lambda b: (tried[b][0], -b))  # the fewest unused, the larger size on a tie
    left = tried[size][0]
    why = (
        f"no batch of 2 to {bound} rows leaves under {MAX_UNUSED_SHARE:.0%} of the {rows} rows unused: texts "
        f"repeat across rows (`cembed inspect-data` shows which); {size} leaves the fewest ({left}, {left / rows:.0%})"
    )
    return BatchProposal(size, *tried[size], why)


def _init_source(data: Path | SourceConfig) -> tuple[SourceConfig, Path | str]:
    """``(source config, how the report names it)`` of ``make_starter``'s ``data``: a path is a file
    source, or a saved source for a ``save_to_disk`` folder (:func:`cembed.config.sources.local_source`); a source config of a kind that :attr:`~cembed.config.sources.SourceConfig.can_init`.

    Raises:
        UserError: a source config of a kind ``init`` cannot read.
    """
    if not isinstance(data, SourceConfig):  # the command line's path
        return local_source(str(data)), Path(data)
    if not data.can_init:
        raise UserError(f"{data.label}: cembed init cannot read a {data.kind} source (it proposes text columns)")
    return data, data.label


def make_starter(out: Path, model: str, data: Path | SourceConfig, seed: int = 42) -> Starter:
    """Read ``data`` (a data file, or a source config of a kind that can be ``init``-ed), propose the
    role mapping and the batch size, and render the starter YAML.

    The batch size is :func:`propose_batch_size`'s, with texts compared as training will compare
    them (:func:`cembed.data.batching.placement.sampler_hashes`: ``model``'s token ids when it loads, raw text
    otherwise) and ``seed`` (written as ``train.seed``).

    Raises:
        UserError: ``out`` exists (never overwritten), the data cannot be read, has too few text
            columns or too few distinct rows (see :func:`suggest_batch_size`).
    """
    out = Path(out)
    source, data = _init_source(data)
    if out.exists():
        raise UserError(f"{out}: already exists; cembed init never overwrites a file (choose another name)")
    raw = load_source(source)
    kind = _model_kind(model)
    columns = _text_columns(raw)
    roles, negatives, how = propose_roles(columns, _text_list_columns(raw))
    column_map = ColumnMap(anchor=roles["anchor"], positive=roles["positive"], negatives=negatives)
    # a column of lists of negatives is measured as training reads it: one column per position
    expanded, mapping, _ = expand_list_columns(raw, column_map, str(data), "data.train.columns")
    mapped = map_columns(expanded, mapping, str(data))
    mapped, invalid = check_cells(mapped, str(data), {}, drop_invalid=True)
    prepared = TrainingData(mapped, str(data), len(raw), invalid)
    hashes, compared, _ = sampler_hashes(prepared, model_config(kind=kind, name_or_path=model))
    largest = inspect_batches(hashes, batch_size=max(len(mapped), 1), drop_last=False, seed=seed)["largest_batch"]
    proposal = propose_batch_size(hashes, seed, largest)
    batch = proposal.batch_size
    starter = Starter(
        out=out,
        model=model,
        data=data,
        columns=list(raw.column_names),
        roles=roles,
        negatives=negatives,
        how=how,
        rows=len(raw),
        rows_invalid=invalid,
        largest_batch=largest,
        batch_size=batch,
        mini_batch_size=min(32, batch),
        unused=proposal.unused,
        batches=proposal.batches,
        why=proposal.why,
        compared_as=compared,
        source=source,
        kind=kind,
    )
    starter.text = render_starter(starter)
    return starter


def _model_kind(model: str) -> str:
    """The model kind that trains ``model`` as what it is: its saved folder's type
    (:func:`cembed.model.kinds.lookup.saved_model_type`; a ColBERT / PyLate / ``MultiVectorEncoder`` folder is
    ``multi_vector``), ``dense`` for a dense model, a plain checkpoint or a hub id not readable here.

    Raises:
        ModelRefused: a folder of a type no kind of cembed trains, naming it (``--model``).
    """
    from cembed.model.kinds.lookup import kind_of_folder, saved_model_type
    from cembed.model.load import resolve_model_path

    name = resolve_model_path(model)
    return kind_of_folder(saved_model_type(name), model).name


def _loss_lines(kind: str) -> list[str]:
    """The starter's loss section: the dense one (``cached_mnrl`` at scale 20), else the kind's default
    loss at its default scale."""
    if kind == "dense":
        return [_line("  name: cached_mnrl", "in-batch negatives InfoNCE with GradCache"), "  scale: 20"]
    from cembed.config.loss import loss_config

    default = model_config_class(kind).default_loss
    return [
        _line(f"  name: {default}", f"the default loss of model.kind {kind}"),
        f"  scale: {loss_config(name=default).scale}",
    ]


def _line(text: str, comment: str = "") -> str:
    """One YAML line with its comment aligned at column 36."""
    return f"{text:<35} # {comment}" if comment else text


def _train_yaml(s: Starter) -> tuple[str, str]:
    """``data.train`` as one YAML value and its comment: the source's fields as given, its path fields
    relative to the config's folder; a lone path when that path reads back as the same kind."""
    source = s.source if s.source is not None else FileSource(path=str(s.data))
    folder = s.out.resolve().parent
    fields = source.model_dump(mode="json", exclude_unset=True, exclude={"kind"})
    for name in source.path_fields:
        if isinstance(fields.get(name), str):
            fields[name] = os.path.relpath(Path(fields[name]).resolve(), folder)
    if set(fields) == {"path"} and infer_source_kind(fields["path"], folder) == source.kind:
        return json.dumps(fields["path"]), "relative to this file"
    return json.dumps({"kind": source.kind, **fields}), "paths relative to this file"


def render_starter(s: Starter) -> str:
    """The starter config as commented YAML; ``data.train`` is relative to the config's folder."""
    q = json.dumps  # a JSON string is a valid YAML scalar, whatever the name holds
    train, where = _train_yaml(s)
    negatives = f"[{', '.join(q(n) for n in s.negatives)}]"
    invalid = (
        ("true", f"{s.rows_invalid} rows have an empty cell; they are skipped and counted")
        if s.rows_invalid
        else ("false", "true: skip (and count) rows with an empty cell instead of stopping")
    )
    trained = s.rows - s.rows_invalid
    share = f"{s.unused / trained:.1%}" if trained else "-"
    lines = [
        f"# Starter config written by `cembed init` for {s.model} and {Path(s.data).name}",
        f"# ({s.rows} rows; columns {', '.join(s.columns)}). Check the column mapping, then:",
        f"#   cembed validate {s.out}",
        f"#   cembed inspect-data {s.out}",
        f"#   cembed train {s.out}",
        "model:",
        *(
            [_line(f"  kind: {s.kind}", "what its folder is (a MultiVectorEncoder: one vector per token)")]
            if s.kind != "dense"
            else []
        ),
        _line(f"  name_or_path: {q(s.model)}"),
        _line("  max_seq_length: null", "null: the model's own; lower it for short texts (faster)"),
        _line("  device: auto", "auto | cpu | cuda"),
        _line("  precision: auto", "auto: bf16 on a GPU with bf16, fp32 on CPU | fp32 | bf16 | fp16"),
        "data:",
        _line(f"  train: {train}", where),
        _line("  columns:", "data column -> role; every other column is dropped"),
        _line(f"    anchor: {q(s.roles['anchor'])}", f"found {s.how['anchor']}"),
        _line(f"    positive: {q(s.roles['positive'])}", f"found {s.how['positive']}"),
        _line(f"    negatives: {negatives}", "hard negatives: columns named negative*/hard_negative*"),
        _line(f"  drop_invalid_rows: {invalid[0]}", invalid[1]),
        "batch:",
        f"  # In-batch negatives per anchor = batch - 1. At {s.batch_size} the no-duplicates sampler fills "
        f"{s.batches} batches",
        f"  # per epoch and leaves {s.unused} of {trained} rows unused ({share}); a duplicate-free batch of "
        f"{s.largest_batch} rows exists.",
        f"  # Texts compared as {s.compared_as}. `cembed inspect-data` shows more.",
        *([f"  # {s.why}"] if s.why else []),
        f"  per_device_train_batch_size: {s.batch_size}",
        _line(f"  mini_batch_size: {s.mini_batch_size}", "memory only; `cembed probe-minibatch` finds the largest"),
        "optim:",
        _line("  learning_rate: 2.0e-5", "the base LR, tuned at base_batch_size ..."),
        "  base_batch_size: 32",
        _line("  lr_scaling: sqrt", "... scaled to the batch (`cembed validate` shows it)"),
        "  warmup_ratio: 0.1",
        "loss:",
        *_loss_lines(s.kind),
        "sampler:",
        _line("  no_duplicates: true", "a text never appears twice in a batch (no false negatives)"),
        "train:",
        "  # How long: one epoch unless one of these two is set (not both; the command line works too:",
        "  # train.max_steps=100 or train.num_train_epochs=3).",
        "  # num_train_epochs: 1",
        _line(f"  # max_steps: {max(s.batches, 1)}", "one epoch at this batch"),
        "  logging_steps: 10",
        "  seed: 42",
        _line(f"  output_dir: {q('runs/' + s.out.stem)}", "relative to this file"),
    ]
    return "\n".join(lines) + "\n"


def write_starter(starter: Starter) -> Path:
    """Write ``starter.text`` to ``starter.out`` (see :func:`write_new_file`)."""
    return write_new_file(starter.out, starter.text)
