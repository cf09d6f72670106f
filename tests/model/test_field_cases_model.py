"""Field cases (issue 39 item 10) for the model: LoRA ``target_modules`` and padding to a multiple,
each built from a public bug report about the same feature in the field's tools and compared with a
reference computed without cembed (peft's own ``get_peft_model`` on the same backbone, plain
sentence-transformers' embeddings). docs/development.md lists the round."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import distinct_pairs, make_tiny_model
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.model.lora import target_modules_problem


def _backbone(model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")[0].model


def _peft_verdict(model_dir, targets: list[str]) -> str:
    """What peft itself does with ``targets`` on the model's backbone: "ok", "skips <entries>" (peft
    adapts the rest and ignores entries matching nothing, peft#1959), or its ValueError's first line."""
    import peft

    backbone = _backbone(model_dir)
    names = [n for n, _ in backbone.named_modules() if n]
    try:
        adapted = peft.get_peft_model(backbone, peft.LoraConfig(r=2, target_modules=targets))
    except ValueError as err:
        return str(err).splitlines()[0]
    wrapped = {n.rsplit(".", 1)[0] for n, _ in adapted.named_modules() if n.endswith("lora_A")}
    skipped = [t for t in targets if not any(w == t or w.endswith("." + t) for w in wrapped)]
    assert all(w.split("base_model.model.", 1)[-1] in names for w in wrapped)
    return f"skips {', '.join(skipped)}" if skipped else "ok"


# (entry list, peft's verdict begins with, cembed's one line): peft#1959 ("Incorrect target modules
# does not error": an entry matching nothing is skipped), peft#2964 (a regex inside a list is matched as
# a name, not a pattern), unsloth-zoo#807 and peft's "Target module ... is not supported" (an entry
# naming a LayerNorm, a Dropout or a whole attention block).
LINEAR = "its linear layers are named dense, key, query, value: name those, or use all-linear"
SUPPORTED = "(peft adapts Linear, Embedding, Conv1d, Conv2d, Conv3d, Conv1D and MultiheadAttention layers)"
TARGETS = [
    (["query", "value"], "ok", None),
    (["attention.self.query", "word_embeddings"], "ok", None),
    (["query", "no_such_proj"], "skips no_such_proj", "no_such_proj matches no module"),
    ([".*attention.*query"], "Target modules", ".*attention.*query matches no module"),
    (
        ["query", "LayerNorm"],
        "Target module LayerNorm",
        f"LayerNorm matches LayerNorm modules (embeddings.LayerNorm), which LoRA cannot adapt {SUPPORTED}; {LINEAR}",
    ),
    (
        ["query", "dropout"],
        "Target module Dropout",
        f"dropout matches Dropout modules (embeddings.dropout), which LoRA cannot adapt {SUPPORTED}; {LINEAR}",
    ),
    (
        ["attention"],
        "Target module BertAttention(",
        f"attention matches BertAttention modules (encoder.layer.0.attention), which LoRA cannot adapt {SUPPORTED}; "
        f"{LINEAR}",
    ),
]


@pytest.mark.parametrize("targets", TARGETS, ids=[",".join(t[0]) for t in TARGETS])
def test_target_modules_are_judged_as_peft_adapts_them(tiny_model_dir, targets):
    entries, peft_says, cembed_says = targets
    assert _peft_verdict(tiny_model_dir, entries).startswith(peft_says)  # the reference
    modules = {n: type(m).__name__ for n, m in _backbone(tiny_model_dir).named_modules() if n}
    problem = target_modules_problem(modules, entries)
    if cembed_says is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(cembed_says), problem


def test_validate_names_an_entry_peft_cannot_adapt_in_one_line(tmp_path, tiny_model_dir):
    """The whole line ``validate`` (and ``train``'s pre-flight) gives for a block-level entry: peft's
    own message was cut at ``Target module BertAttention(`` (its repr spans lines), naming neither the
    entry nor the fix."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(16)))
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "name_or_path": str(tiny_model_dir),
                    "device": "cpu",
                    "lora": {"target_modules": ["attention"]},
                },
                "data": {"train": str(data)},
                "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
                "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
            }
        )
    )
    r = CliRunner().invoke(app, ["validate", str(config)])
    assert r.exit_code == 2 and r.output.strip() == (f"error: model.lora.target_modules: {TARGETS[-1][2]}"), r.output


# --- padding to a multiple against the model's position table -----------------------------------


def test_padding_to_a_multiple_stops_at_the_models_length(tmp_path):
    """transformers#9777 ("padding='max_length' allowing more than max length": with
    ``pad_to_multiple_of`` a tokenizer pads past ``max_length``): a model with 62 positions and
    ``batch.pad_to_multiple_of: 8``. transformers refuses to truncate at 62 and pad to multiples of 8,
    and pads truncated ids to 64, which the position table cannot take; cembed's collator pads to 62 at
    most, and its batch embeds as plain sentence-transformers embeds the texts (the reference)."""
    from sentence_transformers import SentenceTransformer

    from cembed.data.tokens.collator import collator_for

    model = SentenceTransformer(str(make_tiny_model(tmp_path / "m", positions=62)), device="cpu")
    assert model.max_seq_length == 62
    texts = ["a " + "man " * 70, "a dog on the street", "two women"]  # the first fills all 62 positions
    with pytest.raises(ValueError, match="not a multiple of pad_to_multiple_of"):
        model.tokenizer(texts, padding=True, truncation=True, max_length=62, pad_to_multiple_of=8)
    ids = [model.tokenizer(t, truncation=True, max_length=62)["input_ids"] for t in texts]
    plain = model.tokenizer.pad({"input_ids": ids}, pad_to_multiple_of=8, return_tensors="pt")
    assert plain["input_ids"].shape == (3, 64)  # transformers' width: past the table
    with pytest.raises((IndexError, RuntimeError)):  # 64 positions asked of a 62-row table
        model[0].model(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"])
    collator = collator_for(model, ["anchor"], pad_to_multiple_of=8)
    batch = collator([{"anchor_input_ids": i} for i in ids])
    assert batch["anchor_input_ids"].shape == (3, 62)
    assert collator([{"anchor_input_ids": i} for i in ids[1:]])["anchor_input_ids"].shape == (2, 8)
    features = {k.removeprefix("anchor_"): v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        ours = model(features)["sentence_embedding"]
    reference = model.encode(texts, convert_to_tensor=True)
    assert torch.allclose(ours, reference, atol=1e-5)


def test_a_dot_dense_folder_trains_and_saves_as_cosine(tiny_model_dir, write_config, pairs_file, tmp_path):
    """The dense twin of neuml/txtai#946: a SentenceTransformer folder saved with ``similarity_fn_name: dot``
    (msmarco-*-dot-*, TAS-B) trained by ``cached_mnrl``, whose scores are cosine (sentence-transformers'
    ``CachedMultipleNegativesRankingLoss`` default). Kept as dot, plain sentence-transformers would rank the
    trained model by vector norms the loss never saw. The saved folder says ``cosine``; ``validate`` says the
    dot was replaced. Reference: the saved ``config_sentence_transformers.json`` read by plain
    ``SentenceTransformer``."""
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(str(tiny_model_dir), device="cpu", similarity_fn_name="dot").save(str(tmp_path / "dot"))
    config = write_config(
        {
            "model": {"name_or_path": str(tmp_path / "dot"), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(16))), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(config)])
    assert r.exit_code == 0, r.output
    assert "model.pooling is not used); its dot similarity replaced by cosine (what the loss trains)" in r.output
    r = CliRunner().invoke(app, ["train", str(config)])
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "run" / "config_sentence_transformers.json").read_text())
    assert saved["similarity_fn_name"] == "cosine"
    assert SentenceTransformer(str(tmp_path / "run"), device="cpu").similarity_fn_name == "cosine"
