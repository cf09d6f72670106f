"""probe-minibatch says what its trials measured: precision, LoRA, gradient checkpointing, and that
FSDP's sharding is not measured (with what it would save)."""

from __future__ import annotations

import pytest
from conftest import distinct_pairs
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.loss import loss_config
from cembed.config.schema import LoraOptions, ModelConfig
from cembed.model.load import load_model
from cembed.probe.setup import describe_setup, fsdp_saved_bytes
from cembed.probe.worst_case import worst_case_step

HIDDEN = 32  # the tiny BERT's width (conftest.make_tiny_model)


def _setup(tiny_model_dir, precision="fp32", **model):
    loaded = load_model(ModelConfig(name_or_path=str(tiny_model_dir), device="cpu", max_seq_length=16, **model), "cpu")
    return loaded, worst_case_step(loaded, loss_config(), 2, 8, 4, precision, repeats=1).setup


def test_setup_of_a_lora_checkpointed_model_is_counted_by_hand(tiny_model_dir):
    pytest.importorskip("peft")
    lora = LoraOptions(r=4, alpha=8, dropout=0.0, target_modules=["query", "value"])
    model, setup = _setup(tiny_model_dir, lora=lora, gradient_checkpointing=True)
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    adapters = 2 * 4 * (HIDDEN + HIDDEN)  # query and value: A (4 x 32) and B (32 x 4) each
    assert setup["lora"] is True and setup["gradient_checkpointing"] is True
    assert setup["trainable_parameters"] == adapters and setup["parameters"] == base + adapters
    assert setup["weights_dtype"] == "float32" and setup["autocast"] is None
    # fp32 weights (all), fp32 gradients and two AdamW moments (adapters only)
    assert (setup["weight_bytes"], setup["grad_bytes"], setup["optimizer_bytes"]) == (
        4 * (base + adapters),
        4 * adapters,
        8 * adapters,
    )
    assert setup["state_bytes"] == 4 * (base + adapters) + 4 * adapters + 8 * adapters


def test_setup_of_a_plain_model_under_bf16(tiny_model_dir):
    model, setup = _setup(tiny_model_dir, precision="bf16")
    total = sum(p.numel() for p in model.parameters())
    assert setup["autocast"] == "bf16" and setup["weights_dtype"] == "float32"
    assert setup["lora"] is False and setup["gradient_checkpointing"] is False
    assert setup["trainable_parameters"] == setup["parameters"] == total
    assert (setup["weight_bytes"], setup["grad_bytes"], setup["optimizer_bytes"]) == (4 * total, 4 * total, 8 * total)
    assert setup["state_bytes"] == 16 * total


def test_describe_setup_names_what_was_and_was_not_measured():
    mib = 2**20
    setup = {
        "weights_dtype": "float32",
        "autocast": "bf16",
        "parameters": 1_000_000,
        "trainable_parameters": 4_096,
        "lora": True,
        "gradient_checkpointing": True,
        "weight_bytes": 4 * mib,
        "grad_bytes": 1 * mib,
        "optimizer_bytes": 2 * mib,
        "state_bytes": 7 * mib,
    }
    ddp = describe_setup({**setup, "strategy": "ddp", "ranks": 2})
    assert ddp == [
        "measured with: bf16 autocast over float32 master weights; LoRA adapters (4,096 of 1,000,000 parameters "
        "trainable: gradients and AdamW states for those only); gradient checkpointing on"
    ]
    why = "gradients and AdamW states sharded, every parameter gathered during the cached loss's replay"
    head = "not measured: FSDP sharding (distributed.strategy: fsdp); each trial held the whole model (7.0 MiB of "
    # 4 ranks: (1 - 1/4) x 3 MiB sharded state saved, 4/4 MiB of the rank's own parameter shard added
    assert fsdp_saved_bytes(setup, 4) == 3 * mib - 3 * mib // 4 - mib == (5 * mib) // 4
    fsdp = describe_setup({**setup, "strategy": "fsdp", "ranks": 4})
    assert fsdp == ddp + [
        head + f"parameters, gradients and AdamW states); over 4 ranks a rank holds 1.2 MiB less "
        f"at the peak ({why}), so the recommendation is conservative"
    ]
    # 2 ranks: 1.5 MiB saved, 2 MiB added: sharding costs 0.5 MiB at the peak
    assert fsdp_saved_bytes(setup, 2) == -mib // 2
    two = describe_setup({**setup, "strategy": "fsdp", "ranks": 2})
    assert (
        two[1]
        == head
        + f"parameters, gradients and AdamW states); over 2 ranks a rank holds 512.0 KiB MORE than measured at the peak ({why}): leave that headroom"
    )
    assert describe_setup({"strategy": "ddp", "ranks": 1}) == []  # no trial reported a setup


@pytest.mark.slow
def test_probe_minibatch_prints_the_measured_setup(tiny_model_dir, write_config, pairs_file):
    pytest.importorskip("peft")
    cfg = write_config(
        {
            "model": {
                "name_or_path": str(tiny_model_dir),
                "max_seq_length": 16,
                "device": "cpu",
                "gradient_checkpointing": True,
                "lora": {"r": 4, "alpha": 8, "target_modules": ["query", "value"]},
            },
            "data": {"train": str(pairs_file(distinct_pairs(64)))},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": "auto"},
            "distributed": {"strategy": "fsdp"},
        }
    )
    r = CliRunner().invoke(app, ["probe-minibatch", str(cfg), "--max", "2", "--max-memory", "8GiB"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # rich wraps long lines
    assert "measured with: float32 weights, no autocast; LoRA adapters (512 of " in text
    assert "gradient checkpointing on" in text
    assert "not measured: FSDP sharding (distributed.strategy: fsdp)" in text
