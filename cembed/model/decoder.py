"""Decoder LLMs (Qwen2/Qwen3, Llama, Mistral families) as embedders with last-token pooling.

A causal model's last real token is the only one that has attended to the whole text, so the
embedding is its hidden state (sentence-transformers' ``Pooling(pooling_mode="lasttoken")``, as in
E5-Mistral, Wang et al. 2023, arXiv:2401.00368, and Qwen3-Embedding). Two tokenizer facts make that
token the right one:

* the text ends with the EOS token (the models are trained that way): a tokenizer that does not add
  it gets a post-processor that does, so training, ``cembed eval`` and the saved model all append it;
* rows are right-padded: sentence-transformers' last-token pooling finds the last non-padding
  position on either side, but cembed's pre-tokenized collator and its length-sorted mini-batches
  trim trailing padding. Rotary position embeddings depend on relative positions only, so the
  embedding of a row does not depend on the padding side (tested).
"""

from __future__ import annotations

from cembed.errors import UserError


def uses_last_token_pooling(model) -> bool:
    """Whether any Pooling module of the SentenceTransformer ``model`` pools the last token."""
    for module in model:
        mode = getattr(module, "pooling_mode", None)
        modes = (mode,) if isinstance(mode, str) else tuple(mode or ())
        if "lasttoken" in modes:
            return True
    return False


def appends_eos(tokenizer) -> bool:
    """Whether ``tokenizer`` ends an encoded text with its EOS token."""
    eos = tokenizer.eos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return eos is not None and len(ids) > 0 and ids[-1] == eos


def append_eos(tokenizer) -> None:
    """Make the fast ``tokenizer`` append its EOS token to every text (kept by ``save_pretrained``:
    the post-processor is part of ``tokenizer.json``). Uses the tokenizer's own ``add_eos_token``
    switch where it has one (Llama family), else adds a ``TemplateProcessing`` step after the
    existing post-processor.

    Raises:
        UserError: a slow (Python) tokenizer, whose post-processing cannot be changed.
    """
    if hasattr(tokenizer, "add_eos_token"):
        try:
            tokenizer.add_eos_token = True
        except (AttributeError, ValueError):
            pass
        if appends_eos(tokenizer):
            return
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError(
            "model.pooling lasttoken: the tokenizer is a slow one and does not add the EOS token; "
            "use a model with a fast tokenizer (tokenizer.json)"
        )
    from tokenizers import processors

    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    template = processors.TemplateProcessing(
        single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1", special_tokens=[(eos, eos_id)]
    )
    old = backend.post_processor
    backend.post_processor = template if old is None else processors.Sequence([old, template])


def prepare_last_token_model(model) -> dict[str, str]:
    """Set up ``model``'s tokenizer for last-token pooling, in place; nothing for other poolings.

    EOS appended when the tokenizer does not add it, the EOS token as padding token when it has
    none, and right padding. A tokenizer without an EOS token (an encoder's, e.g. BERT's ending in
    [SEP]) keeps its own last token.

    Returns:
        What was changed, for ``cembed validate`` and the run summary (empty: nothing).

    Raises:
        UserError: a slow tokenizer that does not append the EOS token (see :func:`append_eos`).
    """
    if not uses_last_token_pooling(model):
        return {}
    tokenizer = model.tokenizer
    changes: dict[str, str] = {}
    if tokenizer.eos_token_id is None:
        # An encoder's tokenizer (BERT: [SEP]) ends each text with its own special token; with no EOS
        # token to append, that token is the one pooled.
        changes["eos"] = "none: the tokenizer has no EOS token; its own last token is pooled"
    elif not appends_eos(tokenizer):
        append_eos(tokenizer)
        changes["eos"] = f"appended {tokenizer.eos_token!r} to every text (the tokenizer did not add it)"
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
        changes["pad_token"] = f"{tokenizer.eos_token!r} (the tokenizer had none)"
    if tokenizer.padding_side != "right":
        changes["padding_side"] = f"{tokenizer.padding_side} -> right (for length-sorted, pre-tokenized mini-batches)"
        tokenizer.padding_side = "right"
    return changes
