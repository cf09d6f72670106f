"""Prompts (instructions) prepended to a role's texts: by the model's prompt name or as text."""

from __future__ import annotations

from pydantic import (
    Field,
)

from cembed.config.base import Strict as _Strict


class PromptName(_Strict):
    """A prompt of the model, by name: a key of its ``prompts`` (``config_sentence_transformers.json``)."""

    name: str = Field(min_length=1, description="the model's prompt name, e.g. query or document")


class PromptText(_Strict):
    """A literal prompt; the YAML ``{text: ...}`` form forces literal text where a plain string
    would be refused for equalling one of the model's prompt names."""

    text: str = Field(description="prepended verbatim to every text of the role")


# A plain string is literal text; {name: ...} names a model prompt; {text: ...} is literal text.
Prompt = str | PromptName | PromptText


class PromptsConfig(_Strict):
    """Per-role prompts prepended to every text before tokenization (sentence-transformers' prompts).

    An unset role uses the model's own prompt: ``query`` for the anchor, the first non-empty of
    ``document`` / ``passage`` / ``corpus`` for positives and negatives, else the model's
    ``default_prompt_name``, else none (see :func:`cembed.model.prompts.resolve_prompts`).
    """

    anchor: Prompt | None = Field(None, description="the anchor's (query's) prompt: text, {name: ...} or {text: ...}")
    positive: Prompt | None = Field(None, description="the positive's (document's) prompt")
    negatives: Prompt | None = Field(None, description="the hard negatives' prompt (default: the positive's)")


def merged_prompts(own: PromptsConfig | None, run: PromptsConfig | None) -> PromptsConfig | None:
    """A source's prompts: each role its own (``data.train.<name>.prompts``) if set, else ``run``'s
    (``data.prompts``); None when neither sets any."""
    if own is None:
        return run
    if run is None:
        return own
    return PromptsConfig(
        **{f: getattr(own, f) if getattr(own, f) is not None else getattr(run, f) for f in PromptsConfig.model_fields}
    )
