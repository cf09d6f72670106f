"""The check that stored token ids are this model's: :func:`matches_model_preprocessing` (padding the
stored ids of the first rows gives exactly what ``model.preprocess`` gives for their texts), and
training from a prepared source (:mod:`cembed.data.tokens.format`) with its ids as stored.

A prepared source holds no text, so nothing is tokenized again; in its place
:func:`prepared_stage` (the pre-tokenization branch of :func:`cembed.data.tokens.tokenize.tokenize_stage`)
refuses a model whose tokenizer, ``max_seq_length`` or prompts differ from the ones the ids were
made with, and pads the manifest's sample texts with the model (``model.preprocess``) to compare them
with the stored ids of the same rows, as the text path does after tokenizing.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from cembed.data.identity import PROMPT_SUFFIX
from cembed.data.tokens.collator import PaddingCollator, TokenIdRows, collator_for
from cembed.data.tokens.encode import SourcePrompts, prompt_groups
from cembed.errors import UserError
from cembed.files import display_path
from cembed.model.fingerprint import tokenizer_fingerprint
from cembed.model.kinds.lookup import kind_of


def matches_model_preprocessing(
    model,
    collator: PaddingCollator,
    dataset,
    rows: int = 64,
    prompts: dict[str, str] | None = None,
    sources: list[SourcePrompts] | None = None,
) -> bool:
    """Whether padding the stored ids of the first ``rows`` rows (of each source, with ``sources``)
    gives exactly what ``model.preprocess`` gives for their texts with the role's prompt (ids,
    attention mask, token types, prompt length), for the columns the source maps, and no batch
    carries a column its source does not map. The ids are fetched as training fetches them
    (:class:`TokenIdRows`) and padded to the longest row, as the model pads (``pad_to_multiple_of``
    is left out). Each column is preprocessed as the model's kind preprocesses it (a multi-vector
    model's query / document task: its markers, lengths and query expansion)."""
    kind = kind_of(model, default="dense")
    plain = replace(collator, pad_to_multiple_of=None)
    start = 0
    for group in prompt_groups(len(dataset), collator.roles, prompts, None, sources):
        indices = list(range(start, start + min(rows, group.rows)))
        start += group.rows
        sample = dataset.select(indices)
        batch = plain(TokenIdRows(dataset, collator.roles).__getitems__(indices))
        for column, role in enumerate(collator.roles):
            if sample[0][role] is None:  # a column this source does not map is left out of its batches
                if any(k.startswith(role + "_") for k in batch):
                    return False
                continue
            prompt = group.prompts.get(role) or None
            task = kind.preprocess_kwargs(column)
            ref = model.preprocess(sample[role], **({"prompt": prompt} if prompt else {}), **task)
            if ("query_expansion_positions" in ref) != (f"{role}_query_expansion_positions" in batch):
                return False
            for key in ("input_ids", "attention_mask", "token_type_ids", "query_expansion_positions"):
                if key in ref and not torch.equal(ref[key].to(torch.int64), batch[f"{role}_{key}"].to(torch.int64)):
                    return False
            if ref.get("prompt_length") != batch.get(role + PROMPT_SUFFIX):
                return False
    return True


def column_layouts(model, roles: list[str]) -> tuple[dict[str, int], dict] | None:
    """How ``model``'s kind tokenizes each training column (:meth:`cembed.model.kinds.registry.ModelKind.token_layout`):
    ``({role: truncation length}, {role: query expansion})``, or None when a column's ids cannot be
    stored ahead (the model tokenizes it per batch)."""
    kind = kind_of(model, default="dense")
    layouts = [kind.token_layout(model, i) for i in range(len(roles))]
    if any(layout is None for layout in layouts):
        return None
    lengths = {r: layout.max_length for r, layout in zip(roles, layouts)}
    return lengths, {r: layout.expansion for r, layout in zip(roles, layouts) if layout.expansion is not None}


def role_lengths(lengths: dict[str, int], max_seq_length: int) -> dict[str, int]:
    """The roles cut elsewhere than at ``max_seq_length`` (what a prepared source's manifest records)."""
    return {r: n for r, n in lengths.items() if n != max_seq_length}


def check_prepared_for_model(
    model, manifest, where: str, prompts: dict[str, str] | None, field: str = "data.prompts"
) -> None:
    """Refuse training ``model`` on the prepared source whose manifest is ``manifest`` when the ids
    were made for another tokenizer (:func:`cembed.model.fingerprint.tokenizer_fingerprint`),
    ``max_seq_length`` or prompts (either way: a prompt the run adds or one the ids hold that the
    run leaves out). ``where`` names the source (its folder); ``prompts``: the ``{role column:
    prompt}`` the source trains with (its own ``data.train.prompts`` over ``data.prompts``, else the
    model's own; empty or absent: none); ``field``: the prompts field a message tells to set.

    Raises:
        UserError: one line naming the source, the field, the model's value and the source's.
    """
    redo = "or prepare the source again for this model (cembed prepare-data)"
    if manifest.source_prompts:  # a tokenize-cache entry of sources with prompts of their own
        raise UserError(
            f"{where}: its sources were tokenized with prompts of their own, which one run's prompts cannot "
            "be checked against; train from the text sources it was made from, or prepare one source with "
            "cembed prepare-data"
        )
    length = int(model.max_seq_length)
    if length != manifest.max_seq_length:
        raise UserError(
            f"{where}: max_seq_length: the model's is {length}, the prepared source's {manifest.max_seq_length}; "
            f"set model.max_seq_length: {manifest.max_seq_length} {redo}"
        )
    layouts = column_layouts(model, list(manifest.columns))
    wanted = role_lengths(layouts[0], length) if layouts is not None else {}
    for role in manifest.columns:
        mine = wanted.get(role, length)
        stored = (getattr(manifest, "role_lengths", None) or {}).get(role, manifest.max_seq_length)
        if mine != stored:
            raise UserError(
                f"{where}: column {role!r} is cut at {stored} tokens in the prepared source, at {mine} for this model "
                f"(its query/document length); set the model's lengths as they were {redo}"
            )
    tokenizer = tokenizer_fingerprint(model.tokenizer)
    if tokenizer != manifest.tokenizer:
        made_for = f" (prepared for {manifest.model})" if manifest.model else ""
        raise UserError(
            f"{where}: tokenizer: the model's fingerprint is {tokenizer}, the prepared source's {manifest.tokenizer}"
            f"{made_for}; train the model it was prepared for {redo}"
        )
    run = {r: p for r, p in (prompts or {}).items() if p}
    stored = {r: p for r, p in manifest.prompts.items() if p}
    for role in manifest.columns:
        if run.get(role, "") != stored.get(role, ""):
            raise UserError(
                f"{where}: prompts.{role}: the run's is {run.get(role, '')!r}, the prepared source's "
                f"{stored.get(role, '')!r}; set {field}.{prompt_field(role)} to the source's {redo}"
            )


def prompt_field(role: str) -> str:
    """The ``data.prompts`` field of a role column: anchor, positive, negatives."""
    return "negatives" if role.startswith("negative_") else role


def prompts_field(source) -> str:
    """The prompts field that sets a source's prompts (``source``: a
    :class:`cembed.data.rows.LoadedSource`): its own (``data.train.prompts``) when it sets some,
    else ``data.prompts``."""
    return f"{source.key}.prompts" if source.prompts is not None else "data.prompts"


def prepared_stage(model, data, prompts: dict[str, str] | None, pad_to_multiple_of: int | None):
    """:func:`cembed.data.tokens.tokenize.tokenize_stage` for a prepared source (``data.manifest`` set): the
    stored ids, checked (:func:`check_prepared_for_model`, then the manifest's sample texts through
    ``model.preprocess`` against the stored ids of the same first rows). Returns ``(dataset,
    collator, info)`` as ``tokenize_stage`` does; never falls back to tokenizing (there is no text).

    Raises:
        UserError: see :func:`check_prepared_for_model`; a model whose features are not plain token
            ids; a manifest without sample texts of a column; stored ids that differ from the
            model's preprocessing of the samples.
    """
    started = time.perf_counter()
    manifest, source = data.manifest, data.sources[0]
    where = display_path(source.label)
    check_prepared_for_model(model, manifest, where, prompts, prompts_field(source))
    roles = list(manifest.columns)
    layouts = column_layouts(model, roles)
    collator = collator_for(model, roles, pad_to_multiple_of, layouts[1]) if layouts is not None else None
    if collator is None:
        raise UserError(
            f"{where}: the model's features are not plain token ids (or it pads on the left), so it cannot "
            "train on stored token ids; train it from the text source"
        )
    dataset = data.dataset
    rows = min([len(dataset)] + [len(manifest.samples.get(r) or []) for r in roles])
    if rows == 0:
        missing = next((r for r in roles if not manifest.samples.get(r)), roles[0])
        raise UserError(
            f"{where}: the manifest holds no sample text of column {missing!r}, so its ids cannot be checked "
            "against the model; write the first rows' texts into the manifest's samples"
        )
    sample = dataset.select(range(rows))
    for role in roles:
        sample = sample.add_column(role, list(manifest.samples[role][:rows]))
    if not matches_model_preprocessing(model, collator, sample, rows=rows, prompts=manifest.prompts or None):
        raise UserError(
            f"{where}: the stored token ids of the first {rows} rows differ from the model's own preprocessing "
            "of the manifest's sample texts (another tokenizer, lower-casing or truncation); prepare the source "
            "again for this model"
        )
    info = {
        "pretokenized": True,
        "from_cache": True,
        "cache_path": str(source.label),
        "prepared": manifest.fingerprint,
        "seconds": round(time.perf_counter() - started, 3),
    }
    return dataset, collator, info
