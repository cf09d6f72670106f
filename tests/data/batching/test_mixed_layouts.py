"""Sources with different column layouts (issue 23 item 10), data side: null cells are no text to the
no-duplicates sampler, each batch carries only its source's columns, and with several processes
every rank's batch of a step comes from one source (the same columns on every rank)."""

from __future__ import annotations

import numpy as np
import pytest
from accelerate.data_loader import BatchSamplerShard

from cembed.config.file import config_from_dict
from cembed.data.batching.full_table import NoDuplicatesSampler
from cembed.data.batching.mixture import SourceMix
from cembed.data.identity import row_hashes
from cembed.data.load import load_training_data
from cembed.data.tokens.collator import TokenIdRows, collator_for
from cembed.data.tokens.tokenize import pretokenize


@pytest.fixture
def mixed(tmp_path, pairs_file):
    pairs = pairs_file([{"q": f"question {i}", "a": f"answer {i}"} for i in range(40)], "pairs.jsonl")
    trip = pairs_file(
        [{"anchor": f"dog {i}", "positive": f"puppy {i}", "negative": f"cat {i}"} for i in range(24)], "trip.jsonl"
    )
    cfg = config_from_dict(
        {
            "data": {
                "train": [
                    {"path": str(pairs), "columns": {"anchor": "q", "positive": "a"}},
                    {"path": str(trip), "columns": {"negatives": ["negative"]}},
                ]
            }
        },
        base=tmp_path,
    )
    return cfg, load_training_data(cfg.data)


def test_null_cells_are_no_text_to_the_sampler(mixed):
    """The pairs' null negative_1 does not make every pair row share one text ('' before), so
    duplicate-free batches of pairs exist; on text and on token ids alike."""
    _, data = mixed
    h = row_hashes(data.dataset, data.columns)
    assert (h[:40, 2] == h[:40, 0]).all()  # a null cell repeats the row's anchor: no collision
    assert len(set(h[:40, 2].tolist())) == 40
    sampler = NoDuplicatesSampler(data.dataset, 8, True, seed=1, sources=SourceMix.from_data(data, _sampling()))
    assert len(sampler) == 5 + 3 and sampler.unplaced == 0


def _sampling():
    from cembed.config.data import SamplingConfig

    return SamplingConfig()


def test_ranks_agree_on_each_steps_source_and_columns(mixed, tiny_model_dir, tmp_path):
    """world_size 2: rank r gets slice r of each global batch (accelerate's shard), so at every step
    both ranks' batches hold the same source's rows and their collated batches the same columns
    (what the loss's gather across ranks needs); pair steps carry 2 columns, triplet steps 3."""
    from sentence_transformers import SentenceTransformer

    _, data = mixed
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    tokenized = pretokenize(data.dataset, data.columns, model.tokenizer, 32, tmp_path / "cache").dataset
    collator = collator_for(model, data.columns)
    rows = TokenIdRows(tokenized, data.columns)
    mix = SourceMix.from_data(data, _sampling())
    sampler = NoDuplicatesSampler(tokenized, 4, True, seed=2, world_size=2, sources=mix)
    shards = [list(BatchSamplerShard(sampler, num_processes=2, process_index=r, even_batches=False)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 8  # 40 pairs / 8 + 24 triplets / 8
    widths = []
    for b0, b1, source in zip(*shards, sampler.batch_sources()):
        keys0, keys1 = sorted(collator(rows.__getitems__(b0))), sorted(collator(rows.__getitems__(b1)))
        assert keys0 == keys1
        assert {int(np.searchsorted(np.cumsum(mix.sizes), i, side="right")) for i in b0 + b1} == {source}
        widths.append(sum(k.endswith("_input_ids") for k in keys0))
    assert widths == [(2, 3)[s] for s in sampler.batch_sources()] and set(widths) == {2, 3}
