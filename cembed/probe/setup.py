"""What a probe trial measured: the training setup of the model it ran, and what it could not measure.

A trial loads the model as training does (:func:`cembed.model.load.load_model`: fp32 master weights,
``model.lora`` adapters, ``model.gradient_checkpointing``) and runs its step under the run's
autocast, so bf16/fp16, LoRA and checkpointing are in the measured peak. FSDP is not: a trial is
one process holding the whole model, so with ``distributed.strategy: fsdp`` the measured peak is an
upper bound on each rank's. FSDP keeps ``1 / ranks`` of the gradients and optimizer states per rank,
but not of the parameters at the peak: the cached loss replays each mini-batch's forward inside the
backward, where FSDP2 does not reshard (``FSDPParamGroup.post_forward``), so every parameter is
gathered during the replay, on top of the rank's own shard (measured: ``scripts/bench_fsdp.py``).
"""

from __future__ import annotations

from cembed.plan.precision import uses_autocast

# AdamW keeps two fp32 moments per trainable parameter (torch.optim.AdamW, exp_avg and exp_avg_sq).
ADAMW_STATES = 2


def trial_setup(model, precision: str) -> dict:
    """The setup a trial's step ran with, read from the loaded ``model`` (a SentenceTransformer).

    Returns:
        ``{"weight_bytes", "grad_bytes", "optimizer_bytes", "weights_dtype", "autocast", "parameters",
        "trainable_parameters", "lora", "gradient_checkpointing", "state_bytes"}``: the bytes of the
        parameters, of their gradients and of the AdamW states (``ADAMW_STATES`` fp32 tensors per
        trainable parameter), the parameters' dtype (e.g. ``float32``), the autocast dtype (``bf16`` /
        ``fp16``, None for fp32), parameter counts, whether the backbone carries LoRA adapters,
        whether any module recomputes activations in backward (transformers sets
        ``gradient_checkpointing`` on the blocks it checkpoints), and the three byte counts' sum.
    """
    from cembed.model.lora import is_lora

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    adam_bytes = ADAMW_STATES * 4 * sum(p.numel() for p in trainable)
    return {
        "weight_bytes": weight_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": adam_bytes,
        "weights_dtype": str(params[0].dtype).removeprefix("torch.") if params else None,
        "autocast": precision if uses_autocast(precision) else None,
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "lora": is_lora(model),
        "gradient_checkpointing": any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()),
        "state_bytes": weight_bytes + grad_bytes + adam_bytes,
    }


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fsdp_saved_bytes(measured: dict, ranks: int) -> int:
    """Bytes a rank holds less under FSDP than the whole-model trial, at the replay's peak: the
    gradients and AdamW states are sharded (``(1 - 1/ranks)`` of them saved), the parameters are all
    gathered during the replay on top of the rank's ``1/ranks`` shard (``weight_bytes / ranks`` more).
    Negative when sharding costs more than it saves (LoRA: the trainable state is small)."""
    sharded = measured["grad_bytes"] + measured["optimizer_bytes"]
    return sharded - sharded // ranks - measured["weight_bytes"] // ranks


def _fsdp_saving(measured: dict) -> str:
    ranks = measured.get("ranks") or 1
    head = f"each trial held the whole model ({_bytes(measured['state_bytes'])} of parameters, gradients and AdamW states); "
    why = "gradients and AdamW states sharded, every parameter gathered during the cached loss's replay"
    if ranks < 2:
        return (
            head + f"under FSDP a rank holds less by (1 - 1/ranks) x (gradients + AdamW) - parameters / ranks ({why})"
        )
    saved = fsdp_saved_bytes(measured, ranks)
    if saved < 0:
        return (
            head
            + f"over {ranks} ranks a rank holds {_bytes(-saved)} MORE than measured at the peak ({why}): leave that headroom"
        )
    return (
        head
        + f"over {ranks} ranks a rank holds {_bytes(saved)} less at the peak ({why}), so the recommendation is conservative"
    )


def describe_setup(measured: dict) -> list[str]:
    """Lines saying what the probe measured and what it did not, from ``ProbeResult.measured``
    (:func:`trial_setup`'s dict plus ``strategy`` and ``ranks``); empty when no trial reported."""
    if not measured.get("weights_dtype"):
        return []
    precision = (
        f"{measured['autocast']} autocast over {measured['weights_dtype']} master weights"
        if measured["autocast"]
        else f"{measured['weights_dtype']} weights, no autocast"
    )
    parts = [precision]
    if measured["lora"]:
        parts.append(
            f"LoRA adapters ({measured['trainable_parameters']:,} of {measured['parameters']:,} parameters trainable: "
            "gradients and AdamW states for those only)"
        )
    else:
        parts.append(f"all {measured['parameters']:,} parameters trainable")
    parts.append("gradient checkpointing " + ("on" if measured["gradient_checkpointing"] else "off"))
    lines = ["measured with: " + "; ".join(parts)]
    if measured.get("strategy") == "fsdp":
        lines.append("not measured: FSDP sharding (distributed.strategy: fsdp); " + _fsdp_saving(measured))
    return lines
