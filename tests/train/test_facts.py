"""cembed.train.facts: a run's batches per epoch (per source and through the sampling schedule),
its optimizer steps and warmup, the rows the no-duplicates sampler cannot place and the loss's path,
counted by hand for small tables (no model is loaded)."""

from __future__ import annotations

import pytest
from conftest import distinct_pairs

from cembed.config.data import SamplingConfig
from cembed.config.file import load_config
from cembed.data.batching.placement import sampler_hashes
from cembed.data.rows import UnloadedData
from cembed.errors import UserError
from cembed.model.unpad import Unpadding
from cembed.plan.resolve import resolve_plan
from cembed.train.facts import LossPath, StepFacts, batch_count, loss_path, run_facts
from cembed.train.recipe import check_run_inputs

POPULAR = "a popular answer"


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _config(write_config, data, per_device=4, **sections):
    """A config training on ``data`` (``data.train``) with ``sections`` (``batch`` merged)."""
    cfg = {
        "model": {"device": "cpu"},
        "data": {"train": data},
        "batch": {"per_device_train_batch_size": per_device, "mini_batch_size": 2, **sections.pop("batch", {})},
    }
    cfg.update(sections)
    return load_config(write_config(cfg))


def _facts(cfg, **kwargs):
    plan, data = check_run_inputs(cfg)
    return run_facts(cfg, plan, data, **kwargs)


def test_batch_count_counts_a_short_last_batch_unless_dropped():
    assert batch_count(10, 4, drop_last=False) == 3
    assert batch_count(10, 4, drop_last=True) == 2
    assert batch_count(8, 4, drop_last=True) == batch_count(8, 4, drop_last=False) == 2
    assert batch_count(3, 4, drop_last=True) == 0


def test_epochs_give_steps_per_epoch_total_and_warmup(write_config, pairs_file):
    # 10 rows, batch 4, short last batch kept: 3 batches; 2 per optimizer step: ceil(3 / 2) = 2 steps
    # an epoch; 2.5 epochs: ceil(2.5 x 2) = 5 steps, ceil(5 x 0.25) = 2 of them warmup.
    cfg = _config(
        write_config,
        str(pairs_file(distinct_pairs(10))),
        batch={"drop_last": False, "gradient_accumulation_steps": 2},
        optim={"warmup_ratio": 0.25},
        train={"num_train_epochs": 2.5},
    )
    facts = _facts(cfg)
    assert (facts.global_batch, facts.drop_last) == (4, False)
    assert facts.source_batches == (3,) and facts.batches_per_epoch == 3
    assert facts.steps == StepFacts(total=5, total_from="train.num_train_epochs: 2.5", per_epoch=2, warmup=2)
    assert facts.warnings == ()


def test_drop_last_and_max_steps(write_config, pairs_file):
    # drop_last (the default): 10 rows give 2 batches of 4; train.max_steps sets the length, the
    # warmup is ceil(7 x 0.1) = 1 step.
    cfg = _config(write_config, str(pairs_file(distinct_pairs(10))), train={"max_steps": 7})
    facts = _facts(cfg)
    assert facts.drop_last is True and facts.batches_per_epoch == 2
    assert facts.steps == StepFacts(total=7, total_from="train.max_steps", per_epoch=2, warmup=1)


def test_two_processes_force_drop_last_and_double_the_global_batch(write_config, pairs_file):
    cfg = _config(write_config, str(pairs_file(distinct_pairs(10))), batch={"drop_last": False})
    plan, data = check_run_inputs(cfg)
    plan = resolve_plan(cfg, world_size=2)  # the data does not depend on it: 10 rows in batches of 8
    facts = run_facts(cfg, plan, data)
    assert (facts.global_batch, facts.drop_last, facts.batches_per_epoch) == (8, True, 1)
    assert facts.steps.per_epoch == 1 and facts.steps.total == 1  # one epoch (train.num_train_epochs 1)


@pytest.mark.parametrize(
    ("sampling", "batches"),
    [
        ({}, 4),  # proportional: every source's batches once: 3 + 1
        ({"strategy": "round_robin"}, 2),  # one of each in turn until b runs out
        ({"weights": {"a": 1, "b": 1}}, 3),  # equal shares, ties to a: a, b, a, then b's turn finds none
    ],
)
def test_several_sources_count_batches_per_source_through_the_schedule(write_config, pairs_file, sampling, batches):
    rows = distinct_pairs(14)
    train = {"a": {"path": str(pairs_file(rows[:10], "a.jsonl"))}, "b": {"path": str(pairs_file(rows[10:], "b.jsonl"))}}
    cfg = _config(write_config, train, batch={"drop_last": False})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"sampling": SamplingConfig(**sampling)})})
    facts = _facts(cfg)
    assert facts.source_batches == (3, 1)  # 10 rows and 4 rows in batches of 4
    assert facts.batches_per_epoch == batches and facts.steps.per_epoch == batches


def test_unplaceable_rows_are_warnings_of_the_no_duplicates_sampler_only(write_config, pairs_file):
    # 12 rows, 8 sharing one positive: a duplicate-free batch of 4 holds one of them, so one batch is
    # built and 8 rows are left out (tests/data/test_placement.py counts the same table).
    rows = [{"anchor": f"question {i}", "positive": POPULAR if i < 8 else f"answer {i}"} for i in range(12)]
    path = str(pairs_file(rows))
    (warning,) = _facts(_config(write_config, path)).warnings
    assert warning.startswith("8 of 12 rows cannot be placed in a duplicate-free batch of 4 (1 batches per epoch)")
    assert f"{POPULAR!r} is in 8 rows" in warning
    plain = _config(write_config, path, sampler={"no_duplicates": False})
    assert _facts(plain).warnings == ()  # a plain sampler places every row
    assert _facts(_config(write_config, path), placement=False).warnings == ()
    # the counts are the rows', not the sampler's: 12 rows are 3 batches of 4
    assert _facts(_config(write_config, path)).batches_per_epoch == 3


def test_unloaded_hub_data_counts_nothing(write_config, pairs_file):
    cfg = _config(write_config, str(pairs_file(distinct_pairs(10))), optim={"warmup_ratio": 0.5})
    plan = resolve_plan(cfg)
    facts = run_facts(cfg, plan, UnloadedData("org/pairs", "offline: HF_DATASETS_OFFLINE=1"))
    assert (facts.source_batches, facts.batches_per_epoch, facts.warnings) == ((), None, ())
    assert facts.steps == StepFacts(total=None, total_from="train.num_train_epochs: 1", per_epoch=None, warmup=None)
    capped = _config(write_config, str(pairs_file(distinct_pairs(10))), train={"max_steps": 9})
    steps = run_facts(capped, resolve_plan(capped), UnloadedData("org/pairs", "offline")).steps
    assert steps == StepFacts(total=9, total_from="train.max_steps", per_epoch=None, warmup=1)


def test_the_loss_path(write_config, pairs_file):
    path = str(pairs_file(distinct_pairs(10)))
    cached = _config(write_config, path, batch={"sort_by_length": False})  # the default loss: cached_mnrl
    plan = resolve_plan(cached)
    assert loss_path(cached, plan) == LossPath(True, 2, False, None, 4)  # packing unknown without the model
    packs = Unpadding(True, "packed rows")
    assert loss_path(cached, plan, attention=packs).packed is True
    assert loss_path(cached, plan, attention=packs).description == "packed (unpadded) mini-batches"
    pads = loss_path(cached, plan, attention=Unpadding(False, "padded"))
    assert pads.description == "sorted=False, padded per mini-batch of 2"
    plain = _config(write_config, path, loss={"name": "mnrl"})
    assert loss_path(plain, resolve_plan(plain)) == LossPath(False, 4, False, False, 3)  # one forward, the batch
    auto = _config(write_config, path, batch={"mini_batch_size": "auto"})
    assert loss_path(auto, resolve_plan(auto)).mini_batch_size == 4  # auto: probed later; the batch until then
    assert _facts(cached).loss == loss_path(cached, plan)


@pytest.mark.parametrize(
    ("sampling", "drop_last", "unused"),
    [
        # 37 rows -> 9 batches of 4 (a short batch of 1 row is never kept), 8 rows -> 2: two rounds,
        # 8 of 37 rows trained
        ({"strategy": "round_robin"}, False, {0: 29}),
        # drop_last: 9 full batches and 2; still 2 rounds: the 29 rows include the 1 no batch holds
        ({"strategy": "round_robin"}, True, {0: 29}),
        # equal weights: a, b, a, b, a, then b's turn finds none: big trains 3 batches (12 rows)
        ({"weights": {"big": 1, "small": 1}}, False, {0: 25}),
        # small weighted 4x: b, b, a, then b's turn finds none: big trains one batch (4 rows)
        ({"weights": {"big": 1, "small": 4}}, False, {0: 33}),
        ({}, False, {}),  # proportional: every batch of every source, nothing unused
    ],
)
def test_a_schedule_that_leaves_rows_unused_says_so_and_counts_what_the_sampler_yields(
    write_config, pairs_file, sampling, drop_last, unused
):
    """Issue 32 item 10: round_robin / weighted end the epoch when a source runs out; the other
    sources' remaining rows go unused each epoch. The warning's count is the one the sampler's own
    epoch plan gives: compared here to the rows the training sampler yields for epoch 0."""
    from collections import Counter

    from cembed.data.batching.full_table import NoDuplicatesSampler
    from cembed.data.batching.mixture import SourceMix

    rows = distinct_pairs(45)
    train = {
        "big": {"path": str(pairs_file(rows[:37], "big.jsonl"))},
        "small": {"path": str(pairs_file(rows[37:], "small.jsonl"))},
    }
    cfg = _config(write_config, train, batch={"drop_last": drop_last}, train={"seed": 3})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"sampling": SamplingConfig(**sampling)})})
    plan, data = check_run_inputs(cfg)
    facts = run_facts(cfg, plan, data)
    strategy = cfg.data.sampling.resolved_strategy
    expected = [
        f"{data.sources[i].where}: {n} of 37 rows ({round(100 * n / 37)}%) unused each epoch under "
        f"data.sampling.strategy {strategy}"
        for i, n in unused.items()
    ]
    # (37 rows leave one row over a batch of 4 either way: the unplaceable-rows warning says that)
    found = [w for w in facts.warnings if "unused each epoch" in w]
    assert [w.split(": the schedule")[0] for w in found] == expected, facts.warnings
    assert all("set data.sampling.strategy: proportional" in w for w in found)
    # what the trainer's sampler yields in one epoch, per source
    sampler = NoDuplicatesSampler(
        data.dataset, 4, drop_last, seed=3, world_size=1, sources=SourceMix.from_data(data, cfg.data.sampling)
    )
    sampler.set_epoch(0)
    yielded = Counter(int(r >= 37) for batch in sampler for r in batch)
    assert 37 - yielded[0] == unused.get(0, 1)  # proportional: only the row no batch of 4 holds
    assert yielded[1] == 8


# --- with the loaded model (validate, estimate): rows compared as training compares them, the prompt's
# room, the sampler's refusal, the tokenizing fallback and whether the loss packs rows


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(tiny_model_dir), device="cpu")


def _model_config(write_config, tiny_model_dir, tmp_path, train, **sections):
    """A config training ``tiny_model_dir`` on ``train`` (``data`` merged: its cache in ``tmp_path``)."""
    data = {"train": train, "cache_dir": str(tmp_path / "cache"), **sections.pop("data", {})}
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": data,
        "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2, **sections.pop("batch", {})},
        **sections,
    }
    return load_config(write_config(cfg))


# Two spellings of one answer: different texts, the same token ids for the uncased tokenizer.
CASED = ("A Popular Answer", "a popular ANSWER")


def test_with_the_model_the_sampler_compares_token_ids_as_training_does(
    write_config, pairs_file, tiny_model_dir, tiny_model, tmp_path, monkeypatch
):
    import cembed.train.facts as facts

    given = []  # validate's model is the one whose tokenizer compares the rows, not loaded a second time

    def spy(data, model_cfg, data_cfg=None, model=None):
        given.append(model)
        return sampler_hashes(data, model_cfg, data_cfg, model=model)

    monkeypatch.setattr(facts, "sampler_hashes", spy)
    rows = [{"anchor": f"question {i}", "positive": CASED[i % 2] if i < 8 else f"answer {i}"} for i in range(12)]
    cfg = _model_config(write_config, tiny_model_dir, tmp_path, str(pairs_file(rows)))
    plan, data = check_run_inputs(cfg)
    tail = (
        "and are not trained on: their texts repeat across rows, most of all column 'positive' (role positive): "
        "{text!r} is in {n} rows and a batch holds it at most once; deduplicate that column, lower "
        "batch.per_device_train_batch_size or set sampler.no_duplicates: false"
    )
    # the texts: two answers of 4 rows each
    (raw,) = run_facts(cfg, plan, data).warnings
    assert raw == "4 of 12 rows cannot be placed in a duplicate-free batch of 4 (2 batches per epoch) " + tail.format(
        text=CASED[1], n=4
    )
    # the token ids training compares: one answer in 8 rows
    (ids,) = run_facts(cfg, plan, data, model=tiny_model).warnings
    assert ids == "8 of 12 rows cannot be placed in a duplicate-free batch of 4 (1 batches per epoch) " + tail.format(
        text=CASED[1], n=8
    )
    assert given == [tiny_model]
    # data.pretokenize false: the sampler sees the texts, and so does the count
    plain = _model_config(write_config, tiny_model_dir, tmp_path, str(pairs_file(rows)), data={"pretokenize": False})
    assert run_facts(plain, plan, data, model=tiny_model).warnings == (raw,)


def test_with_the_model_a_source_no_batch_can_be_built_from_is_refused(
    write_config, pairs_file, tiny_model_dir, tiny_model, tmp_path
):
    # six different texts (the loader finds enough for a batch of 4), three as token ids
    spellings = ["Alpha one", "alpha ONE", "Beta two", "beta TWO", "Gamma three", "gamma THREE"]
    rows = [{"anchor": f"question {i}", "positive": text} for i, text in enumerate(spellings)]
    path = pairs_file(rows)
    cfg = _model_config(write_config, tiny_model_dir, tmp_path, str(path))
    plan, data = check_run_inputs(cfg)
    with pytest.raises(UserError) as err:
        run_facts(cfg, plan, data, model=tiny_model)
    assert str(err.value) == (
        f"{path}: the no-duplicates sampler cannot fill a single batch of 4 rows: column 'positive' (role positive) "
        f"has only 3 distinct texts (compared as token ids ({tiny_model_dir}, max_seq_length 64)), so no "
        "duplicate-free batch of 4 rows exists; set batch.per_device_train_batch_size to 3 or less (the largest "
        "that fills a batch; epoch 0 as the sampler shuffles it), deduplicate that column or set "
        "sampler.no_duplicates: false"
    )
    # batch.drop_last false: the short batch of three is kept, and the rest of the rows are a warning
    kept = _model_config(write_config, tiny_model_dir, tmp_path, str(path), batch={"drop_last": False})
    (warning,) = run_facts(kept, plan, data, model=tiny_model).warnings
    assert warning.startswith("3 of 6 rows cannot be placed in a duplicate-free batch of 4 (1 batches per epoch)")


@pytest.mark.parametrize("where", ["config", "model"])
def test_with_the_model_a_prompt_that_leaves_no_room_is_refused(
    write_config, pairs_file, tiny_model_dir, tiny_model, tmp_path, monkeypatch, where
):
    prompt = "x" * 70  # one 70-letter word: 70 word pieces, 72 tokens with [CLS] and [SEP]
    path = pairs_file(distinct_pairs(12))
    prompts = {"prompts": {"anchor": prompt}} if where == "config" else {}
    cfg = _model_config(write_config, tiny_model_dir, tmp_path, str(path), data=prompts)
    if where == "model":
        monkeypatch.setattr(tiny_model, "prompts", {"query": prompt})  # the model's own query prompt
    plan, data = check_run_inputs(cfg)
    field = "data.prompts.anchor" if where == "config" else "model prompt 'query'"
    with pytest.raises(UserError) as err:
        run_facts(cfg, plan, data, model=tiny_model)
    assert str(err.value) == (
        f"{field} {prompt!r}: 72 tokens with the model's special tokens, max_seq_length 64, so no token of the "
        f"anchor texts of {path} is left (each is the prompt alone, and the no-duplicates sampler finds them all "
        "equal); shorten the prompt or raise model.max_seq_length above 72"
    )


def test_with_the_model_the_tokenizing_fallback_is_the_first_warning(
    write_config, pairs_file, tiny_model_dir, tiny_model, tmp_path, monkeypatch
):
    import cembed.data.tokens.tokenize as tokenize

    monkeypatch.setattr(tokenize, "matches_model_preprocessing", lambda *args, **kwargs: False)
    rows = [{"anchor": f"question {i}", "positive": POPULAR if i < 8 else f"answer {i}"} for i in range(12)]
    cfg = _model_config(write_config, tiny_model_dir, tmp_path, str(pairs_file(rows)))
    plan, data = check_run_inputs(cfg)
    warnings = run_facts(cfg, plan, data, model=tiny_model).warnings
    assert warnings[0] == tokenize.IDS_DIFFER_WARNING
    assert len(warnings) == 2 and warnings[1].startswith("8 of 12 rows cannot be placed")


def test_with_the_model_the_loss_path_says_whether_rows_are_packed(
    write_config, pairs_file, tiny_model_dir, tiny_model, tmp_path
):
    path = str(pairs_file(distinct_pairs(12)))
    cfg = _model_config(write_config, tiny_model_dir, tmp_path, path)
    plan, data = check_run_inputs(cfg)
    assert run_facts(cfg, plan, data, model=tiny_model).loss.packed is True  # BERT packs its rows
    assert run_facts(cfg, plan, data, attention=Unpadding(True, "packed rows")).loss.packed is True
    assert run_facts(cfg, plan, data).loss.packed is None  # neither: unknown
    padded = _model_config(write_config, tiny_model_dir, tmp_path, path, batch={"unpad": False})
    assert loss_path(padded, plan, model=tiny_model).packed is False
    # an unreachable hub dataset with the model loaded: nothing counted, the loss path still known
    facts = run_facts(cfg, plan, UnloadedData("org/pairs", "offline"), model=tiny_model)
    assert (facts.source_batches, facts.batches_per_epoch, facts.warnings, facts.loss.packed) == ((), None, (), True)


# --- what the rows' arithmetic does not see: a stream, a table without sources, the schedule's own count


def test_a_stream_counts_nothing(write_config, pairs_file):
    cfg = _config(
        write_config,
        {"path": str(pairs_file(distinct_pairs(40))), "streaming": {"check_rows": 16}},
        train={"max_steps": 5},
    )
    facts = _facts(cfg)
    assert (facts.source_batches, facts.batches_per_epoch, facts.warnings) == ((None,), None, ())
    assert (facts.steps.total, facts.steps.per_epoch) == (5, None)


def test_data_without_sources_is_counted_as_one_table(write_config, pairs_file):
    """A ``TrainingData`` built without its per-source records (``cembed init`` builds one) counts
    as one source of all its rows."""
    from cembed.data.rows import TrainingData

    cfg = _config(write_config, str(pairs_file(distinct_pairs(10))))
    plan, data = check_run_inputs(cfg)
    table = TrainingData(data.dataset, "pairs", 10)
    assert run_facts(cfg, plan, table).batches_per_epoch == 2  # drop_last (the default): 10 rows, batches of 4
    kept = _config(write_config, str(pairs_file(distinct_pairs(10))), batch={"drop_last": False})
    assert run_facts(kept, plan, table).batches_per_epoch == 3


def _two_sources(write_config, pairs_file, big_rows, small_rows, **sections):
    train = {
        "big": {"path": str(pairs_file(big_rows, "big.jsonl"))},
        "small": {"path": str(pairs_file(small_rows, "small.jsonl"))},
    }
    cfg = _config(write_config, train, **sections)
    sampling = SamplingConfig(strategy="round_robin")
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"sampling": sampling})})


def _unused(facts) -> list[str]:
    return [w.split(" unused each epoch")[0].split(": ", 1)[1] for w in facts.warnings if "unused each epoch" in w]


def test_the_schedules_count_compares_texts_only_under_the_no_duplicates_sampler(write_config, pairs_file):
    # big: 16 rows, 8 of them one question; small: 4 rows, one batch: round_robin takes one batch of each
    big = [{"anchor": POPULAR if i < 8 else f"question {i}", "positive": f"answer {i}"} for i in range(16)]
    small = [{"anchor": f"small question {i}", "positive": f"small answer {i}"} for i in range(4)]
    plain = _two_sources(write_config, pairs_file, big, small, sampler={"no_duplicates": False}, train={"seed": 3})
    plan, data = check_run_inputs(plain)
    big_where, small_where = (s.where for s in data.sources)

    def warning(batches: int) -> str:
        return (
            f"{big_where}: 12 of 16 rows (75%) unused each epoch under data.sampling.strategy round_robin: the "
            f"schedule ends the epoch when {small_where} has no batch left, after 1 of this source's {batches} "
            "batches; set data.sampling.strategy: proportional to train on every source's batches each epoch "
            "(each source's share of steps its share of rows)"
        )

    # texts not compared: big's 16 rows are 4 batches
    assert run_facts(plain, plan, data).warnings == (warning(4),)
    assert run_facts(plain, plan, data, placement=False).warnings == ()  # estimate: no sampler run
    # no duplicates: a batch holds the popular question once, big's rows make 2 batches
    dedup = _two_sources(write_config, pairs_file, big, small, train={"seed": 3})
    assert run_facts(dedup, plan, data).warnings[1:] == (warning(2),)
    assert run_facts(dedup, plan, data, placement=False).warnings == ()
    # a run without sampler.no_duplicates on an unreachable hub dataset: nothing to count
    assert run_facts(plain, plan, UnloadedData("org/pairs", "offline")).warnings == ()


def test_the_schedules_count_follows_drop_last(write_config, pairs_file):
    # big: 40 rows (10 batches of 4); small: 10 rows, 3 batches with its short last one, 2 without
    rows = distinct_pairs(50)
    for drop_last, unused in ((False, "28 of 40 rows (70%)"), (True, "32 of 40 rows (80%)")):
        cfg = _two_sources(write_config, pairs_file, rows[:40], rows[40:], batch={"drop_last": drop_last})
        assert _unused(_facts(cfg)) == [unused], drop_last
