"""Sharded training (``distributed.strategy: fsdp``): FSDP2 (``torch.distributed.fsdp.fully_shard``)
through accelerate and the trainer's ``fsdp`` options.

- :func:`fsdp_args`: the trainer's FSDP2 options: one shard unit per transformer layer plus the
  root, sharded checkpoints (``pytorch_model_fsdp_0/`` and ``optimizer_0/``, torch.distributed.checkpoint
  folders each rank writes its shard into; resume reads them back resharded on any number of
  processes, and into one process's unsharded model: :func:`load_sharded_model`; the other way:
  :func:`load_full_optimizer`).
- :func:`enable_fsdp_on_cpu`: accelerate (1.15, ``AcceleratorState.__init__``) turns the FSDP plugin
  into ``DistributedType.FSDP`` only inside its branch for accelerator devices (MULTI_GPU, XPU, NPU,
  ...); a CPU job stays ``MULTI_CPU``, drops the plugin and trains with DDP, silently. torch's
  ``fully_shard`` itself works on CPU with gloo (tests/distributed/test_fsdp.py), so cembed hands the plugin to
  the accelerator state itself there: the CPU job then runs the same FSDP2 code as a GPU job.
- :func:`gathered_model`: the final model. The trained model's parameters are DTensor shards and
  every forward all-gathers them, so rank 0 cannot save or evaluate it alone: all ranks gather the
  full state dict (to rank 0's CPU), and rank 0 loads it into a freshly built, unsharded copy.

Per-mini-batch backward of the cached loss (GradCache): the replay runs one backward per
mini-batch. Under DDP sentence-transformers wraps all but the last in ``no_sync`` (one all-reduce of
the gradients per step). Under FSDP2 nothing is deferred: each mini-batch's backward reduce-scatters
its gradients into the sharded ``.grad`` (cembed's choice), so the gradients stay 1/N per rank all
step. Deferring (``set_requires_gradient_sync(False)`` until the last mini-batch) would hold the
whole unsharded gradient on every rank, the memory FSDP is chosen to save, in exchange for one
reduce-scatter per step instead of n; the parameter all-gathers (2 x n x P per step) dominate the
traffic either way (measured by ``scripts/bench_fsdp.py``: 1.2x the bytes at n = 2, 1.4x at n = 8).
The replay's forward runs inside the loss's backward, where FSDP2 keeps parameters gathered after
forward (``FSDPParamGroup.post_forward`` reshards only ``if not is_bw()``), so while a mini-batch is
replayed a rank holds all parameters gathered.
"""

from __future__ import annotations


def fsdp_args(layer_classes: list[str]) -> dict:
    """The trainer's FSDP arguments for ``distributed.strategy: fsdp``.

    Args:
        layer_classes: class names of the backbone's transformer layers (its ``_no_split_modules``,
            e.g. ``["BertLayer"]``): each becomes one shard unit, gathered just before its forward.

    Returns:
        ``fsdp`` and ``fsdp_config`` keyword arguments for ``SentenceTransformerTrainingArguments``:
        FSDP2, sharded checkpoints (each rank writes its shard), parameters resharded after each
        forward (the cached loss's no-grad pass holds one layer's full weights at a time).
    """
    return {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": list(layer_classes),
            "state_dict_type": "SHARDED_STATE_DICT",
            "reshard_after_forward": True,
            "cpu_ram_efficient_loading": False,
        },
    }


def shard_layer_classes(auto_model) -> list[str]:
    """The layer classes of a transformers model that FSDP2 can shard one unit each: its ``_no_split_modules``
    (a head model's, e.g. ``BertForMaskedLM``, that has none: its base model's), less any class whose
    modules hold a parameter tied to one outside them. ``fully_shard`` refuses a parameter shared by two
    shard groups; a masked-language model ties its decoder to the word embeddings, so its
    ``BertEmbeddings`` stays in the root unit with the decoder.

    Returns:
        Class names, sorted: transformers 5 keeps ``_no_split_modules`` as a set, whose order changes with
        the process's string hash seed.
    """
    names = getattr(auto_model, "_no_split_modules", None)
    if names is None:
        names = getattr(getattr(auto_model, "base_model", None), "_no_split_modules", None)
    owners: dict[int, set[str]] = {}  # parameter id -> the names it is reachable under
    for name, param in auto_model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name)
    tied_out = set()
    for prefix, module in auto_model.named_modules():
        if type(module).__name__ not in (names or []):
            continue
        inside = prefix + "."
        for param in module.parameters():
            if any(not n.startswith(inside) for n in owners.get(id(param), ())):
                tied_out.add(type(module).__name__)
    return sorted(n for n in names or [] if n not in tied_out)


def search_final_norm_in_backbone(model) -> None:
    """Have accelerate look for ``model``'s final norm inside its first module (the transformer).

    accelerate (1.15, ``fsdp2_prepare_model``) shards a model's final norm as a unit of its own, found by
    class name ("Norm" in it) among the children of ``model.base_model_prefix`` (the model itself when it
    has none). For a sentence-transformers model that is its last ``Normalize`` (all-MiniLM-L6-v2's, every
    multi-vector model's token normalisation), which has no weights and which ``fully_shard`` cannot wrap
    (``'FSDPNormalize' object layout differs from 'Normalize'``): the run fails before its first step.
    Pointing ``base_model_prefix`` at the first module makes accelerate look among the transformer's
    children, as for a transformers model. Only set on a sentence-transformers model without one."""
    if getattr(model, "base_model_prefix", None) is None and hasattr(model, "_modules") and "0" in model._modules:
        model.base_model_prefix = "0"


def enable_fsdp_on_cpu(trainer) -> bool:
    """Give a CPU job's accelerator the FSDP plugin that accelerate dropped (see the module notes).

    Call right after the trainer created its accelerator (``create_accelerator_and_postprocess``).
    Only acts when the trainer's arguments ask for FSDP and accelerate left the job ``MULTI_CPU``;
    a GPU job already has the plugin and is left alone.

    Returns:
        True when the plugin was handed over (``trainer.is_fsdp_enabled`` is then True).
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
    if not plugin_args or getattr(state, "fsdp_plugin", None) is not None:
        return False
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # As accelerate does for a GPU job: every later AcceleratorState() copies PartialState's type back.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
    return True


def is_sharded(model) -> bool:
    """True when ``model`` (or one of its modules) has been sharded by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def local_numel(model) -> tuple[int, int]:
    """``(this rank's parameter elements, all parameter elements)`` of a possibly sharded model:
    a DTensor parameter counts its local shard, a plain one in full."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return local, total


def gathered_model(trainer, build):
    """The trained model, unsharded, for saving and evaluating on rank 0.

    Without FSDP: ``trainer.model`` itself. With FSDP: every rank must call it at the same point
    (the gather is a collective); rank 0 gets ``build(device)`` (a freshly loaded model of the same
    architecture, on ``trainer.args.device``) with the full state dict loaded into it (strict: every
    key must match) and the trained model's model card data (the trainer's hyperparameters); the
    other ranks get None (their sharded ``trainer.model`` must not run a forward, or merge LoRA
    adapters, alone: either is a collective).

    Args:
        trainer: the trainer after ``train()``.
        build: ``device -> model``, loading the run's model as before training (cembed.model.load.load_model).
    """
    if not getattr(trainer, "is_fsdp_enabled", False) or not is_sharded(trainer.model):
        return trainer.model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, the others {}
    state = get_model_state_dict(trainer.model, options=options)
    if not trainer.accelerator.is_main_process:
        return None
    model = build(trainer.args.device)
    model.load_state_dict(state, strict=True)
    card = trainer.model.model_card_data
    model.model_card_data = card
    card.register_model(model)
    return model


# --- resuming across the layouts: sharded (torch.distributed.checkpoint) <-> full ------------------
# accelerate saves an FSDP2 model as {"model": state dict} and its optimizer as {"optimizer": torch's
# get_optimizer_state_dict}, both keyed by parameter FQN, in these folders of the checkpoint.
SHARDED_MODEL = "pytorch_model_fsdp_0"
SHARDED_OPTIMIZER = "optimizer_0"


def load_sharded_model(model, checkpoint: str) -> None:
    """Load a sharded checkpoint's model into an unsharded ``model`` on one process: torch.distributed.checkpoint
    reads every rank's shards into the full tensors, without a process group."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(f"{checkpoint}/{SHARDED_MODEL}"), no_dist=True)
    model.load_state_dict(state["model"], strict=True)


def load_sharded_optimizer(model, optimizer, checkpoint: str) -> None:
    """Load a sharded checkpoint's optimizer state into the optimizer of an unsharded ``model`` on one
    process: torch's FQN-keyed optimizer state dict of the plain model names the same entries as the
    sharded run's, so torch.distributed.checkpoint fills it with the full tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # (initialises an empty AdamW state)
    dcp.load(state, storage_reader=dcp.FileSystemReader(f"{checkpoint}/{SHARDED_OPTIMIZER}"), no_dist=True)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_full_optimizer(model, optimizer, saved: dict) -> None:
    """Load an unsharded run's ``optimizer.state_dict()`` (``saved``) into the optimizer of the sharded
    ``model``: every rank holds the full state and torch keeps each rank's shard of it.

    ``saved`` numbers the parameters in the order of its param groups; the sharded run built the
    same groups from the same model (the trainer's weight-decay split), so the position names the
    parameter, and torch's loader takes FQNs.

    Raises:
        ValueError: the param groups differ in number or size (not the same model or optimizer).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if [len(g) for g in groups] != [len(g["params"]) for g in saved["param_groups"]]:
        raise ValueError("the checkpoint's optimizer has other param groups than this run's")
    order = [n for g in groups for n in g]
    state = {
        "state": {order[i]: s for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
    # strict=False: a parameter that never had a gradient (an unused pooler) has no AdamW state, as
    # torch's own Optimizer.load_state_dict accepts.
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(model, optimizer, state, options=options)
