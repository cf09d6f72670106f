"""One probe trial's work: the memory worst case of a cached-loss training step.

:func:`worst_case_step` runs one step at a ``mini_batch_size`` (rows) or a ``mini_batch_num_tokens``
(cembed's token budget, :mod:`cembed.losses.token_budget`) with every text at ``max_seq_length`` tokens,
and returns a :class:`WorstCase` (throughput, the rows of its mini-batch, the tokens per row). The
runners that measure its peak memory are in :mod:`cembed.probe.trials`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from functools import partial

from cembed.plan.precision import autocast as precision_autocast


@dataclass
class WorstCase:
    """What a worst-case step ran.

    Attributes:
        samples_per_s: estimated training rows per second of a full cached step.
        rows: rows in its (first, largest) mini-batch.
        tokens_per_row: the padded width of every row, tokens (``max_seq_length``, or less when the
            tokenizer stops earlier).
    """

    samples_per_s: float
    rows: int
    tokens_per_row: int
    setup: dict | None = None  # cembed.probe.setup.trial_setup: precision, LoRA, checkpointing, state bytes


def worst_case_step(
    model,
    loss_cfg,
    n_columns: int,
    batch_size: int,
    mini_batch_size: int,
    precision: str,
    repeats: int = 2,
    world_size: int = 1,
    sort_by_length: bool = True,
    mini_batch_num_tokens: int | None = None,
) -> WorstCase:
    """Run the memory worst case of one cached-loss training step at ``mini_batch_size`` rows, or
    at a token budget ``mini_batch_num_tokens``.

    What is alive at the peak is what training holds: AdamW states (allocated by a real step), the
    tokenized features of the whole batch (``n_columns`` x ``batch_size`` x ``max_seq_length``, every
    text at full length), the cached embeddings of the whole batch and their gradients (from the
    library's ``calculate_loss(..., with_backward=True)``, chunked by ``mini_batch_size`` as in
    training), one mini-batch re-embedded with gradients and back-propagated into the parameters'
    gradients, and the optimizer step. The no-grad embedding pass is run for one mini-batch only (its
    activations are freed mini-batch by mini-batch, so it never exceeds the with-grad pass) and its
    output is replicated to fill the batch.

    The loss stage is the one training runs, whatever loss the config builds (a guide model loaded and
    its embeddings alive; a Matryoshka wrapper's loss per dimension): outside autocast (the trainer autocasts only the
    model's forward, so the scores are fp32), over ``world_size`` x ``batch_size`` gathered
    candidates per column (the gather is simulated with local copies, so a trial issues no
    collective), and, with ``sort_by_length``, with the sorted copy of the features and the
    restored-order leaves of :class:`cembed.losses.length_sorted.LengthSortedMixin` alive.

    With ``mini_batch_num_tokens`` the loss is built with that budget and the mini-batch is the
    first of the budget's ranges on these full-length rows (``budget // tokens_per_row`` rows, at
    least 1): the longest rows are the budget's worst case (a mini-batch of shorter rows has at most
    as many positions and a smaller attention matrix per row).

    Args:
        model: a SentenceTransformer on the target device (its ``max_seq_length`` is the length used).
        loss_cfg: the ``loss`` config section, of a loss that ``uses_gradient_cache`` (the module
            :func:`cembed.losses.registry.build_loss` builds from it, its
            :attr:`~cembed.losses.registry.BuiltLoss.cached_module`, provides ``embed_minibatch_iter`` and
            ``calculate_loss``).
        n_columns: texts per row (anchor, positive, negatives), >= 2.
        batch_size: ``per_device_train_batch_size``, rows.
        mini_batch_size: rows embedded at once.
        precision: fp32 | bf16 | fp16 (autocast, as the trainer runs it).
        repeats: no-grad and with-grad mini-batch passes run; the fastest of each is timed (>= 1).
        world_size: ranks whose candidates each rank's loss scores (1 without gathering).
        sort_by_length: the loss sorts each column by length (a sorted copy of the features).
        mini_batch_num_tokens: token positions per mini-batch (then ``mini_batch_size`` only
            cuts columns without an attention mask, as in training).

    Returns:
        A :class:`WorstCase`: the estimated rows per second of a full cached step (``n_columns``
        no-grad and with-grad embeddings per row plus the loss stage), the mini-batch's rows and the
        tokens per row, and the setup it ran with (:func:`cembed.probe.setup.trial_setup`).

    Raises:
        TypeError: the configured loss does not use gradient caching (it has no mini-batches).
    """
    import torch

    from cembed.losses.registry import build_loss
    from cembed.losses.token_budget import token_budget_ranges
    from cembed.probe.setup import trial_setup

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    autocast = partial(precision_autocast, precision, model.device.type)  # as the trainer runs the forward
    model.train()
    optimizer = allocated_optimizer(model)
    features = full_length_features(model, n_columns, batch_size)
    loss = build_loss(
        model, loss_cfg, mini_batch_size, world_size > 1, mini_batch_num_tokens, sort_by_length=sort_by_length
    ).cached_module
    if loss is None:
        raise TypeError(f"loss {loss_cfg.name!r} does not use gradient caching: the probe measures cached losses")
    # training holds the features and their sorted copy; the loss stage then builds its restored-order leaves
    sorted_copies = loss.sort_rows(features) if getattr(loss, "sort_by_length", False) else None
    width = max(int(f.get("attention_mask", f["input_ids"]).shape[1]) for f in features)
    if mini_batch_num_tokens is not None:  # the budget's first range over the longest column's full-length rows
        mini_batch_size = min(token_budget_ranges(f, mini_batch_num_tokens)[0][1] for f in features)
    mini = min(mini_batch_size, batch_size)
    repeats = max(1, repeats)
    t_nograd, outputs = time_nograd_pass(loss, features[0], mini, repeats, autocast, sync)
    sizes = [min(b + mini, batch_size) - b for b in range(0, batch_size, mini)]
    replicate = getattr(loss, "replicate_minibatch", None)
    reps, *extras = cached_embeddings(outputs, sizes, n_columns, replicate)
    for col in range(1, n_columns):  # a column tokenized otherwise (a multi-vector query vs its documents)
        if not torch.equal(features[col]["input_ids"], features[0]["input_ids"]):
            with autocast():
                own = first_minibatch(loss, features[col], mini, with_grad=False)[:-1]
            for cache, cut in zip([reps, *extras], cached_embeddings(own, sizes, 1, replicate)):
                cache[col] = cut[0]
            del own
    del outputs
    t_loss = time_loss_stage(loss, reps, extras, world_size, sync)
    t_grad = time_grad_passes(loss, features, reps, mini, repeats, autocast, sync)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    del reps, extras, features, sorted_copies, optimizer, loss
    per_row = n_columns * (t_nograd + t_grad) / mini + t_loss / batch_size
    setup = trial_setup(model, precision)
    return WorstCase(float(1.0 / per_row) if per_row > 0 else float("nan"), mini, width, setup)


# ----------------------------------------------------------------------------------------------
# The steps of a worst-case step, in the order it runs them


def allocated_optimizer(model):
    """An AdamW over ``model``'s trainable parameters whose states are allocated, as the first real
    step allocates them (one zero-gradient step at learning rate 0: the weights do not change).

    Returns:
        The optimizer, gradients reset to None.
    """
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)
    for p in params:  # a zero step allocates the AdamW states exactly as the first real step does
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def full_length_features(model, n_columns: int, batch_size: int) -> list[dict]:
    """``n_columns`` columns of ``batch_size`` rows, every text tokenized to its column's full length
    (``model.max_seq_length``; a multi-vector model's query / document length, as its kind tokenizes each
    column: :meth:`cembed.model.kinds.registry.ModelKind.preprocess_kwargs`), on the model's device.

    Returns:
        One feature dict per column, tensors of shape ``(batch_size, tokens)`` (contiguous copies).
    """
    import torch

    from cembed.model.kinds.lookup import kind_of

    kind = kind_of(model, default="dense")
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    longest = [
        "a " * (4 * max(model.max_seq_length, *(kind.token_layout(model, i).max_length for i in range(n_columns))) + 8)
    ]
    columns = [preprocess(longest, **kind.preprocess_kwargs(i)) for i in range(n_columns)]  # truncated per column
    return [
        {
            k: v.expand(batch_size, *v.shape[1:]).contiguous().to(model.device) if torch.is_tensor(v) else v
            for k, v in one.items()
        }
        for one in columns
    ]


def first_minibatch(loss, feature: dict, mini: int, with_grad: bool) -> tuple:
    """The loss's embedding of ``feature``'s first ``mini`` rows, through its mini-batch iterator
    (``embed_minibatch_iter``) as training embeds them: on packs where the loss packs.

    Returns:
        The iterator's item: ``(embeddings (mini, dim), [guide embeddings,] random state)``.
    """
    return next(loss.embed_minibatch_iter(feature, with_grad, False, ranges=[(0, mini)]))


def time_nograd_pass(loss, feature: dict, mini: int, repeats: int, autocast, sync) -> tuple[float, tuple]:
    """Run the no-grad embedding of the first ``mini`` rows of ``feature`` ``repeats`` times under
    ``autocast`` (the first run warms up).

    Returns:
        ``(fastest seconds, outputs)``: the last run's embeddings ``(mini, dim)`` and, for a guided
        loss, the guide's embeddings (the outputs before the RNG state).
    """
    t_nograd = math.inf
    with autocast():
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            emb, *extras, _ = first_minibatch(loss, feature, mini, with_grad=False)
            sync()
            t_nograd = min(t_nograd, time.perf_counter() - t0)
    return t_nograd, (emb, *extras)


def cached_embeddings(outputs: tuple, sizes: list[int], n_columns: int, replicate=None) -> list[list[list]]:
    """The whole batch's cached embeddings, replicated from one mini-batch's ``outputs``: per output
    (the model's, then a guide's, or a multi-vector loss's row token counts), per column, one tensor per
    mini-batch of ``sizes`` rows (as accelerate returns them); the model's require gradients (the
    GradCache cache). ``replicate``: the loss's own cut of one mini-batch's outputs
    (``LengthSortedMixin.replicate_minibatch``); None: fp32 copies of the first ``n`` rows."""
    if replicate is None:
        replicate = lambda outs, sizes: [[e.detach().float()[:n] for n in sizes] for e in outs]  # noqa: E731
    per_output = replicate(outputs, sizes)
    reps, *extras = [[[t.clone() for t in cut] for _ in range(n_columns)] for cut in per_output]
    [r.requires_grad_() for col in reps for r in col]
    return [reps, *extras]


def time_loss_stage(loss, reps, extras, world_size: int, sync) -> float:
    """Seconds of the loss stage with its backward into the cached embeddings
    (``calculate_loss(..., with_backward=True)``), outside autocast as in training, over
    ``world_size`` ranks' candidates (:func:`simulated_gather`)."""
    sync()
    t0 = time.perf_counter()
    with simulated_gather(loss, world_size):  # outside autocast, as in training
        loss.calculate_loss(reps, *(extras or [None]), with_backward=True)
    sync()
    return time.perf_counter() - t0


def time_grad_passes(loss, features, reps, mini: int, repeats: int, autocast, sync) -> float:
    """The fastest of ``repeats`` with-grad re-embeddings of one mini-batch (cycling over the
    columns) back-propagated with the cached gradients into the parameters' gradients, seconds."""
    import torch

    t_grad = math.inf
    for i in range(repeats):
        col = i % len(features)
        sync()
        t0 = time.perf_counter()
        with autocast():
            reps_mb = first_minibatch(loss, features[col], mini, with_grad=True)[0]
        surrogate = torch.dot(reps_mb.flatten().float(), reps[col][0].grad.flatten().float())
        surrogate.backward()
        sync()
        t_grad = min(t_grad, time.perf_counter() - t0)
        del reps_mb, surrogate
    return t_grad


@contextlib.contextmanager
def simulated_gather(loss, world_size: int):
    """Inside the block, ``loss``'s cross-rank gathers (``all_gather_with_grad`` / ``all_gather``, and
    ``gather_rows`` / ``rank_and_world`` of a ragged cache, as its modules imported them) return
    ``world_size`` local copies of the tensor instead of gathering: the memory of ``world_size`` ranks'
    candidates, with gradients, and no collective (probe trials run a different number of times on
    different ranks)."""
    import torch

    def copies(tensor, *args, **kwargs):
        return torch.cat([tensor] * world_size)

    def ragged_copies(tensor):  # cembed.distributed.ragged.gather_rows: (rows of every rank, each rank's count)
        return copies(tensor), [tensor.shape[0]] * world_size

    stand_ins = {
        "all_gather_with_grad": copies,
        "all_gather": copies,
        "gather_rows": ragged_copies,
        "rank_and_world": lambda: (0, world_size),
    }
    patched = []
    for cls in type(loss).__mro__:
        module = sys.modules.get(cls.__module__)
        for name, stand_in in stand_ins.items():
            if module is not None and callable(getattr(module, name, None)):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, stand_in)
    try:
        yield
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)
