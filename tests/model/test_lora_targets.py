"""LoRA ``target_modules`` entries that match no module of the model are refused naming them (issue 39
item 6): peft adapts the entries that match and skips the others without a word."""

from __future__ import annotations

import pytest

from cembed.config.schema import ModelConfig
from cembed.errors import UserError
from cembed.model.load import load_model
from cembed.model.lora import target_modules_problem

pytest.importorskip("peft")

MODULES = {
    "layers.0.self_attn.q_proj": "Linear",
    "layers.0.self_attn.v_proj": "Linear",
    "layers.0.mlp.gate_proj": "Linear",
    "layers.0.input_layernorm": "RMSNorm",
}


def test_an_entry_matching_no_module_is_named_with_the_linear_layers():
    assert target_modules_problem(MODULES, ["q_proj", "v_proj"]) is None  # by the last dotted part
    assert target_modules_problem(MODULES, ["layers.0.self_attn.q_proj", "self_attn.v_proj"]) is None
    assert target_modules_problem(MODULES, "all-linear") is None
    assert target_modules_problem(MODULES, ["q_proj", "k_proj"]) == (
        "k_proj matches no module of the model (peft would adapt the others and skip it); its linear layers are "
        "named gate_proj, q_proj, v_proj: name those, or use all-linear"
    )
    assert target_modules_problem(MODULES, ["proj", "attn.q"]).startswith("proj, attn.q match no module")


def test_training_refuses_a_list_with_an_entry_the_model_lacks(tiny_model_dir):
    lora = {"target_modules": ["query", "no_such_proj"]}
    with pytest.raises(UserError) as err:
        load_model(ModelConfig(name_or_path=str(tiny_model_dir), lora=lora), "cpu")
    assert str(err.value) == (
        "model.lora.target_modules: no_such_proj matches no module of the model (peft would adapt the others "
        "and skip it); its linear layers are named dense, key, query, value: name those, or use all-linear"
    )
    model = load_model(ModelConfig(name_or_path=str(tiny_model_dir), lora={"target_modules": ["query"]}), "cpu")
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
