"""The trainer's arguments (the model kind's class, ``SentenceTransformerTrainingArguments`` for dense) from
the config and the plan."""

from __future__ import annotations

from cembed.config.schema import CembedConfig
from cembed.data.batching.mixture import SourceMix
from cembed.data.batching.rules import batch_sampler
from cembed.distributed.fsdp import fsdp_args
from cembed.errors import UserError, first_line
from cembed.plan.precision import trainer_flags
from cembed.plan.resolve import Plan


def build_training_args(
    cfg: CembedConfig,
    plan: Plan,
    eval_args: dict | None = None,
    fsdp_layers: list[str] | None = None,
    sources: SourceMix | None = None,
    args_class: type | None = None,
):
    """The trainer's arguments (``args_class``, the model kind's: default
    ``SentenceTransformerTrainingArguments``) from the config and the resolved plan (scaled LR);
    ``eval_args`` (from :func:`cembed.train.evaluation.training_eval_args`) override the save/eval settings;
    ``fsdp_layers`` (the backbone's layer classes) with ``distributed.strategy: fsdp``;
    ``sources`` (several training sources): the mix the batching rule (``sampler.rule``,
    :func:`cembed.data.batching.rules.batch_sampler`) lays the sources' batches out by.

    Raises:
        UserError: a ``train.report_to`` tracker whose package is missing; an unknown ``sampler.rule``.
    """
    from sentence_transformers import SentenceTransformerTrainingArguments

    args_class = args_class or SentenceTransformerTrainingArguments
    t = cfg.train
    sampler = batch_sampler(cfg.sampler, sources)
    length = {"max_steps": t.max_steps} if t.max_steps else {"num_train_epochs": t.num_train_epochs}
    ddp = {}
    if plan.world_size > 1:
        # run_training froze the parameters that get no gradient, so DDP needs no unused-parameter
        # search; every rank needs full, equal batches (the sampler only yields whole global batches).
        # The process group (nccl/gloo) is joined by init_distributed; accelerate reuses it.
        ddp = {"ddp_find_unused_parameters": False}
        if cfg.distributed.strategy == "fsdp":
            ddp = fsdp_args(fsdp_layers or [])
    kwargs = dict(
        output_dir=t.output_dir,
        per_device_train_batch_size=plan.per_device_train_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        learning_rate=plan.learning_rate,
        warmup_ratio=cfg.optim.warmup_ratio,
        weight_decay=cfg.optim.weight_decay,
        lr_scheduler_type=cfg.optim.lr_scheduler_type,
        lr_scheduler_kwargs=dict(cfg.optim.lr_scheduler_kwargs),
        seed=t.seed,
        data_seed=t.seed,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        save_total_limit=t.save_total_limit,
        batch_sampler=sampler,
        dataloader_drop_last=cfg.batch.drop_last or plan.world_size > 1,
        **trainer_flags(plan.precision),  # bf16= / fp16=
        use_cpu=plan.device == "cpu",
        report_to="none" if t.report_to == ["none"] else list(t.report_to),
        disable_tqdm=True,
        torch_compile=t.torch_compile,
        dataloader_num_workers=plan.dataloader_num_workers,
        push_to_hub=t.push_to_hub,
        hub_model_id=t.hub_model_id,
        hub_private_repo=t.hub_private_repo,
        **length,
        **ddp,
    )
    kwargs.update(eval_args or {})
    try:
        return args_class(**kwargs)
    except (ValueError, ImportError, RuntimeError) as err:
        if t.report_to != ["none"] and any(name in str(err) for name in t.report_to):
            raise UserError(f"train.report_to: {first_line(err)}") from None
        raise
