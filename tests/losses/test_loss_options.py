"""Loss options beyond plain in-batch negatives (issue 16): CMNRL's own options, guided (GIST) and
self-guided false-negative filtering, Matryoshka. Every option: cached == plain reference at several
mini-batch sizes (loss and gradients within 1e-5 relative), with dropout where the option allows."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TEXTS, distinct_pairs, features_for, loss_and_grads, make_tiny_model, rel_diff
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.gradcache import _create_minibatch
from sentence_transformers.sentence_transformer.losses import GISTEmbedLoss, MultipleNegativesRankingLoss

from cembed.config.file import config_from_dict, load_config
from cembed.config.loss import loss_config
from cembed.errors import UserError
from cembed.losses.gist import LengthSortedCachedGIST, SelfGuidedCachedMNRL
from cembed.losses.matryoshka import CountingMatryoshkaLoss
from cembed.losses.registry import build_loss
from cembed.train.recipe import check_run_inputs, run_training

TRIPLETS = ("anchor", "positive", "negative_1")
MBS = (1, 3, 7)

# ----------------------------------------------------------------------------------------------
# 4. CMNRL's own options

OPTIONS = [
    {"directions": ["query_to_doc", "query_to_query", "doc_to_doc"]},  # GTE's improved contrastive loss
    {"directions": ["query_to_doc", "doc_to_query"], "partition_mode": "per_direction"},
    {"symmetric": True, "hardness_mode": "in_batch_negatives", "hardness_strength": 9},
    {"hardness_mode": "hard_negatives", "hardness_strength": 5},
    {
        "directions": ["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"],
        "hardness_mode": "all_negatives",
        "hardness_strength": 3,
    },
]


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTIONS)
def test_mnrl_options_cached_equals_plain(tiny_model_dir, options):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = features_for(model, TRIPLETS)
    plain = build_loss(model, loss_config(name="mnrl", **options), 1).module
    assert plain.directions == tuple(loss_config(**options).resolved_directions())
    assert plain.partition_mode == options.get("partition_mode", "joint")
    assert plain.hardness_mode == options.get("hardness_mode")
    ref_loss, ref_grads = loss_and_grads(model, plain, features)
    default_loss, _ = loss_and_grads(model, build_loss(model, loss_config(name="mnrl"), 1).module, features)
    assert rel_diff(ref_loss, default_loss) > 1e-3  # the options reach the loss
    for mbs in MBS:
        cached = build_loss(model, loss_config(**options), mbs).module
        assert cached.hardness_strength == options.get("hardness_strength", 0.0)
        loss, grads = loss_and_grads(model, cached, features)
        assert rel_diff(loss, ref_loss) <= 1e-5, mbs
        assert rel_diff(grads, ref_grads) <= 1e-5, mbs


def _same_masks_reps(model, features, mbs, seed):
    """Each column embedded with gradients in the cached loss's mini-batches, from ``seed``: the same
    dropout masks the cached loss draws (it embeds columns in order, mini-batch by mini-batch)."""
    torch.manual_seed(seed)
    n = features[0]["input_ids"].shape[0]
    return [
        torch.cat([model(_create_minibatch(f, b, b + mbs))["sentence_embedding"] for b in range(0, n, mbs)])
        for f in features
    ]


@pytest.mark.slow
@pytest.mark.parametrize("options", [OPTIONS[0], OPTIONS[2]])
@pytest.mark.parametrize("mbs", [2, 7])
def test_mnrl_options_cached_equals_plain_under_dropout(tiny_dropout_model_dir, options, mbs):
    model = SentenceTransformer(str(tiny_dropout_model_dir), device="cpu")
    model.train()
    features = features_for(model, TRIPLETS)
    cfg = loss_config(**options)
    plain = MultipleNegativesRankingLoss(
        model,
        scale=cfg.scale,
        directions=cfg.resolved_directions(),
        hardness_mode=cfg.hardness_mode,
        hardness_strength=cfg.hardness_strength,
    )
    model.zero_grad()
    ref_loss = plain.compute_loss_from_embeddings(_same_masks_reps(model, features, mbs, 7), None)
    ref_loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    # padded mini-batches: the reference draws its dropout masks on the padded layout
    cached = build_loss(model, cfg, mbs, sort_by_length=False, unpad=False).module
    torch.manual_seed(7)
    loss, grads = loss_and_grads(model, cached, features)
    assert rel_diff(loss, ref_loss.detach()) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5
    torch.manual_seed(8)
    assert rel_diff(loss_and_grads(model, cached, features)[1], ref_grads) > 1e-3  # dropout is on


@pytest.mark.parametrize(
    ("loss_yaml", "message"),
    [
        (
            "  symmetric: true\n  directions: [query_to_doc, query_to_query]\n",
            r"config.yaml:3: loss: symmetric: true conflicts with directions \['query_to_doc', 'query_to_query'\]",
        ),
        (
            "  partition_mode: per_direction\n  directions: [query_to_doc, doc_to_doc]\n",
            r"config.yaml:3: loss: partition_mode: per_direction .* directions \['query_to_doc', 'doc_to_doc'\]",
        ),
        (
            "  hardness_mode: hard_negatives\n",
            r"loss: hardness_mode: hard_negatives has no effect with hardness_strength 0",
        ),
        ("  hardness_strength: 5\n", r"loss: hardness_strength 5 is ignored without hardness_mode"),
        ("  directions: [doc_to_query]\n", r"loss: directions \['doc_to_query'\] must include query_to_doc"),
        ("  directions: [query_to_doc, sideways]\n", r"loss.directions.1: Input should be 'query_to_doc'"),
        (
            "  false_negative_filter: {margin: 0.1}\n  symmetric: true\n",
            r"loss: false_negative_filter works with directions \[query_to_doc\] only",
        ),
        ("  name: mnrl\n  false_negative_filter: {margin: 0.1}\n", r"unknown key 'loss.false_negative_filter'"),
        ("  matryoshka: {dims: [64, 32], weights: [1]}\n", r"loss.matryoshka: weights has 1 values for 2 dims"),
        ("  name: cached_gist\n", r"missing required field 'loss.guide'"),
        ("  name: cached_gist\n  guide: x\n  symmetric: true\n", r"symmetric is not an option of cached_gist"),
        (
            "  name: cached_gist\n  guide: x\n  scale: 10\n  temperature: 0.05\n",
            r"temperature \(0.05\) and scale \(10\) are both set and disagree",
        ),
    ],
)
def test_conflicting_loss_settings_are_refused(write_config, loss_yaml, message):
    with pytest.raises(UserError, match=message):
        load_config(write_config("data:\n  train: pairs.jsonl\nloss:\n" + loss_yaml))


def test_resolved_settings_survive_a_dump_and_reload():
    for fields in (
        {"directions": ["query_to_doc", "doc_to_query", "query_to_query"]},
        {"name": "cached_gist", "guide": "g", "scale": 50},
        {"name": "cached_gist", "guide": "g"},
    ):
        cfg = loss_config(**fields)
        again = loss_config(**cfg.model_dump())
        assert again == cfg
    assert loss_config(directions=["query_to_doc", "doc_to_query"]).symmetric is True
    gist = loss_config(name="cached_gist", guide="g")
    assert gist.temperature == 0.01 and gist.scale == 100  # GISTEmbed's temperature by default
    assert loss_config(name="cached_gist", guide="g", scale=50).temperature == pytest.approx(0.02)


# ----------------------------------------------------------------------------------------------
# 1. cached_gist with a guide model


@pytest.fixture(scope="module")
def guide_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("guide"), seed=5, hidden=16)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["absolute", "relative"])
@pytest.mark.parametrize("columns", [("anchor", "positive"), TRIPLETS])
def test_cached_gist_equals_plain_gist(tiny_model_dir, guide_dir, strategy, columns):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = features_for(model, columns)
    cfg = loss_config(
        name="cached_gist", guide=str(guide_dir), margin_strategy=strategy, margin=0.002, temperature=0.05
    )
    built = build_loss(model, cfg, 3)
    guide = built.module.guide
    assert not guide.training and not any(p.requires_grad for p in guide.parameters())
    plain = GISTEmbedLoss(model, guide, temperature=0.05, margin_strategy=strategy, margin=0.002)
    ref_loss, ref_grads = loss_and_grads(model, plain, features)
    for mbs in MBS:
        for sort in (True, False):
            cached = build_loss(model, cfg, mbs, sort_by_length=sort)
            assert isinstance(cached.module, LengthSortedCachedGIST) and cached.cached
            loss, grads = loss_and_grads(model, cached.module, features)
            assert rel_diff(loss, ref_loss) <= 1e-5, (mbs, sort)
            assert rel_diff(grads, ref_grads) <= 1e-5, (mbs, sort)
            counts = cached.filter_counts
            assert counts is cached.module.filter_counts and 0 < counts.masked < counts.candidates


@pytest.mark.slow
def test_cached_gist_with_a_packaged_guide_and_another_tokenizer(tiny_model_dir):
    """The packaged all-MiniLM-L6-v2 as guide: another tokenizer, so the library re-tokenizes the
    decoded texts for it; cached == plain still holds."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = features_for(model, ("anchor", "positive"))
    cfg = loss_config(name="cached_gist", guide="all-MiniLM-L6-v2", margin=0.05, guide_max_seq_length=32)
    built = build_loss(model, cfg, 3)
    assert built.module.must_retokenize and built.module.guide.max_seq_length == 32
    plain = GISTEmbedLoss(model, built.module.guide, temperature=0.01, margin=0.05)
    ref_loss, ref_grads = loss_and_grads(model, plain, features)
    loss, grads = loss_and_grads(model, built.module, features)
    assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5


def test_unloadable_guide_names_the_field(tiny_model_dir, tmp_path):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    with pytest.raises(UserError, match=r"loss.guide: cannot load"):
        build_loss(model, loss_config(name="cached_gist", guide=str(tmp_path / "nope")), 4)


@pytest.mark.parametrize("mbs", [2, 7])
def test_cached_gist_under_dropout(tiny_dropout_model_dir, guide_dir, mbs):
    """Dropout in the trained model: the cached loss equals GIST's loss on embeddings drawn with the
    same masks (the guide runs in eval mode, so its embeddings are fixed)."""
    model = SentenceTransformer(str(tiny_dropout_model_dir), device="cpu")
    model.train()
    features = features_for(model, TRIPLETS)
    cached = build_loss(
        model,
        loss_config(name="cached_gist", guide=str(guide_dir), margin=0.002),
        mbs,
        sort_by_length=False,
        unpad=False,
    ).module  # padded mini-batches: the reference draws its dropout masks on the padded layout
    with torch.no_grad():
        guided = [cached.guide(dict(f))["sentence_embedding"] for f in features]
    model.zero_grad()
    reps = _same_masks_reps(model, features, mbs, 11)
    ref_loss = cached.calculate_loss([[r] for r in reps], [[g] for g in guided])
    ref_loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.manual_seed(11)
    loss, grads = loss_and_grads(model, cached, features)
    assert rel_diff(loss, ref_loss.detach()) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5


# ----------------------------------------------------------------------------------------------
# 2. Self-guided false-negative filtering


def _filtered_infonce(reps, scale, margin, strategy, judge=None):
    """The reference, written out: InfoNCE over [positives, negatives...] where every candidate c of
    anchor a with cos(a, c) > cos(a, p) - margin (absolute) or - |cos(a, p)| * margin (relative),
    judged on the detached embeddings (or on ``judge``'s), is left out (its logit -inf).
    Returns (loss, mask)."""
    anchors, cands = reps[0], torch.cat(reps[1:])
    sim = F.normalize(anchors, dim=-1) @ F.normalize(cands, dim=-1).T
    with torch.no_grad():
        if judge is not None:
            sim_judge = F.normalize(judge[0], dim=-1) @ F.normalize(torch.cat(judge[1:]), dim=-1).T
        else:
            sim_judge = sim
        pos = sim_judge.diagonal().view(-1, 1)
        mask = sim_judge > pos - (margin if strategy == "absolute" else pos.abs() * margin)
        mask.fill_diagonal_(False)
    logits = (sim * scale).masked_fill(mask, -torch.inf)
    return F.cross_entropy(logits, torch.arange(len(anchors))), mask


def _planted_texts():
    """Every row's anchor equals its positive (score 1), and rows 2 and 5 are the same pair: for
    anchor 2 the candidate positive 5 scores exactly as high as its own positive, and vice versa."""
    texts = list(TEXTS["positive"])
    texts[5] = texts[2]
    return {"anchor": texts, "positive": texts, "negative_1": TEXTS["negative_1"]}


@pytest.mark.parametrize("columns", [("anchor", "positive"), TRIPLETS])
def test_planted_duplicate_is_masked_and_loss_is_plain_without_it(tiny_model_dir, columns):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    texts = _planted_texts()
    features = [model.tokenize(texts[c]) for c in columns]
    model.zero_grad()
    ref_loss, mask = _filtered_infonce([model(dict(f))["sentence_embedding"] for f in features], 20.0, 1e-4, "absolute")
    ref_loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert mask.nonzero().tolist() == [[2, 5], [5, 2]]  # only the planted duplicate
    cfg = loss_config(false_negative_filter={"margin": 1e-4})
    unfiltered, _ = loss_and_grads(model, build_loss(model, loss_config(), 7).module, features)
    assert rel_diff(unfiltered, ref_loss.detach()) > 1e-3  # removing the candidate changes the loss
    n, width = len(texts["anchor"]), len(texts["anchor"]) * (len(columns) - 1)
    for mbs in MBS:
        built = build_loss(model, cfg, mbs)
        assert isinstance(built.module, SelfGuidedCachedMNRL)
        loss, grads = loss_and_grads(model, built.module, features)
        assert rel_diff(loss, ref_loss.detach()) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5, mbs
        assert (built.filter_counts.masked, built.filter_counts.candidates) == (2, n * (width - 1))


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "margin"), [("absolute", 0.0), ("absolute", 0.003), ("relative", 0.004)])
def test_self_guided_equals_plain_reference(tiny_model_dir, strategy, margin):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = features_for(model, TRIPLETS)
    model.zero_grad()
    ref_loss, mask = _filtered_infonce([model(dict(f))["sentence_embedding"] for f in features], 20.0, margin, strategy)
    ref_loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    # the library's own plain GISTEmbedLoss with the model as guide agrees
    gist = GISTEmbedLoss(
        model,
        model,
        temperature=0.05,
        margin_strategy=strategy,
        margin=margin,
        contrast_anchors=False,
        contrast_positives=False,
    )
    assert rel_diff(loss_and_grads(model, gist, features)[0], ref_loss.detach()) <= 1e-5
    cfg = loss_config(false_negative_filter={"margin": margin, "strategy": strategy})
    for mbs in MBS:
        built = build_loss(model, cfg, mbs)
        loss, grads = loss_and_grads(model, built.module, features)
        assert rel_diff(loss, ref_loss.detach()) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5, mbs
        assert built.filter_counts.masked == int(mask.sum())


@pytest.mark.parametrize("mbs", [2, 7])
def test_self_guided_under_dropout_uses_the_no_grad_pass(tiny_dropout_model_dir, mbs):
    """With dropout, the mask comes from the no-grad pass's embeddings, which the replay reproduces:
    the reference is the filtered InfoNCE on embeddings drawn with the same masks."""
    model = SentenceTransformer(str(tiny_dropout_model_dir), device="cpu")
    model.train()
    features = features_for(model, TRIPLETS)
    model.zero_grad()
    ref_loss, _ = _filtered_infonce(_same_masks_reps(model, features, mbs, 3), 20.0, 0.003, "absolute")
    ref_loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    # padded, as the reference draws its masks (packed mini-batches draw others: tests/model/test_unpad.py)
    cfg = loss_config(false_negative_filter={"margin": 0.003})
    cached = build_loss(model, cfg, mbs, sort_by_length=False, unpad=False)
    torch.manual_seed(3)
    loss, grads = loss_and_grads(model, cached.module, features)
    assert rel_diff(loss, ref_loss.detach()) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5


@pytest.mark.slow
def test_masked_share_reaches_the_log_and_run_summary(tiny_model_dir, pairs_file, tmp_path):
    data = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {"train": str(pairs_file(distinct_pairs(32))), "pretokenize": False},
        "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
        "loss": {"false_negative_filter": {"margin": 0.01}},
        "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(tmp_path / "run")},
    }
    cfg = config_from_dict(data, base=tmp_path)
    plan, prepared = check_run_inputs(cfg)
    summary = run_training(cfg, plan, prepared)
    saved = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    totals = saved["throughput"]
    assert totals["candidates"] == 2 * 16 * 15 and 0 <= totals["masked"] <= totals["candidates"]
    assert totals["masked_share"] == round(totals["masked"] / totals["candidates"], 6)
    per_step = [row["masked_share"] for row in saved["throughput_per_interval"]]
    assert len(per_step) == 2 and summary["status"] == "completed"
    lines = [line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if "step 2/2" in line]
    assert lines and f"masked {100 * per_step[1]:.2f}%" in lines[0]


# ----------------------------------------------------------------------------------------------
# 3. Matryoshka


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"false_negative_filter": {"margin": 0.003}}])
def test_matryoshka_cached_equals_plain(tiny_model_dir, options):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = features_for(model, TRIPLETS)
    mat = {"dims": [32, 16, 8], "weights": [1, 0.5, 2]}
    if options:  # the written-out reference, per dimension; candidates judged on the full embeddings
        model.zero_grad()
        embs = [model(dict(f))["sentence_embedding"] for f in features]
        full = [e.detach() for e in embs]
        ref_loss = sum(
            w * _filtered_infonce([F.normalize(e[:, :d], dim=-1) for e in embs], 20.0, 0.003, "absolute", full)[0]
            for d, w in zip(mat["dims"], mat["weights"])
        )
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        ref_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    else:
        plain = build_loss(model, loss_config(name="mnrl", matryoshka=mat), 1)
        assert isinstance(plain.module, CountingMatryoshkaLoss)
        ref_loss, ref_grads = loss_and_grads(model, plain.module, features)
        single, _ = loss_and_grads(model, build_loss(model, loss_config(name="mnrl"), 1).module, features)
        assert plain.token_counts.real == sum(int(f["attention_mask"].sum()) for f in features)  # once
        assert rel_diff(ref_loss, single) > 1e-2
    for mbs in MBS:
        built = build_loss(model, loss_config(matryoshka=mat, **options), mbs)
        assert built.cached
        loss, grads = loss_and_grads(model, built.module, features)
        assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5, mbs


def test_matryoshka_dims_beyond_the_model_are_refused(tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    with pytest.raises(UserError, match=r"loss.matryoshka.dims: \[64, 16\]: the model's embeddings have 32"):
        build_loss(model, loss_config(matryoshka={"dims": [64, 16]}), 4)


# ----------------------------------------------------------------------------------------------
# 6. The probe's worst-case step runs the loss the config builds


@pytest.mark.parametrize(
    ("fields", "candidates"),
    [
        # GIST with its guide: per anchor 8 positives + 8 anchors + 8 positives, less itself and 2 self-pairs
        ({"name": "cached_gist", "margin": 0.1}, 8 * (24 - 3)),
        # self-guided filter under Matryoshka: the loss stage runs once per dimension (2)
        ({"false_negative_filter": {"margin": 0.1}, "matryoshka": {"dims": [32, 16]}}, 2 * 8 * 7),
    ],
)
def test_probe_step_runs_the_configured_loss(tiny_model_dir, guide_dir, monkeypatch, fields, candidates):
    import cembed.losses.registry as losses
    from cembed.config.schema import ModelConfig
    from cembed.model.load import load_model
    from cembed.probe.worst_case import worst_case_step

    model = load_model(ModelConfig(name_or_path=str(tiny_model_dir), max_seq_length=16, device="cpu"), "cpu")
    built, real_build = [], losses.build_loss
    monkeypatch.setattr(losses, "build_loss", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    if fields.get("name") == "cached_gist":
        fields = {**fields, "guide": str(guide_dir)}
    assert worst_case_step(model, loss_config(**fields), 2, 8, 4, "fp32", repeats=1).samples_per_s > 0
    (loss,) = built
    assert loss.filter_counts.candidates == candidates
    if "guide" in fields:
        assert loss.module.guide is not model and loss.module.guide.get_embedding_dimension() == 16


# ----------------------------------------------------------------------------------------------
# 5. Gradient checkpointing


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{}, {"false_negative_filter": {"margin": 0.003}}])
def test_gradient_checkpointing_is_exact_with_the_cached_loss_under_dropout(tiny_dropout_model_dir, fields):
    """Checkpointing recomputes each layer in the backward pass (inside the cached loss's replay of a
    mini-batch); torch replays the layer's RNG state, so dropout draws the same masks: loss and
    gradients equal the run without checkpointing, from the same seed."""
    from cembed.config.schema import ModelConfig
    from cembed.model.load import load_model

    results = []
    for on in (False, True):
        model = load_model(ModelConfig(name_or_path=str(tiny_dropout_model_dir), gradient_checkpointing=on), "cpu")
        model.train()
        assert model[0].auto_model.is_activation_checkpointing == on
        features = features_for(model, TRIPLETS)
        loss = build_loss(model, loss_config(**fields), 3).module
        torch.manual_seed(21)
        results.append(loss_and_grads(model, loss, features))
    (loss_off, grads_off), (loss_on, grads_on) = results
    assert rel_diff(loss_on, loss_off) <= 1e-5 and rel_diff(grads_on, grads_off) <= 1e-5
    torch.manual_seed(22)
    assert rel_diff(loss_and_grads(model, loss, features)[1], grads_on) > 1e-3  # dropout is on


# ----------------------------------------------------------------------------------------------
# 3. cembed eval --dims


@pytest.mark.slow
def test_eval_dims_scores_truncated_embeddings(tiny_model_dir, tmp_path):
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    from cembed.eval.score import parse_dims, score_dims
    from cembed.eval.sets import load_sts

    sts_path = "tests/fixtures/stsbenchmark/sts-test.csv.gz"
    sts = load_sts(sts_path)
    out = tmp_path / "dims.json"
    report = score_dims(str(tiny_model_dir), [], [sts_path], [32, 8], device="cpu", no_cache=True, json_out=out)
    assert report.full_dim == 32 and list(report.scores) == [32, 8]
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    for dim in (32, 8):
        evaluator = EmbeddingSimilarityEvaluator(
            sts.sentences1,
            sts.sentences2,
            sts.scores,
            main_similarity="cosine",
            similarity_fn_names=["cosine"],
            name=sts.name,
            truncate_dim=dim,
        )
        expected = evaluator(model)[f"{sts.name}_spearman_cosine"]
        assert report.scores[dim][sts.name]["Spearman (cosine)"] == pytest.approx(expected, abs=1e-9)
    assert report.scores[32][sts.name] != report.scores[8][sts.name]
    assert json.loads(out.read_text())["scores"]["8"] == report.scores[8]
    assert model.truncate_dim is None
    with pytest.raises(UserError, match=r"--dims '64,x': give embedding sizes as positive integers"):
        parse_dims("64,x")
    with pytest.raises(UserError, match=r"--dims 64,8: the model's embeddings have 32 dimensions"):
        score_dims(str(tiny_model_dir), [], [sts_path], [64, 8], device="cpu", no_cache=True)
