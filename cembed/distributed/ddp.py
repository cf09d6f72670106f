"""DistributedDataParallel without unused-parameter detection: parameters that never receive a
gradient (the BERT pooler under mean pooling) are found with one small forward/backward before
training and frozen (:func:`freeze_parameters`), so DDP runs without
``find_unused_parameters`` (no per-forward graph walk, and an error rather than silence if a
parameter is ever skipped). A run that began on one process keeps them in its optimizer: resumed on
several, DDP ignores them instead (:func:`ignore_in_ddp`), so the optimizer state loads as it is.
"""

from __future__ import annotations

from typing import Callable

import torch


def unused_parameters(
    model,
    texts: list[str] | dict[str, list[str]],
    tasks: dict[str, str] | None = None,
    outputs: Callable[[dict], list] | None = None,
) -> list[str]:
    """Names of the trainable parameters of ``model`` that receive no gradient when it embeds ``texts``.

    One forward per column and one backward of their sum (a row or two per column suffice: which
    parameters are reached does not depend on the text, but it can depend on the column, e.g. a
    Router sending queries and documents through different modules). The RNG state (dropout) and
    existing ``.grad`` values are restored afterwards.

    Args:
        model: a SentenceTransformer (not DDP-wrapped).
        texts: sample texts of every column (column -> texts, e.g. ``dataset[:1]``), or one list.
        tasks: column -> the task (Router route) the column is embedded with, when it has one.
        outputs: what each text became, from the forward's output dict (the model kind's
            ``text_outputs``); None: its ``sentence_embedding`` rows (a dense model).

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
                out = model(features)
                rows = outputs(out) if outputs is not None else [out["sentence_embedding"]]
                total = total + sum(r.float().sum() for r in rows)
            total.backward()
        unused = [n for n, p in params if p.grad is None]
    finally:
        for (_, p), grad in zip(params, saved):
            p.grad = grad
    return unused


def freeze_parameters(model, names: list[str]) -> None:
    """Set ``requires_grad=False`` on the parameters of ``model`` named ``names``."""
    wanted = set(names)
    for name, param in model.named_parameters():
        if name in wanted:
            param.requires_grad_(False)


def ignore_in_ddp(model, names: list[str]) -> None:
    """Have DistributedDataParallel skip the parameters ``names`` (no gradient bucket, no reduction,
    no unused-parameter error) while they stay trainable: what a run that began on one process needs
    on several, its optimizer state holding them (they never get a gradient, so never an update)."""
    from torch.nn.parallel import DistributedDataParallel

    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
