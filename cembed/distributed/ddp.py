"""DistributedDataParallel without unused-parameter detection: parameters that never receive a
gradient (the BERT pooler under mean pooling) are found with one small forward/backward before
training and frozen (:func:`freeze_unused_parameters`), so DDP runs without
``find_unused_parameters`` (no per-forward graph walk, and an error rather than silence if a
parameter is ever skipped).
"""

from __future__ import annotations

import torch


def unused_parameters(model, texts: list[str] | dict[str, list[str]], tasks: dict[str, str] | None = None) -> list[str]:
    """Names of the trainable parameters of ``model`` that receive no gradient when it embeds ``texts``.

    One forward per column and one backward of their sum (a row or two per column suffice: which
    parameters are reached does not depend on the text, but it can depend on the column, e.g. a
    Router sending queries and documents through different modules). The RNG state (dropout) and
    existing ``.grad`` values are restored afterwards.

    Args:
        model: a SentenceTransformer (not DDP-wrapped).
        texts: sample texts of every column (column -> texts, e.g. ``dataset[:1]``), or one list.
        tasks: column -> the task (Router route) the column is embedded with, when it has one.

    Returns:
        Parameter names as in ``model.named_parameters()``; empty when every parameter is used.
    """
    from sentence_transformers.util import batch_to_device

    columns = texts if isinstance(texts, dict) else {"texts": list(texts)}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in params]
    for _, p in params:
        p.grad = None
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            total = 0
            for column, column_texts in columns.items():
                task = (tasks or {}).get(column)
                kwargs = {"task": task} if task else {}
                features = batch_to_device(model.preprocess(list(column_texts), **kwargs), model.device)
                total = total + model(features)["sentence_embedding"].float().sum()
            total.backward()
        unused = [n for n, p in params if p.grad is None]
    finally:
        for (_, p), grad in zip(params, saved):
            p.grad = grad
    return unused


def freeze_unused_parameters(model, texts: list[str] | dict[str, list[str]]) -> list[str]:
    """Freeze (``requires_grad=False``) the parameters :func:`unused_parameters` finds, and return
    their names. Frozen parameters keep their values, which is what training would have done to
    them anyway (no gradient, so neither an update nor, in AdamW, weight decay)."""
    names = unused_parameters(model, texts)
    wanted = set(names)
    for name, param in model.named_parameters():
        if name in wanted:
            param.requires_grad_(False)
    return names
