"""Pre-tokenized ids for a multi-vector model (issue 40 item 4): each column tokenized as
``MultiVectorEncoder.preprocess`` tokenizes it for its task (the query column as queries: the query
prompt, ``query_length``, ColBERT's query expansion; the others as documents: ``document_length``),
so the batches the collator pads from the stored ids equal the model's own preprocessing of the texts,
and training does not fall back to tokenizing in the collator."""

from __future__ import annotations

import json

import pytest
import torch

from cembed.config.file import config_from_dict
from cembed.data.tokens.collator import TokenIdRows
from cembed.data.tokens.tokenize import tokenize_stage
from cembed.model.load import load_model
from cembed.train.recipe import check_run_inputs

ROWS = [
    {
        "anchor": f"{'a dog on the table ' * (i % 4)}car {i}{', near the red bus' * (i % 3)}",
        "positive": f"answer {i}: {'the man sits at the table near the bus, ' * (1 + i % 5)}done!",
        "negative": f"black cat {i} {'on a plate ' * (i % 6)}.",
    }
    for i in range(40)
]


@pytest.fixture
def run(tiny_model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def make(**model):
        cfg = config_from_dict(
            {
                "model": {"kind": "multi_vector", "name_or_path": str(tiny_model_dir), "device": "cpu", **model},
                "data": {
                    "train": str(data),
                    "cache_dir": str(tmp_path / "cache"),
                    "prompts": {"anchor": "query: ", "positive": "passage: "},
                },
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            },
            base=tmp_path,
        )
        plan, training = check_run_inputs(cfg)
        return cfg, load_model(cfg.model, "cpu", seed=1), training

    return make


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="model-lengths"),
        pytest.param({"query_length": 9, "document_length": 21}, id="query-and-document-lengths"),
        pytest.param({"query_expansion": 12, "document_length": 30, "skiplist": "punctuation"}, id="query-expansion"),
    ],
)
def test_stored_ids_pad_to_what_the_model_preprocesses_for_each_task(run, options):
    cfg, model, data = run(dim=8, **options)
    prompts = {"anchor": "query: ", "positive": "passage: ", "negative_1": "passage: "}
    dataset, collator, info = tokenize_stage(model, data, True, cfg.data.cache_dir, prompts)
    assert info["pretokenized"], info  # no fallback to tokenizing in the collator
    rows = list(range(len(dataset)))
    batch = collator(TokenIdRows(dataset, collator.roles).__getitems__(rows))
    for role, task in zip(collator.roles, ("query", "document", "document")):
        texts = [dataset[i][role] for i in rows]
        ref = model.preprocess(texts, prompt=prompts[role], task=task)
        assert set(ref) - {"modality", "prompt_length"} == {
            k.removeprefix(f"{role}_") for k in batch if k.startswith(f"{role}_") and k != f"{role}_prompt_length"
        } - {"modality"}
        for key in ("input_ids", "attention_mask", "token_type_ids", "query_expansion_positions"):
            if key in ref:
                assert torch.equal(batch[f"{role}_{key}"].to(torch.int64), ref[key].to(torch.int64)), (role, key)
    if options.get("query_expansion"):
        assert batch["anchor_input_ids"].shape[1] == 12 and batch["anchor_query_expansion_positions"].any()
    if options.get("query_length"):
        assert batch["anchor_input_ids"].shape[1] == 9 and batch["positive_input_ids"].shape[1] == 21
