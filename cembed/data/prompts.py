"""The prompts training prepends, resolved per source (``data.train.<name>.prompts`` over ``data.prompts`` over the model's)."""

from __future__ import annotations

from typing import Any, NamedTuple

from cembed.data.rows import TrainingData


def resolve_source_prompts(data: TrainingData, model, run_prompts) -> list | None:
    """Each source's prompts (:class:`cembed.model.prompts.RolePrompts`, in ``data.sources`` order)
    when a source sets its own (``data.train.<name>.prompts``, role by role over ``data.prompts``,
    then the model's own); None when none does (every source trains with ``run_prompts``).

    Raises:
        ModelRefused: a source's ``{name: ...}`` names no prompt of the model (the message names
            ``data.train.<name>.prompts.<role>``).
    """
    if not any(s.prompts is not None for s in data.sources):
        return None
    return [run_prompts if s.prompts is None else _own_prompts(s, model) for s in data.sources]


def _own_prompts(source, model):
    """A source's resolved prompts, each role's origin the field that set it: the source's own
    prompts, else ``data.prompts`` (its prompts are the two merged)."""
    from dataclasses import replace

    from cembed.model.prompts import resolve_prompts

    resolved = resolve_prompts(source.prompts, model, where=f"{source.key}.prompts")
    own = f"{source.key}.prompts."
    origin = {
        role: f"data.prompts.{field[len(own) :]}"
        if field.startswith(own) and field[len(own) :] not in source.own_prompt_roles
        else field
        for role, field in resolved.origin.items()
    }
    return replace(resolved, origin=origin)


class TrainingPrompts(NamedTuple):
    """The prompts training tokenizes with (:func:`training_prompts`).

    Attributes:
        run: the run-wide :class:`cembed.model.prompts.RolePrompts` (``data.prompts``, else the model's).
        per_source: each source's RolePrompts (``data.sources`` order), or None when no source sets its own.
        columns: ``{role column: prompt}`` of ``run`` for ``data.columns``.
        by_source: ``{role column: prompt}`` per source (its own columns), or None.
    """

    run: Any
    per_source: list | None
    columns: dict[str, str]
    by_source: list[dict[str, str]] | None


def training_prompts(data: TrainingData, model, prompts_cfg) -> TrainingPrompts:
    """Resolve the prompts training prepends, run-wide and per source, in one place, so that training
    (``build_components``) and the sampler's duplicate check in ``validate`` tokenize alike.

    Raises:
        ModelRefused: ``data.prompts`` or a source's prompts name no prompt of the model.
    """
    from cembed.model.prompts import resolve_prompts

    run = resolve_prompts(prompts_cfg, model)
    per_source = resolve_source_prompts(data, model, run)
    by_source = None
    if per_source is not None:
        by_source = [p.for_columns(c) for p, c in zip(per_source, data.source_columns())]
    return TrainingPrompts(run, per_source, run.for_columns(data.columns), by_source)


def prompt_room_error(data: TrainingData, model, prompts: TrainingPrompts) -> str | None:
    """Why a prompt leaves no token of its texts at the model's ``max_seq_length`` (every text of the
    role would be the prompt alone, so the no-duplicates sampler finds them all equal), or None.

    A prompt takes its own tokens and the special tokens the tokenizer adds around a text (the
    tokenizer on the prompt alone, not truncated: sentence-transformers' ``prompt_length`` stops at
    ``max_seq_length``); at or above ``max_seq_length`` the text is cut away. The first such
    (source, role column) is named: the prompt's field (``data.prompts.<role>``,
    ``data.train[.<name>].prompts.<role>`` or the model's prompt), the prompt, its tokens, the length,
    the column and the source.
    """
    from cembed.files import display_path

    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return None
    length = int(model.max_seq_length)
    per_source = prompts.per_source or [prompts.run] * len(data.sources)
    for source, role_prompts, columns in zip(data.sources, per_source, data.source_columns()):
        for column, prompt in role_prompts.for_columns(columns).items():
            used = len(tokenizer(prompt)["input_ids"])
            if used < length:
                continue
            role = "negatives" if column.startswith("negative_") else column
            field = role_prompts.origin.get(role, f"data.prompts.{role}")
            return (
                f"{field} {prompt!r}: {used} tokens with the model's special tokens, max_seq_length {length}, "
                f"so no token of the {column} texts of {display_path(source.label)} is left (each is the prompt "
                "alone, and the no-duplicates sampler finds them all equal); shorten the prompt or raise "
                f"model.max_seq_length above {used}"
            )
    return None
