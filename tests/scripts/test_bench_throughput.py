"""scripts/bench_throughput.py's decoder step rows at toy sizes: the small Qwen2 decoder is loaded as
cembed loads decoders (last-token pooling, EOS appended, covered by the embedding), packs, and every
path (stock, cembed padded, cembed packed; plain and under LoRA) computes stock's loss."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_script, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TOY = {"hidden": 32, "layers": 1, "heads": 4, "kv_heads": 2, "intermediate": 64}


@pytest.fixture(scope="module")
def bench():
    return load_script(REPO / "scripts" / "bench_throughput.py", "bench_throughput")


@pytest.fixture(scope="module")
def decoder_dir(bench, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_decoder")
    tokenizer_dir = make_tiny_model(root / "bert").parent / "hf"  # a WordPiece tokenizer, as MiniLM's
    return bench.decoder_checkpoint(root / "decoder", str(tokenizer_dir), **TOY)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_decoder_step_rows_agree_with_stock(bench, decoder_dir, tmp_path, capsys, lora):
    from cembed.model.decoder import uses_last_token_pooling
    from cembed.model.lora import is_lora

    model = bench.load_decoder(decoder_dir, lora, max_seq_length=64)
    assert uses_last_token_pooling(model) and is_lora(model) == lora
    # The texts get the lengths MiniLM's WordPiece tokenizer gives them (not Qwen2's byte-level
    # class, which transformers 5 picks beside a Qwen2 config and which splits them into characters).
    from transformers import BertTokenizerFast

    text = bench.skewed_pairs(1, seed=1)["positive"][0]
    assert model.tokenizer(text)["input_ids"] == BertTokenizerFast.from_pretrained(decoder_dir)(text)["input_ids"]
    assert len(model.tokenizer) <= model[0].auto_model.config.vocab_size
    model.eval()
    paths = bench.step_losses(model, bench.DECODER_STEP_PATHS, mbs=4, budget=4 * 64)
    assert dict(paths)["cembed packed"].unpadding.enabled
    disagree = bench.step_rows(model, "skewed", bench.skewed_pairs(16, seed=1), paths, 4, 4 * 64, 1, tmp_path)
    assert disagree == []
    rows = [line.split(" | ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("| skewed |")]
    assert rows == [*bench.DECODER_STEP_PATHS, "padding-free estimate"]
