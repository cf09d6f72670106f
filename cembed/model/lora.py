"""LoRA adapters through ``peft`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models", arXiv:2106.09685): the transformer's weights stay frozen and only the low-rank updates
``(alpha / r) * B @ A`` train.

The sentence-transformers ``Transformer`` module's backbone is wrapped in a ``peft.PeftModel``
(composition: the module calls it as before). Consequences cembed relies on:

* the trainer's optimizer sees only the adapter parameters (the others have ``requires_grad``
  False), and a checkpoint holds only the adapter (``PeftModel.save_pretrained`` writes
  ``adapter_model.safetensors``), which :func:`load_adapter_checkpoint` loads on resume;
* LoRA dropout draws from torch's RNG, which the cached loss's per-mini-batch RNG replay restores,
  so the cached loss stays exact with dropout on (tested);
* the final model is merged into plain weights (``model.lora.merge: true``, the default: a folder
  any sentence-transformers loads), or saved as the adapter folder.
"""

from __future__ import annotations

from pathlib import Path

from cembed.errors import UserError

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft():
    try:
        import peft
    except ImportError:
        raise UserError("model.lora needs the peft package: pip install 'cembed[lora]' (or pip install peft)") from None
    return peft


def backbone_holder(model):
    """The sentence-transformers Transformer module of ``model`` (its first module)."""
    return model[0]


def is_lora(model) -> bool:
    """Whether ``model``'s backbone is wrapped with LoRA adapters by :func:`apply_lora`."""
    return type(backbone_holder(model).model).__name__.startswith("Peft")


def apply_lora(model, options, seed: int = 0) -> None:
    """Wrap ``model``'s backbone with LoRA adapters; afterwards only the adapters require grad.

    Args:
        model: a SentenceTransformer whose first module is a Transformer.
        options: :class:`cembed.config.schema.LoraOptions` (r, alpha, dropout, target_modules).
        seed: seeds the adapters' random initialisation (A ~ Kaiming uniform, B = 0) without touching
            the global RNG, so a run (and its resume) starts from the same adapters.

    Raises:
        UserError: peft is not installed, or no module matches ``model.lora.target_modules``.
    """
    peft = _peft()
    holder = backbone_holder(model)
    config = peft.LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=options.target_modules,
        bias="none",
    )
    import torch

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            holder.model = peft.get_peft_model(holder.model, config)
    except ValueError as err:
        raise UserError(f"model.lora.target_modules: {err}".splitlines()[0]) from None


def parameter_counts(model) -> dict[str, int]:
    """``{"trainable": n, "total": n}`` parameters of ``model`` (counts, not bytes)."""
    params = list(model.parameters())
    return {"trainable": sum(p.numel() for p in params if p.requires_grad), "total": sum(p.numel() for p in params)}


def adapter_facts(model) -> dict:
    """Adapter vs full model size for the run summary: parameter counts and fp32 bytes."""
    counts = parameter_counts(model)
    return {
        "adapter_parameters": counts["trainable"],
        "total_parameters": counts["total"],
        "adapter_bytes": counts["trainable"] * 4,
        "full_bytes": counts["total"] * 4,
    }


def load_adapter_checkpoint(model, checkpoint_dir: str | Path) -> None:
    """Load the adapter weights a checkpoint holds into ``model``'s adapters (resume).

    Raises:
        UserError: the checkpoint has no adapter weights file.
    """
    from safetensors.torch import load_file

    path = Path(checkpoint_dir)
    found = sorted(path.rglob(ADAPTER_WEIGHTS))
    if not found:
        raise UserError(f"{path}: no {ADAPTER_WEIGHTS} in this checkpoint; it was not written by a model.lora run")
    holder = backbone_holder(model)
    state = load_file(str(found[0]), device=str(next(holder.model.parameters()).device))
    _peft().set_peft_model_state_dict(holder.model, state)


def finish_lora(model, merge: bool) -> None:
    """Before the final save: merge the adapters into the weights (``merge``) so the folder is a
    plain sentence-transformers model; otherwise keep the adapter (the folder holds only it)."""
    if merge and is_lora(model):
        holder = backbone_holder(model)
        holder.model = holder.model.merge_and_unload()
