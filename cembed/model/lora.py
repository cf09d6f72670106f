"""LoRA adapters through ``peft`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models", arXiv:2106.09685): the transformer's weights stay frozen and only the low-rank updates
``(alpha / r) * B @ A`` train.

The sentence-transformers ``Transformer`` module's backbone is wrapped in a ``peft.PeftModel``
(composition: the module calls it as before). Consequences cembed relies on:

* in the backbone only the adapters train (peft sets ``requires_grad`` False on the rest); the
  modules after it (a ``Dense`` projection after pooling, as many models have) are not LoRA's
  business and keep training. What trains is what a checkpoint restores: sentence-transformers'
  trainer saves the model with ``save_pretrained``, which writes the backbone as the adapter only
  (``adapter_model.safetensors``) and every other module into its own folder (``2_Dense/``);
  :func:`load_lora_checkpoint` loads both on resume. :func:`unsaved_trainable` names any trainable
  parameter a checkpoint would not restore, and :func:`apply_lora` refuses a model that has one, so
  a resumed run never silently restarts part of the model from the base weights;
* LoRA dropout draws from torch's RNG, which the cached loss's per-mini-batch RNG replay restores,
  so the cached loss stays exact with dropout on (tested);
* the final model is merged into plain weights (``model.lora.merge: true``, the default: a folder
  any sentence-transformers loads), or saved as the adapter folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from cembed.errors import UserError, first_line

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


# Module classes peft adapts that `all-linear` and the listing below name (transformers' GPT-2 Conv1D too).
LINEAR_CLASSES = ("Linear", "Conv1D")
# Module classes peft's LoRA adapts at all (its "Target module ... is not supported" names them); an
# entry matching a module of another class (a LayerNorm, a Dropout, a whole attention block) fails.
ADAPTABLE_CLASSES = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "MultiheadAttention")


def _matches(name: str, entry: str) -> bool:
    # peft's rule for a list entry: the module's name, or its last dotted parts
    return name == entry or name.endswith("." + entry)


def target_modules_problem(modules: dict[str, str], target_modules: list[str] | str) -> str | None:
    """Why ``model.lora.target_modules`` does not fit a backbone's ``modules`` (name -> class name, as
    ``named_modules()`` gives them), as peft matches a list entry (the module's name, or its last
    dotted parts: ``q_proj`` matches ``layers.0.self_attn.q_proj``): the entries that match no module,
    which peft would ignore while it adapts the rest; else the first entry that matches a module LoRA
    cannot adapt (:data:`ADAPTABLE_CLASSES`), on which peft fails with a message cut at the module's
    repr. None when every entry fits, or for ``all-linear`` (peft picks the linear layers itself)."""
    if isinstance(target_modules, str):
        return None
    linear = sorted({n.rsplit(".", 1)[-1] for n, kind in modules.items() if kind in LINEAR_CLASSES})
    fix = f"its linear layers are named {', '.join(linear) or 'nothing'}: name those, or use all-linear"
    missing = [t for t in target_modules if not any(_matches(n, t) for n in modules)]
    if missing:
        one = len(missing) == 1
        return (
            f"{', '.join(missing)} {'matches' if one else 'match'} no module of the model (peft would "
            f"adapt the others and skip {'it' if one else 'them'}); {fix}"
        )
    for entry in target_modules:
        other = next((n for n in modules if _matches(n, entry) and modules[n] not in ADAPTABLE_CLASSES), None)
        if other is not None:
            return (
                f"{entry} matches {modules[other]} modules ({other}), which LoRA cannot adapt (peft adapts "
                f"{', '.join(ADAPTABLE_CLASSES[:-1])} and {ADAPTABLE_CLASSES[-1]} layers); {fix}"
            )
    return None


def apply_lora(model, options, seed: int = 0) -> None:
    """Wrap ``model``'s backbone with LoRA adapters; afterwards only the adapters require grad.

    Args:
        model: a SentenceTransformer whose first module is a Transformer.
        options: :class:`cembed.config.schema.LoraOptions` (r, alpha, dropout, target_modules).
        seed: seeds the adapters' random initialisation (A ~ Kaiming uniform, B = 0) without touching
            the global RNG, so a run (and its resume) starts from the same adapters.

    Raises:
        UserError: peft is not installed, or an entry of ``model.lora.target_modules`` matches no
            module or a module LoRA cannot adapt (:func:`target_modules_problem`).
    """
    peft = _peft()
    holder = backbone_holder(model)
    modules = {name: type(module).__name__ for name, module in holder.model.named_modules() if name}
    problem = target_modules_problem(modules, options.target_modules)
    if problem is not None:
        raise UserError(f"model.lora.target_modules: {problem}")
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
    lost = unsaved_trainable(model)
    if lost:
        raise UserError(
            f"model.lora: {len(lost)} trainable parameter(s) outside the adapters that a checkpoint would not "
            f"restore on resume (first: {lost[0]}); use a model whose modules after the transformer are "
            "sentence-transformers modules, or train without model.lora"
        )


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


def _module_folder(index: int, module) -> str:
    # The folder sentence-transformers' save_pretrained writes a module into (after the first).
    return f"{index}_{type(module).__name__}"


def _restorable_module(module) -> bool:
    # A sentence-transformers Module is saved into its own folder with its weights and read back by
    # Module.load_torch_weights (strict); anything else has no weights format cembed can rely on.
    from sentence_transformers.base.modules import Module

    return isinstance(module, Module)


def unsaved_trainable(model) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the parameters that train but that a LoRA
    checkpoint would not restore on resume; ``[]`` when every trainable parameter is covered.

    Covered are: in the backbone, what peft saves as the adapter (the adapters and any
    ``modules_to_save``; the tensors of ``get_peft_model_state_dict``); after it, every parameter of
    a sentence-transformers module (saved in its own folder of the checkpoint). Without adapters
    (no :func:`apply_lora`) every parameter is saved as the full model: ``[]``.
    """
    if not is_lora(model):
        return []
    holder = backbone_holder(model)
    saved = {t.data_ptr() for t in _peft().get_peft_model_state_dict(holder.model).values()}
    lost = [f"0.{n}" for n, p in holder.named_parameters() if p.requires_grad and p.data_ptr() not in saved]
    for index, module in enumerate(model):
        if index == 0 or _restorable_module(module):
            continue
        lost += [f"{index}.{n}" for n, p in module.named_parameters() if p.requires_grad]
    return lost


def trainable_parts(model) -> dict[str, int]:
    """What trains under LoRA, in parameters: ``{"adapters": n}`` plus, for each module after the
    backbone with trainable parameters, its checkpoint folder name (``"2_Dense"``) and count."""
    parts = {"adapters": sum(p.numel() for p in backbone_holder(model).parameters() if p.requires_grad)}
    for index, module in enumerate(model):
        count = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if index and count:
            parts[_module_folder(index, module)] = count
    return parts


def load_lora_checkpoint(model, checkpoint_dir: str | Path) -> None:
    """Resume: load what a LoRA run's checkpoint holds into ``model`` (already :func:`apply_lora`'d):
    the adapter weights into the backbone's adapters, and the weights of every module after the
    backbone that has any (a ``Dense`` head) from its folder (named in the checkpoint's
    ``modules.json``), so every parameter that trains is where it was when the checkpoint was written.

    Raises:
        UserError: the checkpoint has no adapter weights file, or lacks (or holds other weights for)
            a module after the backbone.
    """
    from safetensors.torch import load_file

    path = Path(checkpoint_dir)
    found = sorted(path.rglob(ADAPTER_WEIGHTS))
    if not found:
        raise UserError(f"{path}: no {ADAPTER_WEIGHTS} in this checkpoint; it was not written by a model.lora run")
    holder = backbone_holder(model)
    state = load_file(str(found[0]), device=str(next(holder.model.parameters()).device))
    _peft().set_peft_model_state_dict(holder.model, state)
    # Modules of another kind cannot train under LoRA (apply_lora refuses them): nothing to restore.
    with_weights = [(i, m) for i, m in enumerate(model) if i and m.state_dict() and _restorable_module(m)]
    if not with_weights:
        return
    try:
        folders = {entry["idx"]: entry["path"] for entry in json.loads((path / "modules.json").read_text())}
    except (OSError, ValueError, KeyError, TypeError):
        folders = {}
    for index, module in with_weights:
        name = _module_folder(index, module)
        if index not in folders:
            raise UserError(f"{path}: no saved {name} module in this checkpoint; resume from a checkpoint of this run")
        try:
            module.load_torch_weights(str(path), subfolder=folders[index], model=module)
        except (OSError, ValueError, RuntimeError) as err:
            raise UserError(f"{path}: cannot restore module {name} from {folders[index]}/: {first_line(err)}") from None


def finish_lora(model, merge: bool) -> None:
    """Before the final save: merge the adapters into the weights (``merge``) so the folder is a
    plain sentence-transformers model; otherwise keep the adapter (the folder holds only it)."""
    if merge and is_lora(model):
        holder = backbone_holder(model)
        holder.model = holder.model.merge_and_unload()
