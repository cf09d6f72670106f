"""The sweep's study record over every config field (issue 39 item 4): a change of a field outside the
safe list (:data:`SAFE`, the fields that change neither what a trial trains nor how it is scored)
changes the record, a change inside it does not. The fields are found by walking the config schema
(every registered loss and source kind of cembed), and each gets values hypothesis draws from its type."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
import pytest
from hypothesis import HealthCheck, Phase, assume, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample
from pydantic import BaseModel, ValidationError

import cembed.train.sweep as S
from cembed.config.loss import LOSS_CONFIGS, LossConfig
from cembed.config.model import MODEL_CONFIGS, ModelConfig
from cembed.config.schema import CembedConfig
from cembed.config.sources import SOURCE_CONFIGS, SourceConfig
from cembed.train.preflight import flatten

# The spec, written out here (not read from cembed): a field under one of these names changes neither
# the trials nor their scores. A field left off is recorded; adding one here is a decision.
SAFE = {
    "train.max_steps",
    "train.num_train_epochs",
    "train.save_steps",
    "train.push_to_hub",
    "train.report_to",
    "eval.eval_steps",
    "eval.metric_for_best_model",
    "train.output_dir",
    "train.save_total_limit",
    "train.save_every_minutes",
    "train.hub_model_id",
    "train.hub_private_repo",
    "eval.save_total_limit",
    "data.cache_dir",
    "train.logging_steps",
    "train.peak_tflops",
    "model.device",
    "model.gradient_checkpointing",
    "batch.mini_batch_size",
    "batch.mini_batch_num_tokens",
    "batch.sort_by_length",
    "batch.pad_to_multiple_of",
    "batch.unpad",
    "train.dataloader_num_workers",
    "train.torch_compile",
    "data.pretokenize",
    "data.num_proc",
    "eval.batch_size",
    "distributed",
    "loss.score_query_tokens",
    "loss.score_document_tokens",
    "loss.score_document_rows",
    "loss.score_kernel",
    "data.columns.ignore",
    "data.train.columns.ignore",
}


def _safe(key: str) -> bool:
    return any(key == name or key.startswith(name + ".") for name in SAFE)


BASE: dict[str, Any] = {
    "model": {"name_or_path": "some-model", "max_seq_length": 16, "device": "cpu", "precision": "fp32"},
    "data": {"train": {"kind": "file", "path": "pairs.jsonl"}, "cache_dir": "cache"},
    "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
    "optim": {"learning_rate": 1e-3},
    "train": {"max_steps": 100, "output_dir": "run", "dataloader_num_workers": 0},
    "eval": {"sts": ["sts.tsv"], "retrieval": ["beir-folder"], "eval_steps": 5},
}
# The least a section needs to be present (its required fields).
MINIMAL = {"MatryoshkaConfig": {"dims": [4]}, "CachedGISTLossConfig": {"name": "cached_gist", "guide": "g"}}
NAMES = st.text("abcdefgh", min_size=1, max_size=6)


def _members(annotation) -> list:
    """An annotation's alternatives (through unions and ``Annotated``)."""
    if get_origin(annotation) is typing.Annotated:
        return _members(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return [m for arg in get_args(annotation) for m in _members(arg)]
    return [annotation]


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _variants(cls: type[BaseModel]) -> list[type[BaseModel]]:
    """A registry's base stands for each of cembed's own registered classes (a plugin's are its own)."""
    registry = {LossConfig: LOSS_CONFIGS, SourceConfig: SOURCE_CONFIGS, ModelConfig: MODEL_CONFIGS}.get(cls)
    if registry is None:
        return [cls]
    return [c for c in registry.values() if c.__module__.startswith("cembed.")]


def walk(cls: type[BaseModel], prefix: str = "", sections: tuple = ()) -> dict[str, tuple]:
    """Every leaf field under ``cls``: ``{dotted path: (FieldInfo, the sections to make present)}``; a
    section is ``(dotted path, model class)``. A field holding one model (or none) is walked into (and is
    a leaf itself when it may be None); a union of a model and other types, or a list of models, is a leaf.
    A path met under several loss or source classes is kept once (the first class's)."""
    out: dict[str, tuple] = {}
    for name, info in cls.model_fields.items():
        path = f"{prefix}{name}"
        members = [m for m in _members(info.annotation) if m is not type(None)]
        if path == "data.train":  # one source (a list of them is drawn below, by name)
            members = [m for m in members if _is_model(m)]
        if len(members) == 1 and _is_model(members[0]):
            if type(None) in _members(info.annotation):
                out.setdefault(path, (info, sections))
            for variant in _variants(members[0]):
                inner = walk(variant, path + ".", (*sections, (path, variant)))
                for key, value in inner.items():
                    out.setdefault(key, value)
        else:
            out.setdefault(path, (info, sections))
    return out


def _bounds(metadata) -> tuple[float | None, float | None, bool]:
    lo = hi = None
    strict_hi = False
    for m in metadata:
        if isinstance(m, at.Gt):
            lo = m.gt + (1 if isinstance(m.gt, int) else 1e-3)
        elif isinstance(m, at.Ge):
            lo = m.ge
        elif isinstance(m, at.Lt):
            hi, strict_hi = m.lt, True
        elif isinstance(m, at.Le):
            hi = m.le
    return lo, hi, strict_hi


def strategy(annotation, metadata=()) -> st.SearchStrategy:
    """Values of a type, as YAML would give them (a model as a dict of its fields)."""
    if get_origin(annotation) is typing.Annotated:
        inner, *meta = get_args(annotation)
        return strategy(inner, [*metadata, *meta])
    if get_origin(annotation) in (Union, types.UnionType):
        return st.one_of([strategy(a, metadata) for a in get_args(annotation)])
    if get_origin(annotation) is Literal:
        return st.sampled_from(get_args(annotation))
    if annotation is type(None):
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        lo, _, _ = _bounds(metadata)
        lo = int(lo if lo is not None else 0)
        return st.integers(lo, lo + 15)
    if annotation is float:
        lo, hi, strict = _bounds(metadata)
        lo = lo if lo is not None else 0.0
        hi = hi if hi is not None else lo + 100.0
        return st.floats(lo, hi, exclude_max=strict, allow_nan=False)
    if annotation is str:
        return NAMES
    if annotation is Any:
        return st.integers(0, 9) | NAMES
    if get_origin(annotation) in (list, tuple):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        items = st.lists(strategy(args[0]), max_size=3, unique_by=repr)
        return items.map(tuple) if get_origin(annotation) is tuple else items
    if get_origin(annotation) is dict:
        return st.dictionaries(NAMES, strategy(get_args(annotation)[1]), max_size=2)
    if _is_model(annotation):
        return model_dict(annotation)
    raise AssertionError(f"no strategy for {annotation!r}: teach this test its values")


def model_dict(cls: type[BaseModel]) -> st.SearchStrategy:
    required = {n: strategy(f.annotation, f.metadata) for n, f in cls.model_fields.items() if f.is_required()}
    optional = {n: strategy(f.annotation, f.metadata) for n, f in cls.model_fields.items() if not f.is_required()}
    return st.fixed_dictionaries(required, optional=optional)


# Fields whose one change never validates alone: what they are drawn with (each change a dict of
# dotted path -> value; None removes the key).
def _with(path: str, values: st.SearchStrategy, **also) -> st.SearchStrategy:
    return values.map(lambda v: {path: v, **{k.replace("__", "."): a for k, a in also.items()}})


SPECIAL: dict[str, st.SearchStrategy] = {
    "batch.global_batch_size": _with(
        "batch.global_batch_size", st.integers(4, 64), batch__per_device_train_batch_size=None
    ),
    "train.num_train_epochs": _with("train.num_train_epochs", st.floats(0.1, 5), train__max_steps=None),
    "train.push_to_hub": _with("train.push_to_hub", st.just(True), train__hub_model_id="me/model"),
    "loss.hardness_mode": _with(
        "loss.hardness_mode",
        st.sampled_from(["in_batch_negatives", "hard_negatives", "all_negatives"]),
        loss__hardness_strength=5.0,
    ),
    "loss.hardness_strength": _with("loss.hardness_strength", st.floats(0.5, 9), loss__hardness_mode="hard_negatives"),
    "loss.name": st.sampled_from([{"loss.name": "mnrl"}, {"loss.name": "cached_gist", "loss.guide": "g"}]),
    "loss.directions": st.lists(
        st.sampled_from(["query_to_query", "doc_to_query", "doc_to_doc"]), max_size=3, unique=True
    ).map(lambda d: {"loss.directions": ["query_to_doc", *d]}),
    "data.train.kind": st.sampled_from(["hub", "beir"]).map(lambda k: {"data.train.kind": k}),
    "data.sampling.weights": st.floats(0.1, 5).map(lambda w: {"data.sampling.weights": {"pairs": w}}),
    "data.sampling.strategy": st.sampled_from(["proportional", "round_robin"]).map(
        lambda s: {"data.sampling.strategy": s}
    ),
    "model.kind": st.sampled_from([k for k, c in MODEL_CONFIGS.items() if c.__module__.startswith("cembed.")]).map(
        lambda k: {"model.kind": k, "loss.name": MODEL_CONFIGS[k].default_loss, "eval.sts": []}
    ),
    "eval.retrieval": st.lists(NAMES, max_size=2).map(lambda p: {"eval.retrieval": p}),
    "eval.sts": st.lists(NAMES, max_size=2).map(lambda p: {"eval.sts": p}),
}


def _set(config: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if value is None and last in node and path in ("batch.per_device_train_batch_size", "train.max_steps"):
        del node[last]
    else:
        node[last] = value


def _baseline(sections: tuple) -> dict:
    """BASE with each section a field sits in made present (its class picked, its required fields set)."""
    import copy

    config = copy.deepcopy(BASE)
    for path, cls in sections:
        *parents, last = path.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        present = node.get(last) if isinstance(node.get(last), dict) else {}
        node[last] = {**present, **MINIMAL.get(cls.__name__, {})}
        if path in ("data.train", "model"):  # a registry's class is picked by its literal
            literal = "kind"
            node[last] = {**node[last], literal: typing.get_args(cls.model_fields[literal].annotation)[0]}
        if path == "data.train":
            node[last].setdefault("path", "pairs.jsonl")
        if path == "model" and cls.default_loss != "cached_mnrl":  # the kind's own loss trains it
            config.setdefault("loss", {}).setdefault("name", cls.default_loss)
        if path == "model" and "eval.sts" in cls.not_options:
            config["eval"]["sts"] = []
        if path == "loss" and cls.consumes != frozenset({"vector"}):  # a model kind whose output it trains
            kind = next(
                k for k, c in MODEL_CONFIGS.items() if c.output in cls.consumes and c.__module__.startswith("cembed.")
            )
            config["model"]["kind"] = kind
            if "eval.sts" in MODEL_CONFIGS[kind].not_options:
                config["eval"]["sts"] = []
    return config


def _evaluate(config: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """The validated config's fields, dotted (several sources' as ``data.train.<name>.<field>``),
    and its sweep record (the same data contents for every config).

    Raises:
        ValidationError: not a valid config.
    """
    cfg = CembedConfig.model_validate(config, context={"base": Path.cwd()})
    dumped = cfg.model_dump(mode="json")
    train = dumped["data"].pop("train")
    flat = flatten(dumped)
    for source in train if isinstance(train, list) else [train]:
        prefix = f"data.train.{source['name']}" if isinstance(train, list) else "data.train"
        flat.update({f"{prefix}.{k}": v for k, v in flatten(source).items()})
    contents = {"data.train (contents)": {"source": "pairs.jsonl", "rows": "16 rows", "xxh3": "0" * 32}}
    return flat, S.sweep_record(cfg, cfg.model.precision, 5, contents)


def _record(config: dict) -> dict[str, Any]:
    return _evaluate(config)[1]


def _changed(sections: tuple, change: dict[str, Any]) -> dict:
    config = _baseline(sections)
    for key, value in change.items():
        _set(config, key, value)
    return config


LEAVES = walk(CembedConfig)


def test_the_walk_finds_the_fields_of_every_section_loss_and_source_kind():
    """The walk reaches into each section and each of cembed's loss and source classes."""
    for path in (
        "model.lora.target_modules",
        "batch.gradient_accumulation_steps",
        "loss.matryoshka.dims",
        "loss.guide",
        "loss.false_negative_filter.margin",
        "data.train.streaming.window_batches",
        "data.train.columns.ignore",
        "data.prompts.anchor",
        "data.num_proc",
        "train.peak_tflops",
        "eval.batch_size",
        "distributed.strategy",
        "model.kind",
        "model.query_length",
        "loss.score_document_tokens",
    ):
        assert path in LEAVES, path
    assert len(LEAVES) > 90


def test_the_safe_list_is_the_spec():
    assert set(S.NOT_RECORDED) == SAFE


@pytest.mark.parametrize("path", sorted(LEAVES))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(data=st.data())
def test_a_field_outside_the_safe_list_changes_the_record_inside_it_does_not(path, data):
    info, sections = LEAVES[path]
    values = SPECIAL[path] if path in SPECIAL else strategy(info.annotation, info.metadata).map(lambda v: {path: v})
    change = data.draw(values)
    try:
        after, record = _evaluate(_changed(sections, change))
    except ValidationError:
        assume(False)  # not a valid config (a rule across fields)
    before, base_record = _evaluate(_baseline(sections))
    differs = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assume(differs)  # the value drawn was the one already there
    recorded = any(not _safe(k) for k in differs)
    assert (record != base_record) == recorded, (change, sorted(differs))


def test_every_field_has_values_that_validate():
    """Each field has a drawn change that validates and differs (else the property test above would
    pass by rejecting every example)."""
    missing = []
    for path, (info, sections) in sorted(LEAVES.items()):
        before = _evaluate(_baseline(sections))[0]

        def valid_change(change, sections=sections, before=before):
            try:
                return _evaluate(_changed(sections, change))[0] != before
            except ValidationError:
                return False

        values = (
            SPECIAL[path] if path in SPECIAL else strategy(info.annotation, info.metadata).map(lambda v, p=path: {p: v})
        )
        try:
            find(values, valid_change, settings=settings(max_examples=100, database=None, phases=[Phase.generate]))
        except NoSuchExample:
            missing.append(path)
    assert missing == []


def test_gradient_accumulation_changes_the_record():
    """The mutation that survived issue 32's audit: a record without batch.gradient_accumulation_steps
    would read back trials of another optimizer step (each accumulated batch is its own contrastive batch)."""
    base = _baseline(())
    more = _baseline(())
    more["batch"]["gradient_accumulation_steps"] = 4
    old, new = _record(base), _record(more)
    assert S.record_differences(old, new) == [("batch.gradient_accumulation_steps", 1, 4)]
    assert S.record_fingerprint(old) != S.record_fingerprint(new)


def test_several_sources_are_recorded_by_name_their_ignored_columns_not():
    base = _baseline(())
    base["data"]["train"] = {"a": {"path": "a.jsonl", "columns": {}}, "b": {"path": "b.jsonl"}}
    ignored = _baseline(())
    ignored["data"]["train"] = {"a": {"path": "a.jsonl", "columns": {"ignore": ["id"]}}, "b": {"path": "b.jsonl"}}
    capped = _baseline(())
    capped["data"]["train"] = {"a": {"path": "a.jsonl", "columns": {}}, "b": {"path": "b.jsonl", "max_samples": 5}}
    assert _record(ignored) == _record(base)
    assert S.record_differences(_record(base), _record(capped)) == [("data.train.b.max_samples", None, 5)]
