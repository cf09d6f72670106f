"""Batch production: the vectorised batch fetch + padding equals the row-by-row collator exactly
(lengths, order, repeats, record-batch boundaries, selections, batch.pad_to_multiple_of), and
train.dataloader_num_workers: auto resolves as documented, with the shared-memory guard."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset, concatenate_datasets
from sentence_transformers import SentenceTransformer

import cembed.plan.resolve as P
from cembed.config.schema import CembedConfig
from cembed.data.identity import TOKEN_SUFFIX
from cembed.data.tokens.collator import IdColumn, TokenIdRows, collator_for
from cembed.data.tokens.tokenize import pretokenize

ROLES = ["anchor", "positive"]


def row_collate(collator, rows: list[dict]) -> dict:
    """The collator as it was before batch fetches (per-row Python), the reference."""
    batch = {}
    for role in collator.roles:
        seqs = [r[role + TOKEN_SUFFIX] for r in rows]
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        width = int(lengths.max()) if len(seqs) else 0
        mask = np.arange(width)[None, :] < lengths[:, None]
        ids = np.full((len(seqs), width), collator.pad_token_id, dtype=np.int64)
        ids[mask] = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lengths.sum()))
        ids, mask = torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))
        batch[f"{role}_input_ids"] = ids
        if collator.token_type_ids:
            batch[f"{role}_token_type_ids"] = torch.zeros_like(ids)
        batch[f"{role}_attention_mask"] = mask
        for key, value in collator.constants.items():
            batch[f"{role}_{key}"] = value
    return batch


def assert_same(ours: dict, ref: dict) -> None:
    assert list(ours) == list(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


@pytest.fixture
def model(tiny_model_dir):
    m = SentenceTransformer(str(tiny_model_dir), device="cpu")
    m.max_seq_length = 24
    return m


def texts(n: int, seed: int) -> dict[str, list[str]]:
    rng = np.random.default_rng(seed)
    words = np.array("a red car on the street two dogs play in snow near table people man bus".split())
    return {
        "anchor": [f"q{i} " + " ".join(rng.choice(words, rng.integers(0, 6))) for i in range(n)],
        "positive": [f"d{i} " + " ".join(rng.choice(words, rng.integers(0, 40))) for i in range(n)],
    }


@pytest.fixture(scope="module")
def tokenized(tiny_model_dir, tmp_path_factory):
    # Two datasets concatenated: the table has several record batches (the cache writes 1000-row ones).
    m = SentenceTransformer(str(tiny_model_dir), device="cpu")
    parts = [Dataset.from_dict(texts(n, seed)) for n, seed in ((1100, 0), (300, 1))]
    cache = tmp_path_factory.mktemp("tokenized")
    return pretokenize(concatenate_datasets(parts), ROLES, m.tokenizer, 24, cache).dataset


def test_vectorised_batches_equal_row_collator(model, tokenized):
    assert tokenized.data.table.column("anchor" + TOKEN_SUFFIX).num_chunks >= 2
    collator = collator_for(model, ROLES)
    rows = TokenIdRows(tokenized, ROLES)
    rng = np.random.default_rng(3)
    lengths = np.array([len(x) for x in tokenized["positive" + TOKEN_SUFFIX]])
    assert lengths.min() < 10 and lengths.max() == 24  # short rows and truncated ones
    for idx in (
        rng.permutation(len(tokenized))[:257].tolist(),  # across record batches, shuffled
        [999, 1000, 1001, 5, 5, 1399],  # record-batch boundary and a repeated row
        [7],
        list(range(len(tokenized))),
    ):
        ours = collator(rows.__getitems__(idx))
        ref = row_collate(collator, [tokenized[i] for i in idx])
        assert_same(ours, ref)
    assert rows.__getitem__(4) == tokenized[4]


def test_vectorised_batches_of_a_selection(model, tokenized):
    picked = tokenized.select([1200, 3, 42, 1399, 3])  # an indices mapping over the table
    collator = collator_for(model, ROLES)
    idx = [4, 0, 2, 2, 1]
    assert_same(collator(TokenIdRows(picked, ROLES).__getitems__(idx)), row_collate(collator, [picked[i] for i in idx]))


def test_id_column_gathers_exact_rows():
    lists = [[1, 2], [3], [4, 5, 6], [], [7, 8, 9, 10], [11]]
    arr = pa.array(lists, pa.list_(pa.int32()))
    column = pa.chunked_array([arr.slice(0, 2), arr.slice(2, 3), arr.slice(5, 1)])  # sliced chunks
    got = IdColumn(column).take(np.array([5, 0, 3, 2, 4, 2]))
    assert got.offsets.tolist() == [0, 1, 3, 3, 6, 10, 13]
    assert got.values.tolist() == [11, 1, 2, 4, 5, 6, 7, 8, 9, 10, 4, 5, 6]


def test_id_column_gathers_per_file_not_per_record_batch(tmp_path):
    # Two memory-mapped Arrow files of 25 record batches each (as datasets writes them, 40 rows per
    # batch here): one region per file, so a batch's gather does not loop over record batches.
    from datasets import Dataset, Features, List, Value, concatenate_datasets

    rng = np.random.default_rng(0)
    lists = [rng.integers(0, 30_000, int(rng.integers(0, 12))).tolist() for _ in range(2000)]
    features = Features({"a_input_ids": List(Value("int32"))})
    parts = []
    for k, part in enumerate((lists[:1000], lists[1000:])):
        written = Dataset.from_dict({"a_input_ids": part}, features=features).map(
            batched=True, writer_batch_size=40, cache_file_name=str(tmp_path / f"p{k}.arrow")
        )
        parts.append(Dataset.from_file(written.cache_files[0]["filename"]))
    column = concatenate_datasets(parts).data.table.column("a_input_ids")
    ids = IdColumn(column)
    assert column.num_chunks == 50 and len(ids.regions) == 2
    rows = rng.integers(0, 2000, 3000)
    got = ids.take(rows)
    assert got.offsets.tolist() == np.cumsum([0] + [len(lists[r]) for r in rows]).tolist()
    assert got.values.tolist() == [t for r in rows for t in lists[r]]
    assert ids.take(np.array([], dtype=np.int64)).offsets.tolist() == [0]


@pytest.mark.parametrize(
    ("multiple", "idx"),
    [
        (8, [3, 7]),  # longest row rounded up to a multiple of 8
        (5, None),
        (7, None),  # the positives' longest rows are 24 = max_seq_length: never wider
        (64, [3, 7]),  # a multiple beyond max_seq_length is bounded by it
    ],
)
def test_pad_to_multiple_of(model, tokenized, multiple, idx):
    idx = idx or list(range(0, len(tokenized), 3))
    collator = collator_for(model, ROLES, pad_to_multiple_of=multiple)
    assert collator.max_length == 24
    ours = collator(TokenIdRows(tokenized, ROLES).__getitems__(idx))
    ref = row_collate(collator_for(model, ROLES), [tokenized[i] for i in idx])
    for role in ROLES:
        longest = ref[f"{role}_input_ids"].shape[1]
        expect = min(-(-longest // multiple) * multiple, 24)
        assert ours[f"{role}_input_ids"].shape == (len(idx), expect)
        assert expect % multiple == 0 or expect == 24
        extra = expect - longest
        pad_id = collator.pad_token_id
        assert torch.equal(
            ours[f"{role}_input_ids"], torch.nn.functional.pad(ref[f"{role}_input_ids"], (0, extra), value=pad_id)
        )
        for key in ("attention_mask", "token_type_ids"):
            assert torch.equal(ours[f"{role}_{key}"], torch.nn.functional.pad(ref[f"{role}_{key}"], (0, extra)))


def test_padded_width_exact(model):
    eight, seven, plain = (collator_for(model, ROLES, pad_to_multiple_of=m) for m in (8, 7, None))
    assert [eight.width(n) for n in (0, 1, 8, 9, 17, 24)] == [0, 8, 8, 16, 24, 24]
    assert [seven.width(n) for n in (14, 15, 22)] == [14, 21, 24]  # 28 is beyond max_seq_length 24
    assert [plain.width(n) for n in (0, 13, 24)] == [0, 13, 24]


def test_pad_to_multiple_of_config():
    cfg = CembedConfig.model_validate({"data": {"train": "x.jsonl"}, "batch": {"pad_to_multiple_of": 8}})
    assert cfg.batch.pad_to_multiple_of == 8
    assert CembedConfig.model_validate({"data": {"train": "x.jsonl"}}).batch.pad_to_multiple_of is None
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        CembedConfig.model_validate({"data": {"train": "x.jsonl"}, "batch": {"pad_to_multiple_of": 0}})


# --- train.dataloader_num_workers: auto ---------------------------------------------------------


@pytest.fixture
def big_shm(monkeypatch):
    monkeypatch.setattr(P, "_shm_size", lambda path: 64 * 1024**3)


def test_auto_workers_exact_values(big_shm):
    # (rows, columns, cores, processes per node) -> workers
    assert P.resolve_workers("auto", 64, 2, 256, cpus=16)[0] == 0  # small batch: the main process
    assert P.resolve_workers("auto", 4095, 2, 256, cpus=16)[0] == 0  # 8190 texts < 8192
    assert P.resolve_workers("auto", 4096, 2, 256, cpus=16)[0] == 2
    assert P.resolve_workers("auto", 2731, 3, 256, cpus=16)[0] == 2  # triplets: 8193 texts
    assert P.resolve_workers("auto", 16384, 2, 256, cpus=2)[0] == 1  # two cores: one to spare
    assert P.resolve_workers("auto", 65536, 2, 256, cpus=1)[0] == 0
    assert P.resolve_workers("auto", 65536, 2, 256, cpus=16, processes_per_node=8)[0] == 1
    assert P.resolve_workers("auto", 65536, 2, 256, cpus=16, processes_per_node=16)[0] == 0
    workers, how, warning = P.resolve_workers("auto", 65536, 2, 256, cpus=64)
    assert (workers, warning) == (2, None) and how.startswith("auto: 2")
    assert P.resolve_workers(3, 64, 2, 256, cpus=1)[:2] == (3, "3 (train.dataloader_num_workers)")
    assert P.resolve_workers(0, 65536, 2, 256, cpus=64)[0] == 0


def test_auto_workers_fall_back_when_shm_is_too_small(monkeypatch):
    monkeypatch.setattr(P, "_shm_size", lambda path: 64 * 1024**2)  # Docker's default
    workers, how, warning = P.resolve_workers("auto", 16384, 2, 256, cpus=2)
    # one worker x 2 prefetched batches of 16384 x 2 x 256 x 24 B = 192 MiB each
    assert workers == 0 and "shared memory" in how
    assert warning.startswith("train.dataloader_num_workers: auto uses 0 workers")
    assert "384 MiB" in warning and "64 MiB" in warning and "--shm-size=2g" in warning
    monkeypatch.setattr(P, "_shm_size", lambda path: 384 * 1024**2)  # exactly enough
    assert P.resolve_workers("auto", 16384, 2, 256, cpus=2)[:1] == (1,)
    monkeypatch.setattr(P, "_shm_size", lambda path: None)  # no /dev/shm to read: not the guard's business
    assert P.resolve_workers("auto", 16384, 2, 256, cpus=2)[0] == 1


def test_plan_resolves_auto_workers(monkeypatch, big_shm):
    monkeypatch.setattr(P, "available_cpus", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    base = {"data": {"train": "x.jsonl"}, "model": {"max_seq_length": 128}}
    large = P.resolve_plan(CembedConfig.model_validate({**base, "batch": {"per_device_train_batch_size": 16384}}))
    assert large.dataloader_num_workers == 2 and large.dataloader_workers.startswith("auto: 2")
    small = P.resolve_plan(CembedConfig.model_validate({**base, "batch": {"per_device_train_batch_size": 64}}))
    assert small.dataloader_num_workers == 0
    # two processes on the node: 2 cores each, one worker each
    assert (
        P.resolve_plan(
            CembedConfig.model_validate({**base, "batch": {"per_device_train_batch_size": 16384}}), 2
        ).dataloader_num_workers
        == 1
    )
    with pytest.raises(ValueError, match="or auto"):
        CembedConfig.model_validate({**base, "train": {"dataloader_num_workers": -1}})


@pytest.mark.slow
def test_training_with_auto_workers_same_losses(
    tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch, big_shm
):
    """The default (auto) resolving to workers trains with exactly the losses of 0 workers, every step,
    and batches come through the batch fetch (TokenIdRows), not datasets' row fetch."""
    from cembed.config.file import load_config
    from cembed.train.recipe import check_run_inputs, run_training

    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(P, "AUTO_WORKERS_MIN_TEXTS", 32)  # this tiny batch counts as large
    monkeypatch.setattr(P, "available_cpus", lambda: 2)
    fetched = []
    original = TokenIdRows.__getitems__
    monkeypatch.setattr(TokenIdRows, "__getitems__", lambda self, idx: fetched.append(len(idx)) or original(self, idx))
    rows = [{"anchor": f"question {i} about a {'red ' * (i % 7)}car", "positive": f"answer {i}"} for i in range(64)]
    train = pairs_file(rows)
    runs = {}
    for workers in (0, "auto"):
        cfg = load_config(
            write_config(
                {
                    "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                    "data": {"train": str(train)},
                    "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4, "pad_to_multiple_of": 8},
                    "train": {"max_steps": 3, "logging_steps": 1, "output_dir": str(tmp_path / f"w{workers}")}
                    | ({"dataloader_num_workers": workers} if workers == 0 else {}),
                }
            )
        )
        plan, data = check_run_inputs(cfg)
        runs[workers] = run_training(cfg, plan, data)
    assert runs[0]["plan"]["dataloader_num_workers"] == 0
    assert runs["auto"]["plan"]["dataloader_num_workers"] == 1
    assert runs["auto"]["plan"]["dataloader_workers"].startswith("auto: 1")
    # the 0-worker run fetched its batches in this process, a batch (16 rows) at a time; the worker
    # run's batches are fetched in the worker; 64 rows: each run's pre-tokenization check
    assert fetched.count(64) == 2 and fetched.count(16) >= 3 and set(fetched) == {16, 64}
    steps0, steps_auto = runs[0]["step_losses"], runs["auto"]["step_losses"]
    assert len(steps0) == 3 and [s for s, _ in steps0] == [s for s, _ in steps_auto]
    for (_, a), (_, b) in zip(steps0, steps_auto):
        assert a == pytest.approx(b, rel=1e-6)
