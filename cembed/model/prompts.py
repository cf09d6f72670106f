"""Prompts: the text prepended to each role's texts (E5/BGE/nomic-style ``"query: "`` / ``"passage: "``).

One resolution, used by training (pre-tokenization or sentence-transformers' collator), evaluation
during training and ``cembed eval``, and ``cembed mine-negatives``: :func:`resolve_prompts` turns the
``data.prompts`` config and the model's own prompts into one prompt string per role. The anchor's
prompt is the *query* prompt (queries of a retrieval set), the positive's the *document* prompt (its
corpus).

sentence-transformers conventions followed: a model's prompts are ``model.prompts`` (name -> text,
from ``config_sentence_transformers.json``); ``encode_query`` uses the prompt named ``query``,
``encode_document`` the one named ``document``, ``passage`` or ``corpus``; ``model.encode`` the
``default_prompt_name`` one. A prompt is prepended to the text before tokenization and its token
count (``prompt_length``) travels with the features, so ``Pooling(include_prompt=False)`` leaves the
prompt's tokens out of the mean.

The prompts a run trains with are written into the trained model's own prompts
(:func:`set_trained_prompts`: ``query`` = the anchor's, ``document`` = the positive's, in
``config_sentence_transformers.json``), so the saved model encodes queries and documents as it was
trained without being told the prompts again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cembed.config.prompts import PromptName, PromptsConfig, PromptText
from cembed.errors import ModelRefused

QUERY_NAMES = ("query",)
DOCUMENT_NAMES = ("document", "passage", "corpus")  # encode_document's order


@dataclass(frozen=True)
class RolePrompts:
    """The prompt of each role ("" = none) and where each came from (for messages and the summary).

    Attributes:
        anchor: prepended to anchors and to retrieval queries.
        positive: prepended to positives and to retrieval corpora.
        negatives: prepended to every hard-negative column.
        origin: role -> ``data.prompts.<role>``, ``model prompt '<name>'``, ``model default prompt
            '<name>'`` or ``none``.
    """

    anchor: str = ""
    positive: str = ""
    negatives: str = ""
    origin: dict[str, str] = field(default_factory=dict)

    def for_column(self, column: str) -> str:
        """The prompt of a role column: ``anchor``, ``positive`` or ``negative_<i>``."""
        if column == "anchor":
            return self.anchor
        if column == "positive":
            return self.positive
        return self.negatives

    def for_columns(self, columns: list[str]) -> dict[str, str]:
        """``{column: prompt}`` for the columns that have a non-empty prompt."""
        return {c: self.for_column(c) for c in columns if self.for_column(c)}

    def to_dict(self) -> dict[str, dict[str, str]]:
        """``{role: {"prompt": text, "from": origin}}`` for ``run_summary.json``."""
        roles = {"anchor": self.anchor, "positive": self.positive, "negatives": self.negatives}
        return {role: {"prompt": text, "from": self.origin.get(role, "none")} for role, text in roles.items()}


def _model_default(prompts: dict[str, str], names: tuple[str, ...], default_name: str | None) -> tuple[str, str]:
    for name in names:
        if prompts.get(name):
            return prompts[name], f"model prompt {name!r}"
    if default_name and prompts.get(default_name):
        return prompts[default_name], f"model default prompt {default_name!r}"
    return "", "none"


def _configured(value, role: str, prompts: dict[str, str], where: str) -> str:
    if isinstance(value, PromptName):
        if value.name not in prompts:
            known = ", ".join(f"{k} ({v!r})" for k, v in prompts.items() if v) or "none"
            raise ModelRefused(
                f"{where}.{role}: the model has no prompt named {value.name!r}; its prompts: {known}. "
                "Name one of them or give the text itself"
            )
        return prompts[value.name]
    if isinstance(value, PromptText):
        return value.text
    if value in prompts and prompts[value]:
        raise ModelRefused(
            f"{where}.{role}: {value!r} is the name of the model's prompt {prompts[value]!r}; write "
            f"{{name: {value}}} to use that prompt, or {{text: {value!r}}} to prepend the literal text"
        )
    return value


def resolve_prompts(cfg: PromptsConfig | None, model, where: str = "data.prompts") -> RolePrompts:
    """One prompt string per role, from the config and the model's own prompts.

    A role set in ``cfg`` uses that: a plain string or ``{text: ...}`` is prepended verbatim,
    ``{name: ...}`` is the model's prompt of that name. An unset role takes the model's prompt for
    its side: the anchor ``query``; positives and negatives the first non-empty of ``document``,
    ``passage``, ``corpus`` (sentence-transformers' ``encode_query`` / ``encode_document`` names); else
    the model's ``default_prompt_name`` prompt (what ``model.encode`` applies); else none. Unset
    negatives take the positive's prompt.

    Args:
        cfg: the ``data.prompts`` section (None: every role unset).
        model: a SentenceTransformer (reads ``model.prompts`` and ``model.default_prompt_name``).
        where: the config path named in errors.

    Returns:
        A :class:`RolePrompts`.

    Raises:
        ModelRefused (a UserError, so ``validate`` fails on it too): ``{name: X}`` names no prompt of the model (the message lists its prompts), or a
            plain string equals one of the model's prompt names (ambiguous: the name or the text?).
    """
    prompts = {k: v for k, v in (getattr(model, "prompts", None) or {}).items() if v is not None}
    default_name = getattr(model, "default_prompt_name", None)
    cfg = cfg or PromptsConfig()
    out: dict[str, str] = {}
    origin: dict[str, str] = {}
    for role, names in (("anchor", QUERY_NAMES), ("positive", DOCUMENT_NAMES)):
        value = getattr(cfg, role)
        if value is None:
            out[role], origin[role] = _model_default(prompts, names, default_name)
        else:
            out[role], origin[role] = _configured(value, role, prompts, where), f"{where}.{role}"
    if cfg.negatives is None:
        out["negatives"], origin["negatives"] = out["positive"], origin["positive"]
    else:
        out["negatives"] = _configured(cfg.negatives, "negatives", prompts, where)
        origin["negatives"] = f"{where}.negatives"
    return RolePrompts(out["anchor"], out["positive"], out["negatives"], origin)


# The model prompt names a trained model's prompts are saved under: what encode_query and
# encode_document look up first, so the saved model encodes as it was trained.
SAVED_NAMES = {"anchor": QUERY_NAMES[0], "positive": DOCUMENT_NAMES[0]}


def set_trained_prompts(model, prompts: RolePrompts) -> dict[str, str]:
    """Write the prompts a run trains with into ``model.prompts`` (saved in
    ``config_sentence_transformers.json`` by every ``model.save``): ``query`` = the anchor's prompt,
    ``document`` = the positive's ("" when the role trains without one, so ``encode_query`` /
    ``encode_document`` do not fall back to another prompt of the model). The negatives' prompt has
    no sentence-transformers name and is not saved (it is the positive's unless
    ``data.prompts.negatives`` sets it). The model's other prompts and ``default_prompt_name`` are
    kept. With per-source prompts (``data.train.<name>.prompts``) the run-wide ones are saved
    (``data.prompts``, else the model's own): a source's own instruction is the user's to give at
    encode time.

    Args:
        model: a SentenceTransformer (its ``prompts`` dict is updated in place).
        prompts: the resolved run-wide prompts (:func:`resolve_prompts`).

    Returns:
        The entries written, ``{"query": ..., "document": ...}``.
    """
    written = {name: getattr(prompts, role) for role, name in SAVED_NAMES.items()}
    current = getattr(model, "prompts", None)
    model.prompts = {**(current or {}), **written}
    return written


def prompt_lengths(model, prompts: dict[str, str]) -> dict[str, int]:
    """``{column: prompt_length}``: each prompt's token count as sentence-transformers measures it
    (``model.preprocess(..., prompt=...)["prompt_length"]``: the prompt tokenized alone, special
    tokens included, less a trailing special token). Columns whose model reports none are left out."""
    out = {}
    for column, prompt in prompts.items():
        if prompt:
            length = model.preprocess(["a"], prompt=prompt).get("prompt_length")
            if length is not None:
                out[column] = int(length)
    return out
