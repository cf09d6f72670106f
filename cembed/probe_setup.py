"""What a probe trial measured: the training setup of the model it ran, and what it could not measure.

A trial loads the model as training does (:func:`cembed.model.load_model`: fp32 master weights,
``model.lora`` adapters, ``model.gradient_checkpointing``) and runs its step under the run's
autocast, so bf16/fp16, LoRA and checkpointing are in the measured peak. FSDP is not: a trial is
one process holding the whole model, so with ``distributed.strategy: fsdp`` the measured peak is an
upper bound on each rank's (FSDP keeps ``1 / ranks`` of the parameters, gradients and optimizer
states per rank, plus one layer's gathered parameters at a time).
"""

from __future__ import annotations

from cembed.model import resolve_device
from cembed.precision import resolve_precision

# AdamW keeps two fp32 moments per trainable parameter (torch.optim.AdamW, exp_avg and exp_avg_sq).
ADAMW_STATES = 2


def trial_setup(model, precision: str) -> dict:
    """The setup a trial's step ran with, read from the loaded ``model`` (a SentenceTransformer).

    Returns:
        ``{"weights_dtype", "autocast", "parameters", "trainable_parameters", "lora",
        "gradient_checkpointing", "state_bytes"}``: the parameters' dtype (e.g. ``float32``), the
        autocast dtype (``bf16`` / ``fp16``, None for fp32), parameter counts, whether the backbone
        carries LoRA adapters, whether any module recomputes activations in backward (transformers
        sets ``gradient_checkpointing`` on the blocks it checkpoints), and the bytes of parameters,
        their gradients and AdamW states (``ADAMW_STATES`` fp32 tensors per trainable parameter).
    """
    from cembed.lora import is_lora

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    adam_bytes = ADAMW_STATES * 4 * sum(p.numel() for p in trainable)
    return {
        "weights_dtype": str(params[0].dtype).removeprefix("torch.") if params else None,
        "autocast": precision if precision in ("bf16", "fp16") else None,
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
        ranks = measured.get("ranks") or 1
        held = measured["state_bytes"]
        saved = f"saves {_bytes(held - held // ranks)} on each of {ranks} ranks" if ranks > 1 else "keeps 1/ranks of it"
        lines.append(
            "not measured: FSDP sharding (distributed.strategy: fsdp); each trial held the whole model "
            f"({_bytes(held)} of parameters, gradients and AdamW states), FSDP {saved}, so a rank's peak is at "
            "most the measured one and the recommendation is conservative"
        )
    return lines


def resolved_model_config(model_cfg):
    """``model_cfg`` (a :class:`cembed.config.ModelConfig`) with ``precision: auto`` replaced by the
    precision it resolves to on ``model_cfg.device`` (``probe-minibatch`` without a plan).

    Raises:
        UserError: see :func:`resolve_precision`; cuda requested without a GPU.
    """
    resolved = resolve_precision(model_cfg.precision, resolve_device(model_cfg.device))
    return model_cfg.model_copy(update={"precision": resolved.precision})
