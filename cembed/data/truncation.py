"""Truncation reports: how many texts reach ``max_seq_length`` once tokenized, per column and source (or
the column's own length where the model kind cuts it elsewhere: a multi-vector model's queries at
``query_length`` or their query expansion, its documents at ``document_length``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow.compute as pc

from cembed.data.identity import arrow_table
from cembed.data.prompts import resolve_source_prompts
from cembed.data.rows import UnloadedData, source_views
from cembed.model.load import load_model, pooling_in_effect, quiet_libraries, weight_dtypes

# --- truncation report -----------------------------------------------------------------------


@dataclass
class ColumnTruncation:
    """How many rows of one column are longer than the tokens the model keeps of it (they get cut):
    ``max_seq_length``, or ``limit`` where the column has a length of its own."""

    column: str  # role column (anchor, positive, negative_1, ...)
    source: str  # the data's column name
    rows: int  # rows checked
    truncated: int  # rows with more tokens than the column keeps
    max_tokens: int  # longest row, tokens (special tokens included)
    limit: int | None = None  # the column's own length (a multi-vector model's query_length ...); None: max_seq_length

    @property
    def fraction(self) -> float:
        return self.truncated / self.rows if self.rows else 0.0


def truncation_report(
    dataset,
    tokenizer,
    max_seq_length: int,
    roles: dict[str, str] | None = None,
    sample_rows: int = 20000,
    prompts: dict[str, str] | None = None,
    limits: dict[str, int] | None = None,
) -> list[ColumnTruncation]:
    """Per column, the rows whose token count (special tokens included, as the model tokenizes)
    exceeds ``max_seq_length`` (or the column's own length in ``limits``), over the first ``sample_rows``
    rows of ``dataset``.

    Args:
        dataset: a ``datasets.Dataset`` of text columns.
        tokenizer: a Hugging Face tokenizer (``model.tokenizer``).
        max_seq_length: tokens kept per text.
        roles: role column -> source column name, for display.
        sample_rows: rows checked (the first ones), to bound the time on big data.
        prompts: ``{column: prompt}`` prepended as in training (its tokens count toward the length).
        limits: ``{column: tokens}`` for the columns the model cuts elsewhere than at ``max_seq_length``.
    """
    n = min(len(dataset), sample_rows)
    out = []
    for col in dataset.column_names:
        prompt = (prompts or {}).get(col, "")
        limit = (limits or {}).get(col)
        cells = dataset[col][:n] if n < len(dataset) else dataset[col]
        texts = [prompt + str(t) for t in cells if t is not None]  # null: a source without this column
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]]
        over = sum(1 for x in lengths if x > (limit or max_seq_length))
        source = (roles or {}).get(col, col)
        out.append(ColumnTruncation(col, source, len(texts), over, max(lengths, default=0), limit))
    return out


def stored_length_report(
    dataset, columns: list[str], max_seq_length: int, limits: dict[str, int] | None = None
) -> list[ColumnTruncation]:
    """Per role column of a prepared source (token ids, no text), the rows whose stored ids reach
    ``max_seq_length`` (or the column's own length in ``limits``; special tokens included: cut, or exactly
    that long) and the longest row, over every row, with pyarrow compute (no Python object per row)."""
    table = arrow_table(dataset)
    out = []
    for col in columns:
        limit = (limits or {}).get(col)
        lengths = pc.list_value_length(table.column(col + "_input_ids"))
        rows = len(lengths) - lengths.null_count
        at_limit = pc.sum(pc.greater_equal(lengths, limit or max_seq_length)).as_py() or 0
        out.append(ColumnTruncation(col, col, rows, at_limit, pc.max(lengths).as_py() or 0, limit))
    return out


def column_limits(model, columns: list[str]) -> dict[str, int]:
    """The columns the model's kind cuts elsewhere than at ``max_seq_length`` (its
    :meth:`cembed.model.kinds.registry.ModelKind.token_layout` per column, the first the query), and
    where: ``{column: tokens}``; empty for a dense model."""
    from cembed.model.kinds.lookup import kind_of

    kind = kind_of(model, default="dense")
    length = int(model.max_seq_length)
    out = {}
    for i, col in enumerate(columns):
        layout = kind.token_layout(model, i)
        if layout is not None and layout.max_length != length:
            out[col] = int(layout.max_length)
    return out


def _merged_truncation(reports: list[list[ColumnTruncation]]) -> list[ColumnTruncation]:
    """Per-source truncation reports as one per column (rows and truncated rows summed, longest kept)."""
    merged: dict[str, ColumnTruncation] = {}
    for report in reports:
        for c in report:
            m = merged.get(c.column)
            merged[c.column] = (
                c
                if m is None
                else ColumnTruncation(
                    c.column,
                    m.source,
                    m.rows + c.rows,
                    m.truncated + c.truncated,
                    max(m.max_tokens, c.max_tokens),
                    c.limit,
                )
            )
    return list(merged.values())


class ModelTruncation(NamedTuple):
    """:func:`model_truncation_report`'s answer: the length, the per-column report, the pooling in
    effect (:func:`cembed.model.load.pooling_in_effect`) and the weights' dtypes (:func:`cembed.model.load.weight_dtypes`)."""

    max_seq_length: int
    columns: list[ColumnTruncation]
    pooling: str
    weights: Any = None  # cembed.model.load.WeightDtypes: stored, training, autocast and saved dtypes
    prompts: Any = None  # cembed.model.prompts.RolePrompts: each role's prompt
    attention: Any = None  # cembed.model.unpad.Unpadding: packed rows or padded mini-batches (batch.unpad)
    source_prompts: Any = None  # {source name: RolePrompts} when a source sets prompts of its own, else None
    stored_ids: bool = False  # a prepared source: ``columns`` count rows whose stored ids reach max_seq_length
    encode_settings: Any = None  # {name: value}: what the model's kind says changes its encoding (max_active_dims)


def model_truncation_report(
    model_cfg,
    data,
    sample_rows: int = 20000,
    prompts_cfg=None,
    unpad="auto",
    precision: str | None = None,
    model=None,
) -> ModelTruncation:
    """Load ``model_cfg``'s model (on CPU) and report truncation of ``data`` (a TrainingData), with
    the pooling the model uses, its stored / training / saved dtypes, each role's prompt
    (``prompts_cfg``, the ``data.prompts`` section, resolved against the model; a source's own
    ``prompts`` for its rows, :func:`resolve_source_prompts`; prompt tokens count toward the length)
    and the attention path ``unpad`` (``batch.unpad``) gives it, and the settings its kind says change its
    encoding (``max_active_dims``; :meth:`cembed.model.kinds.registry.ModelKind.encode_settings`); the per-column
    report is empty for :class:`UnloadedData` (only the model is checked). ``precision`` is the run's
    resolved precision for the dtypes' autocast (``Plan.precision``; None: ``model_cfg.precision``
    resolved on CPU, where the model is loaded). ``model``: the model already loaded on CPU from
    ``model_cfg`` (None: loaded here).

    Raises:
        UserError: the model cannot be loaded; ModelRefused (a UserError) when cembed refuses it,
            ``data.prompts`` names a prompt it lacks, or ``unpad`` is True and it cannot run packed rows.
    """
    from cembed.model.kinds.lookup import kind_of
    from cembed.model.prompts import resolve_prompts
    from cembed.model.unpad import resolve_unpad

    if model is None:
        quiet_libraries()
        model = load_model(model_cfg, "cpu")
    length = int(model.max_seq_length)
    pooling = pooling_in_effect(model, model_cfg)
    weights = weight_dtypes(model, model_cfg, precision)
    prompts = resolve_prompts(prompts_cfg, model)
    attention = resolve_unpad(model, unpad)
    settings = kind_of(model, default="dense").encode_settings(model)
    if isinstance(data, UnloadedData):  # the model loads; there are no rows to measure
        return ModelTruncation(length, [], pooling, weights, prompts, attention, encode_settings=settings)
    if data.manifest is not None:  # token ids, no text: rows whose ids reach the length (maybe cut)
        from cembed.data.tokens.model_check import check_prepared_for_model, prompts_field
        from cembed.files import display_path

        # The refusals training gives (tokenizer, max_seq_length, prompts), also without the sampler's check.
        source = data.sources[0]
        own = (resolve_source_prompts(data, model, prompts) or [prompts])[0]
        where = display_path(source.label)
        check_prepared_for_model(model, data.manifest, where, own.for_columns(data.columns), prompts_field(source))
        report = stored_length_report(data.dataset, data.columns, length, column_limits(model, data.columns))
        by_source = {source.name: own} if source.prompts is not None else None
        return ModelTruncation(
            length, report, pooling, weights, prompts, attention, by_source, True, encode_settings=settings
        )
    per_source = resolve_source_prompts(data, model, prompts)
    limits = column_limits(model, data.columns)
    if per_source is None:
        by_column = prompts.for_columns(data.columns)
        report = truncation_report(data.dataset, model.tokenizer, length, data.roles, sample_rows, by_column, limits)
    else:  # each source's rows with its own prompts
        views = source_views(data)
        report = _merged_truncation(
            [
                truncation_report(
                    v.dataset, model.tokenizer, length, data.roles, sample_rows, p.for_columns(v.columns), limits
                )
                for v, p in zip(views, per_source)
            ]
        )
    by_source = None if per_source is None else {s.name: p for s, p in zip(data.sources, per_source)}
    return ModelTruncation(length, report, pooling, weights, prompts, attention, by_source, encode_settings=settings)
