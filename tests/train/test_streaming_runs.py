"""Training from a stream (issue 24 item 4): ``data.train.streaming`` trains on the windowed
no-duplicate batches (:mod:`cembed.data.streaming`), each rank on its own split of the stream."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from conftest import REPO

import cembed.train.recipe as T
from cembed.config.file import config_from_dict
from cembed.data.sampler import hash_token_ids
from cembed.data.streaming import windowed_batches
from cembed.train.trainer import CembedTrainer

# 72 pairs; every 6th anchor repeats an earlier one and every 9th positive too, so the window rule
# defers (and with W = 0 drops) rows.
ROWS = [
    {
        "anchor": f"a dog {i % 6 if i % 6 == 0 else i} in the park",
        "positive": f"a puppy {i % 9 if i % 9 == 0 else i} on grass",
    }
    for i in range(72)
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(model_dir, tmp_path, out, data_file, streaming=None, max_steps=5, **extra):
    train = {"path": str(data_file)}
    if streaming is not None:
        train["streaming"] = streaming
    cfg = {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {"train": train, "cache_dir": str(tmp_path / "cache")},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
        "train": {"max_steps": max_steps, "logging_steps": 1, "output_dir": str(out), "seed": 3},
    }
    for key, value in extra.items():
        section, field = key.split("__")
        cfg.setdefault(section, {})[field] = value
    return cfg


class BatchesSeen(CembedTrainer):
    """Records each training batch's anchor token ids (padding stripped), in order."""

    seen: list[list[tuple[int, ...]]] = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            ids, mask = inputs["anchor_input_ids"], inputs["anchor_attention_mask"]
            type(self).seen.append([tuple(i[m.bool()].tolist()) for i, m in zip(ids, mask)])
        return super().compute_loss(model, inputs, *args, **kwargs)


def _expected_batches(model_dir, rows, batch_size, window):
    """The windowed batches of ``rows`` in file order, computed here: each batch's anchor ids."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    ids = {
        c: model.tokenizer([r[c] for r in rows], truncation=True, max_length=model.max_seq_length)["input_ids"]
        for c in ("anchor", "positive")
    }
    hashes = np.stack([hash_token_ids(pa.array(ids[c], type=pa.list_(pa.int32()))) for c in ids], axis=1)
    payloads = [tuple(a) for a in ids["anchor"]]
    return list(windowed_batches([(hashes, payloads)], batch_size, window, drop_last=True))
