"""The pre-flight checks that read the model's files, the loss's other models and the hub (issue 39
item 6): ``validate`` and the start of ``train`` refuse, in one line naming the field, what training
would otherwise fail on later (or, for LoRA, skip without a word)."""

from __future__ import annotations

import pytest

import cembed.train.preflight as P
from cembed.config.file import config_from_dict
from cembed.config.schema import TrainConfig

MISSING = "all-MiniLM-L6-v3"  # neither a folder, nor shipped, nor in the hub cache (offline)


def _cfg(tiny_model_dir, **sections):
    data = {"model": {"name_or_path": str(tiny_model_dir)}, "data": {"train": "pairs.jsonl"}, **sections}
    return config_from_dict(data)


def test_matryoshka_dims_above_the_models_are_found(tiny_model_dir):
    found = P.check_model_shape(_cfg(tiny_model_dir, loss={"matryoshka": {"dims": [64, 16]}}))
    assert [str(f) for f in found] == [
        "loss.matryoshka.dims: [64, 16]: the model's embeddings have 32 dimensions; use dims up to 32"
    ]
    assert P.check_model_shape(_cfg(tiny_model_dir, loss={"matryoshka": {"dims": [32, 16]}})) == []


def test_lora_targets_the_model_lacks_are_found(tiny_model_dir):
    found = P.check_model_shape(
        _cfg(tiny_model_dir, model={"name_or_path": str(tiny_model_dir), "lora": {"target_modules": ["query", "qkv"]}})
    )
    assert [f.field for f in found] == ["model.lora.target_modules"] and found[0].message.startswith("qkv matches no")
    ok = {"name_or_path": str(tiny_model_dir), "lora": {"target_modules": ["query", "value"]}}
    assert P.check_model_shape(_cfg(tiny_model_dir, model=ok)) == []


def test_a_guide_that_cannot_be_loaded_is_found_with_trains_line(tiny_model_dir, tmp_path):
    from cembed.errors import UserError
    from cembed.model.load import load_guide_model

    gist = {"name": "cached_gist", "guide": MISSING}
    (finding,) = P.check_loss_models(_cfg(tiny_model_dir, loss=gist).loss)
    with pytest.raises(UserError) as err:
        load_guide_model(MISSING, "cpu")  # what train says when it builds the loss
    assert str(finding) == str(err.value) and finding.field == "loss.guide"
    assert P.check_loss_models(_cfg(tiny_model_dir, loss={**gist, "guide": str(tiny_model_dir)}).loss) == []
    empty = tmp_path / "empty-guide"
    empty.mkdir()
    (finding,) = P.check_loss_models(_cfg(tiny_model_dir, loss={**gist, "guide": str(empty)}).loss)
    assert str(finding).startswith(f"loss.guide: cannot load {str(empty)!r}")
    assert P.check_loss_models(_cfg(tiny_model_dir).loss) == []  # cached_mnrl loads no other model


def test_push_to_hub_needs_a_reachable_hub(monkeypatch):
    from huggingface_hub import constants

    push = TrainConfig(push_to_hub=True, hub_model_id="me/model")
    assert P.check_hub(TrainConfig()) == []
    assert constants.HF_HUB_OFFLINE  # the tests run offline
    (offline,) = P.check_hub(push)
    assert str(offline) == (
        "train.push_to_hub: the hub is unreachable: offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); "
        "run with network access and offline mode off, or set train.push_to_hub: false (the model is saved in "
        "train.output_dir either way)"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    (no_token,) = P.check_hub(push)
    assert no_token.message.startswith("no hub token to create me/model with: log in (hf auth login) or set HF_TOKEN")

    def unreachable():
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_x")
    monkeypatch.setattr("huggingface_hub.whoami", unreachable)
    (down,) = P.check_hub(push)
    assert down.message.startswith("the hub does not answer to your token (Failed to resolve 'huggingface.co'); set")
    monkeypatch.setattr("huggingface_hub.whoami", lambda: {"name": "me"})
    assert P.check_hub(push) == []
