"""Publishing a trained model: cembed's training facts in the model card sentence-transformers
writes, and the upload to the hub with ``train.push_to_hub``."""

from __future__ import annotations

from cembed.errors import UserError, first_line
from cembed.plan.resolve import Plan


def card_facts(plan: Plan, rows_trained: int, steps: int) -> dict[str, str | int]:
    """cembed's training facts for the model card: effective batch, mini-batch size (and token
    budget), the LR with its rule, the rows trained on and the optimizer steps (keys prefixed
    ``cembed_``)."""
    return {
        "cembed_effective_batch_size": (
            f"{plan.samples_per_step} ({plan.per_device_train_batch_size} per device x {plan.world_size} "
            f"processes x {plan.gradient_accumulation_steps} accumulation)"
        ),
        "cembed_mini_batch_size": str(plan.mini_batch_size)
        + (f" (token budget {plan.mini_batch_num_tokens})" if plan.mini_batch_num_tokens else ""),
        "cembed_learning_rate": plan.lr_derivation,
        "cembed_training_rows": rows_trained,
        "cembed_steps": steps,
    }


def add_card_facts(model, plan: Plan, rows_trained: int, steps: int) -> None:
    """Add :func:`card_facts` to the model card sentence-transformers writes into the model folder
    (README.md) on every save, the final one and a push included: they join the card's "Training
    Hyperparameters" lists, which its trainer callback filled when training began."""
    facts = card_facts(plan, rows_trained, steps)
    card = model.model_card_data
    card.non_default_hyperparameters.update(facts)
    card.all_hyperparameters.update(facts)


def push_final_model(trainer) -> None:
    """With ``train.push_to_hub``: upload ``output_dir`` (model, model card, run files; checkpoints
    excluded) to ``train.hub_model_id``. Every rank calls it; rank 0 uploads. Nothing without it.

    Raises:
        UserError: the upload failed (the model stays saved in ``output_dir``).
    """
    if not trainer.args.push_to_hub:
        return
    try:
        trainer.push_to_hub(commit_message=f"cembed: {trainer.state.global_step} steps")
    except Exception as err:
        raise UserError(
            f"train.push_to_hub: the model is saved in {trainer.args.output_dir}, but uploading it to "
            f"{trainer.args.hub_model_id} failed: {first_line(err)}"
        ) from None
