"""Prompts (issue 15 item 2): resolution from data.prompts and the model's own prompts, the
pre-tokenized path against sentence-transformers' collator (ids, prompt_length, embeddings; with
and without Pooling(include_prompt=False)), the cached loss's length sorting carrying prompt_length,
the sampler comparing texts without their prompts, and a prompted model training and evaluating."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import COCO_HELDOUT, COCO_PAIRS, make_tiny_model
from sentence_transformers import SentenceTransformer

from cembed.config.prompts import PromptsConfig
from cembed.errors import ModelRefused
from cembed.model.prompts import prompt_lengths, resolve_prompts

PROMPTS = {"query": "query: ", "document": "passage: "}


@pytest.fixture(scope="module")
def prompted_model_dir(tmp_path_factory):
    """The tiny BERT saved with prompts {query: "query: ", document: "passage: "}."""
    path = make_tiny_model(tmp_path_factory.mktemp("prompted"))
    model = SentenceTransformer(str(path), device="cpu", prompts=dict(PROMPTS))
    model.save(str(path))
    return path


def _model(path, include_prompt: bool = True) -> SentenceTransformer:
    model = SentenceTransformer(str(path), device="cpu")
    for module in model:
        if hasattr(module, "include_prompt"):
            module.include_prompt = include_prompt
    return model.eval()


# --- resolution -------------------------------------------------------------------------------


def test_unset_roles_take_the_models_query_and_document_prompts(prompted_model_dir):
    p = resolve_prompts(None, _model(prompted_model_dir))
    assert (p.anchor, p.positive, p.negatives) == ("query: ", "passage: ", "passage: ")
    assert p.origin == {
        "anchor": "model prompt 'query'",
        "positive": "model prompt 'document'",
        "negatives": "model prompt 'document'",
    }


def test_configured_names_and_literals(prompted_model_dir):
    model = _model(prompted_model_dir)
    cfg = PromptsConfig.model_validate(
        {"anchor": {"name": "document"}, "positive": "doc> ", "negatives": {"text": "query"}}
    )
    p = resolve_prompts(cfg, model)
    assert (p.anchor, p.positive, p.negatives) == ("passage: ", "doc> ", "query")
    assert p.for_columns(["anchor", "positive", "negative_1", "negative_2"]) == {
        "anchor": "passage: ",
        "positive": "doc> ",
        "negative_1": "query",
        "negative_2": "query",
    }


def test_unknown_prompt_name_names_the_field_and_the_models_prompts(prompted_model_dir):
    cfg = PromptsConfig.model_validate({"positive": {"name": "passage"}})
    with pytest.raises(
        ModelRefused,
        match=r"data.prompts.positive: the model has no prompt named 'passage'; its prompts: query \('query: '\), document",
    ):
        resolve_prompts(cfg, _model(prompted_model_dir))


def test_a_plain_string_equal_to_a_prompt_name_is_refused_as_ambiguous(prompted_model_dir):
    cfg = PromptsConfig.model_validate({"anchor": "query"})
    with pytest.raises(
        ModelRefused,
        match=r"data.prompts.anchor: 'query' is the name of the model's prompt 'query: '; write \{name: query\}",
    ):
        resolve_prompts(cfg, _model(prompted_model_dir))


def test_default_prompt_name_applies_to_roles_without_a_named_prompt(tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu", prompts={"sts": "sts: "}, default_prompt_name="sts")
    p = resolve_prompts(None, model)
    assert (p.anchor, p.positive) == ("sts: ", "sts: ") and p.origin["anchor"] == "model default prompt 'sts'"
    plain = resolve_prompts(None, SentenceTransformer(str(tiny_model_dir), device="cpu"))
    assert (plain.anchor, plain.positive, plain.negatives) == ("", "", "")


def test_prompts_config_errors_name_the_field(write_config):
    from cembed.config.file import load_config
    from cembed.errors import UserError

    cfg = write_config({"model": {"name_or_path": "x"}, "data": {"train": "t.jsonl", "prompts": {"anchr": "q: "}}})
    with pytest.raises(UserError, match=r"data.prompts.anchr"):
        load_config(cfg)


# --- equivalence with sentence-transformers' collator ---------------------------------------------


ROWS = [
    {"anchor": "a man sitting on a bus", "positive": "two people near the train", "negative_1": "a red car"},
    {"anchor": "the dog", "positive": "a black cat is sitting on top of the large white table", "negative_1": "food"},
    {"anchor": "people at a table with food and a plate", "positive": "a bus", "negative_1": "a small blue room"},
    {"anchor": "a woman standing next to a street", "positive": "the cat in a car", "negative_1": "dog on the street"},
]


def _features(batch: dict, roles: list[str]) -> list[dict]:
    # As the trainer's collect_features: one dict per column, keys without the column prefix.
    return [{k[len(r) + 1 :]: v for k, v in batch.items() if k.startswith(r + "_")} for r in roles]


@pytest.mark.parametrize("include_prompt", [True, False])
def test_pretokenized_path_equals_sentence_transformers_collator(prompted_model_dir, tmp_path, include_prompt):
    import datasets
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

    from cembed.data.tokens.collator import collator_for
    from cembed.data.tokens.model_check import matches_model_preprocessing
    from cembed.data.tokens.tokenize import pretokenize

    model = _model(prompted_model_dir, include_prompt)
    roles = ["anchor", "positive", "negative_1"]
    prompts = resolve_prompts(None, model).for_columns(roles)
    lengths = prompt_lengths(model, prompts)
    # [CLS] q ##u ##e ##r ##y : / [CLS] p ##a ##s ##s ##a ##g ##e : (the tiny vocabulary is characters)
    assert lengths == {"anchor": 7, "positive": 9, "negative_1": 9}
    ds = datasets.Dataset.from_list(ROWS)
    tok = pretokenize(
        ds, roles, model.tokenizer, model.max_seq_length, tmp_path / "c", prompts=prompts, prompt_lengths=lengths
    )
    collator = collator_for(model, roles)
    ours = collator(list(tok.dataset))
    ref = SentenceTransformerDataCollator(preprocess_fn=model.preprocess, prompts=prompts)(ROWS)
    assert set(ours) == set(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key
    assert ours["anchor_prompt_length"] == 7 and isinstance(ours["anchor_prompt_length"], int)
    assert model.tokenizer.convert_ids_to_tokens(ours["anchor_input_ids"][0, :4].tolist()) == [
        "[CLS]",
        "q",
        "##u",
        "##e",
    ]
    assert matches_model_preprocessing(model, collator, tok.dataset, prompts=prompts)
    assert not matches_model_preprocessing(model, collator, tok.dataset, prompts=None)
    with torch.no_grad():
        for f_ours, f_ref, role in zip(_features(ours, roles), _features(ref, roles), roles):
            e_ours = model(f_ours)["sentence_embedding"]
            e_ref = model(f_ref)["sentence_embedding"]
            assert torch.allclose(e_ours, e_ref, atol=1e-6, rtol=0), role
            # and what encode() gives with the prompt: the model as it is used
            e_enc = model.encode([r[role] for r in ROWS], prompt=prompts[role], convert_to_tensor=True)
            assert torch.allclose(e_ours, e_enc, atol=1e-5, rtol=0), role
            if not include_prompt:  # the prompt's tokens are left out of the mean
                mask = f_ours["attention_mask"].clone()
                mask[:, : lengths[role]] = 0
                tokens = model[0](dict(f_ours))["token_embeddings"]
                manual = (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
                assert torch.allclose(e_ours, manual, atol=1e-6, rtol=0), role


def test_cache_key_includes_the_prompts(tiny_model_dir, tmp_path):
    import datasets

    from cembed.data.tokens.tokenize import pretokenize

    model = _model(tiny_model_dir)
    ds = datasets.Dataset.from_list(ROWS)
    a = pretokenize(
        ds, ["anchor"], model.tokenizer, 32, tmp_path, prompts={"anchor": "query: "}, prompt_lengths={"anchor": 3}
    )
    b = pretokenize(
        ds, ["anchor"], model.tokenizer, 32, tmp_path, prompts={"anchor": "passage: "}, prompt_lengths={"anchor": 3}
    )
    c = pretokenize(ds, ["anchor"], model.tokenizer, 32, tmp_path)
    again = pretokenize(
        ds, ["anchor"], model.tokenizer, 32, tmp_path, prompts={"anchor": "query: "}, prompt_lengths={"anchor": 3}
    )
    assert len({a.cache_path, b.cache_path, c.cache_path}) == 3
    assert again.from_cache and again.cache_path == a.cache_path
    assert "anchor_prompt_length" in a.dataset.column_names and "anchor_prompt_length" not in c.dataset.column_names


def test_ids_made_with_the_prompt_but_without_its_length_do_not_match(prompted_model_dir, tmp_path):
    """Stored ids with the prompt but no prompt length (an engine that did not record it): the ids
    equal the model's, yet with include_prompt=False the pooling needs the length, so the check fails."""
    import datasets

    from cembed.data.tokens.collator import collator_for
    from cembed.data.tokens.model_check import matches_model_preprocessing
    from cembed.data.tokens.tokenize import pretokenize

    model = _model(prompted_model_dir, include_prompt=False)
    roles = ["anchor", "positive", "negative_1"]
    prompts = resolve_prompts(None, model).for_columns(roles)
    ds = datasets.Dataset.from_list(ROWS)
    tok = pretokenize(ds, roles, model.tokenizer, model.max_seq_length, tmp_path / "c", prompts=prompts)
    assert "anchor_prompt_length" not in tok.dataset.column_names
    assert not matches_model_preprocessing(model, collator_for(model, roles), tok.dataset, prompts=prompts)


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [None, 40])
def test_length_sorted_cached_loss_carries_prompt_length(prompted_model_dir, tmp_path, num_tokens):
    """With include_prompt=False, cembed's length-sorted cached loss on the pre-tokenized batch
    equals sentence-transformers' plain MNRL on its own collator's batch: loss and gradients."""
    import datasets
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from cembed.data.tokens.collator import collator_for
    from cembed.data.tokens.tokenize import pretokenize
    from cembed.losses.mnrl import LengthSortedCachedMNRL

    roles = ["anchor", "positive", "negative_1"]
    results = []
    for ours in (True, False, "without prompt_length"):
        model = _model(prompted_model_dir, include_prompt=False)
        prompts = resolve_prompts(None, model).for_columns(roles)
        if ours is not False:
            tok = pretokenize(
                datasets.Dataset.from_list(ROWS),
                roles,
                model.tokenizer,
                64,
                tmp_path,
                prompts=prompts,
                prompt_lengths=prompt_lengths(model, prompts),
            )
            batch = collator_for(model, roles)(list(tok.dataset))
            if ours == "without prompt_length":
                batch = {k: v for k, v in batch.items() if not k.endswith("_prompt_length")}
            loss_fn = LengthSortedCachedMNRL(model, mini_batch_size=1, mini_batch_num_tokens=num_tokens)
        else:
            batch = SentenceTransformerDataCollator(preprocess_fn=model.preprocess, prompts=prompts)(ROWS)
            loss_fn = MultipleNegativesRankingLoss(model)
        loss = loss_fn(_features(batch, roles), None)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((loss.detach(), grads))
    (l1, g1), (l2, g2), (l3, _) = results
    assert torch.allclose(l1, l2, atol=1e-6), (l1, l2)
    # 1-row mini-batches trimmed to their own length: float rounding of a different summation order
    assert torch.allclose(g1, g2, atol=1e-5, rtol=0), (g1 - g2).abs().max()
    assert abs(l3 - l2) > 1e-4  # the prompt_length is what makes the difference


def test_sampler_compares_texts_without_their_prompts(tiny_model_dir, tmp_path):
    """A caption that is one row's anchor ("query: ...") and another row's positive ("passage: ...")
    is one text to the no-duplicates sampler, as without prompts."""
    import datasets

    from cembed.data.identity import row_hashes
    from cembed.data.tokens.tokenize import pretokenize

    model = _model(tiny_model_dir)
    rows = [{"anchor": "a red car", "positive": "a blue bus"}, {"anchor": "two dogs", "positive": "A red  car "}]
    roles = ["anchor", "positive"]
    prompts = {"anchor": "query: ", "positive": "passage: "}
    tok = pretokenize(
        datasets.Dataset.from_list(rows),
        roles,
        model.tokenizer,
        32,
        tmp_path,
        prompts=prompts,
        prompt_lengths=prompt_lengths(model, prompts),
    )
    h = row_hashes(tok.dataset, roles)
    assert h[0, 0] == h[1, 1]  # "query: a red car" vs "passage: A red  car " (uncased, same tokens after the prompt)
    assert len({h[0, 0], h[0, 1], h[1, 0]}) == 3


# --- a prompted model trains and evaluates with its prompts -----------------------------------------


def _small_heldout(folder, n: int = 150):
    """The first ``n`` queries of the packaged COCO held-out set with their documents (BEIR layout)."""
    import gzip

    (folder / "qrels").mkdir(parents=True)
    corpus = [json.loads(line) for line in gzip.open(COCO_HELDOUT / "corpus.jsonl.gz", "rt")][:n]
    queries = [json.loads(line) for line in open(COCO_HELDOUT / "queries.jsonl")][:n]
    qrels = open(COCO_HELDOUT / "qrels" / "test.tsv").read().splitlines()[: n + 1]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels" / "test.tsv").write_text("\n".join(qrels) + "\n")
    return folder


@pytest.mark.slow
def test_prompted_model_trains_and_evaluates_with_its_prompts(prompted_model_dir, tmp_path):
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    import cembed.train.recipe as T
    from cembed.config.file import config_from_dict
    from cembed.eval.score import score_model
    from cembed.eval.sets import load_beir

    heldout = _small_heldout(tmp_path / "heldout")
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(prompted_model_dir), "max_seq_length": 32, "device": "cpu"},
            "data": {"train": str(COCO_PAIRS), "max_samples": 256, "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 32, "mini_batch_size": 16},
            "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(tmp_path / "out")},
            "eval": {"retrieval": [{"path": str(heldout), "split": "test", "name": "coco"}]},
        },
        base=tmp_path,
    )
    plan, data = T.check_run_inputs(cfg)
    summary = T.run_training(cfg, plan, data)
    tok = summary["tokenization"]
    assert tok["pretokenized"] is True
    assert tok["prompts"]["anchor"] == {"prompt": "query: ", "from": "model prompt 'query'"}
    assert tok["prompts"]["positive"] == {"prompt": "passage: ", "from": "model prompt 'document'"}
    from cembed.data.tokens.format import read_folder

    _, stored = read_folder(tok["cache_path"])
    base = _model(prompted_model_dir)
    base.max_seq_length = 32
    first, text = stored[0], data.dataset[0]["anchor"]
    assert first["anchor_input_ids"] == base.preprocess([text], prompt="query: ")["input_ids"][0].tolist()
    assert first["positive_prompt_length"] == 9
    # "before" = the base model scored with query: / passage:, not without prompts
    rs = load_beir(heldout, "test")

    def ir(query_prompt, corpus_prompt):
        ev = InformationRetrievalEvaluator(
            rs.queries,
            rs.corpus,
            rs.relevant_docs,
            name="coco",
            ndcg_at_k=[10],
            query_prompt=query_prompt,
            corpus_prompt=corpus_prompt,
        )
        return ev(base)["coco_cosine_ndcg@10"]

    before = summary["eval"]["before"]["coco_cosine_ndcg@10"]
    assert before == pytest.approx(ir("query: ", "passage: "), abs=1e-6)
    assert abs(before - ir("", "")) > 1e-4
    # the trained model keeps its prompts; `cembed eval` uses them
    report = score_model(str(tmp_path / "out"), [heldout], [], cache_dir=tmp_path / "emb")
    assert report.prompts["query"]["prompt"] == "query: " and report.prompts["document"]["prompt"] == "passage: "
    assert report.sets[rs.name]["metrics"][f"{rs.name}_cosine_ndcg@10"] == pytest.approx(
        summary["eval"]["after"]["coco_cosine_ndcg@10"], abs=1e-6
    )
    again = score_model(str(tmp_path / "out"), [heldout], [], cache_dir=tmp_path / "emb")
    assert again.sets[rs.name]["corpus_cache_hit"]
    assert json.dumps(report.to_dict())  # the JSON report carries the prompts


def test_without_pretokenization_the_trainers_collator_gets_the_prompts(prompted_model_dir, tmp_path):

    import cembed.train.recipe as T
    from cembed.config.file import config_from_dict

    rows = [{"anchor": f"question {i}", "positive": f"answer {i}", "neg": f"other {i}"} for i in range(8)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(prompted_model_dir), "device": "cpu"},
            "data": {
                "train": str(tmp_path / "p.jsonl"),
                "pretokenize": False,
                "columns": {"negatives": ["neg"]},
                "prompts": {"negatives": "hard: "},
            },
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 4},
            "train": {"max_steps": 1, "output_dir": str(tmp_path / "out")},
        },
        base=tmp_path,
    )
    plan, data = T.check_run_inputs(cfg)
    parts = T.build_components(cfg, plan, data, "cpu")
    assert parts.collator is None and parts.token_info["prompts"]["negatives"]["from"] == "data.prompts.negatives"
    run = T.build_trainer(cfg, plan, parts, T.RunDir(tmp_path / "out", None), T.QuietRunDisplay())
    collator = run.trainer.data_collator
    assert collator.prompts == {"anchor": "query: ", "positive": "passage: ", "negative_1": "hard: "}
    batch = collator([dict(r) for r in data.dataset.select(range(2))])
    assert batch["negative_1_prompt_length"] == len(parts.model.tokenizer("hard: ")["input_ids"]) - 1


def test_corpus_cache_key_includes_the_prompt(tiny_model_dir, tmp_path):
    import numpy as np

    from cembed.eval.embedding_cache import corpus_embeddings

    model = _model(tiny_model_dir)
    corpus = {"d1": "a red car", "d2": "two dogs on a street"}
    plain = corpus_embeddings(model, corpus, cache_dir=tmp_path)
    prompted = corpus_embeddings(model, corpus, cache_dir=tmp_path, prompt="passage: ")
    assert not prompted.cache_hit and prompted.cache_file != plain.cache_file
    assert not np.allclose(plain.embeddings, prompted.embeddings)
    expected = model.encode(list(corpus.values()), prompt="passage: ")
    np.testing.assert_allclose(prompted.embeddings, expected, atol=1e-6)
    assert corpus_embeddings(model, corpus, cache_dir=tmp_path, prompt="passage: ").cache_hit


# --- the prompts a run trained with are saved with the model -----------------------------------------


@pytest.mark.slow
def test_literal_prompts_are_saved_with_the_trained_model(tiny_model_dir, tmp_path):
    """data.prompts given as literal text (the model has none): the saved model's query / document
    prompts are them, so encode_query / encode_document embed as training did, without naming them."""
    import cembed.train.recipe as T
    from cembed.config.file import config_from_dict

    rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(16)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {
                "train": str(tmp_path / "p.jsonl"),
                "prompts": {"anchor": "search query: ", "positive": "search document: "},
                "cache_dir": str(tmp_path / "cache"),
            },
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"max_steps": 2, "output_dir": str(tmp_path / "out"), "save_steps": 1},
        },
        base=tmp_path,
    )
    plan, data = T.check_run_inputs(cfg)
    T.run_training(cfg, plan, data)
    saved = json.loads((tmp_path / "out" / "config_sentence_transformers.json").read_text())
    assert saved["prompts"]["query"] == "search query: " and saved["prompts"]["document"] == "search document: "
    checkpoint = json.loads((tmp_path / "out" / "checkpoint-1" / "config_sentence_transformers.json").read_text())
    assert checkpoint["prompts"]["query"] == "search query: "
    model = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    texts = ["a red car", "two dogs on a street"]
    q = model.encode_query(texts, convert_to_tensor=True)
    d = model.encode_document(texts, convert_to_tensor=True)
    assert torch.equal(q, model.encode(texts, prompt="search query: ", convert_to_tensor=True))
    assert torch.equal(d, model.encode(texts, prompt="search document: ", convert_to_tensor=True))
    assert not torch.allclose(q, model.encode(texts, convert_to_tensor=True), atol=1e-4)  # the prompt matters


def test_trained_prompts_replace_the_models_and_keep_its_others(tiny_model_dir):
    """A role trained without a prompt saves "" (encode_document must not fall back to 'passage');
    the model's other prompts and default_prompt_name stay."""
    from cembed.model.prompts import set_trained_prompts

    model = SentenceTransformer(
        str(tiny_model_dir), device="cpu", prompts={"passage": "passage: ", "sts": "sts: "}, default_prompt_name="sts"
    )
    cfg = PromptsConfig.model_validate({"anchor": "q> ", "positive": ""})
    written = set_trained_prompts(model, resolve_prompts(cfg, model))
    assert written == {"query": "q> ", "document": ""}
    assert model.prompts == {"query": "q> ", "document": "", "passage": "passage: ", "sts": "sts: "}
    assert model.default_prompt_name == "sts"
    texts = ["a red car"]
    assert torch.equal(
        model.encode_document(texts, convert_to_tensor=True), model.encode(texts, prompt="", convert_to_tensor=True)
    )


# --- per-source prompts (data.train.<name>.prompts) ---------------------------------------------------


def _two_sources(tmp_path, extra: dict | None = None, **sections):
    """Pairs (task one) and triplets (task two), each with its own anchor prompt; data.prompts gives
    the positive's."""
    from cembed.config.file import config_from_dict

    pairs = [{"q": f"what is item {i}", "a": f"item {i} is a red car"} for i in range(16)]
    triplets = [{"anchor": f"find dog {i}", "positive": f"a dog {i}", "negative": f"a cat {i}"} for i in range(16)]
    triplets[1]["positive"] = "find dog 0"  # row 0's anchor text, under the positive's prompt
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (tmp_path / "trip.jsonl").write_text("".join(json.dumps(r) + "\n" for r in triplets))
    return config_from_dict(
        {
            "model": sections.pop("model", {"name_or_path": "unused", "device": "cpu"}),
            "data": {
                "train": {
                    "qa": {
                        "path": str(tmp_path / "pairs.jsonl"),
                        "columns": {"anchor": "q", "positive": "a"},
                        "prompts": {"anchor": "task one: "},
                    },
                    "nli": {
                        "path": str(tmp_path / "trip.jsonl"),
                        "columns": {"negatives": ["negative"]},
                        "prompts": {"anchor": "task number two: ", "negatives": ""},
                    },
                },
                "prompts": {"anchor": "run: ", "positive": "doc: "},
                **(extra or {}),
            },
            **sections,
        },
        base=tmp_path,
    )


def test_source_prompts_fall_back_role_by_role(tiny_model_dir, tmp_path):
    from cembed.data.load import load_training_data
    from cembed.data.prompts import resolve_source_prompts

    cfg = _two_sources(tmp_path)
    data = load_training_data(cfg.data)
    model = _model(tiny_model_dir)
    run = resolve_prompts(cfg.data.prompts, model)
    qa, nli = resolve_source_prompts(data, model, run)
    assert (qa.anchor, qa.positive, qa.negatives) == ("task one: ", "doc: ", "doc: ")
    assert (nli.anchor, nli.positive, nli.negatives) == ("task number two: ", "doc: ", "")
    assert qa.origin["anchor"] == "data.train.qa.prompts.anchor"
    for src in data.sources:  # no source with prompts of its own: every source trains with data.prompts
        src.prompts = None
    assert resolve_source_prompts(data, model, run) is None


def test_a_source_prompt_naming_no_model_prompt_names_the_source_field(tiny_model_dir, tmp_path):
    from cembed.data.load import load_training_data
    from cembed.data.prompts import resolve_source_prompts

    cfg = _two_sources(tmp_path)
    cfg.data.train[1].prompts.anchor = PromptsConfig.model_validate({"anchor": {"name": "nli"}}).anchor
    data = load_training_data(cfg.data)
    model = _model(tiny_model_dir)
    with pytest.raises(ModelRefused, match=r"data.train.nli.prompts.anchor: the model has no prompt named 'nli'"):
        resolve_source_prompts(data, model, resolve_prompts(cfg.data.prompts, model))


@pytest.mark.parametrize("include_prompt", [True, False])
def test_each_source_is_tokenized_with_its_own_prompts(tiny_model_dir, tmp_path, include_prompt):
    """The pre-tokenized batch of each source equals sentence-transformers' collator given that
    source's prompts (ids, prompt_length: per source, so Pooling(include_prompt=False) leaves the
    right number of tokens out), and sentence-transformers' per-dataset prompts (the text path) give
    the same; the sampler compares texts without their source's prompt."""
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

    from cembed.data.identity import row_hashes
    from cembed.data.load import load_training_data
    from cembed.data.prompts import resolve_source_prompts
    from cembed.data.tokens.collator import SourceNamedRows, TextCollator, TokenIdRows
    from cembed.data.tokens.tokenize import tokenize_stage

    cfg = _two_sources(tmp_path)
    data = load_training_data(cfg.data)
    model = _model(tiny_model_dir, include_prompt)
    run = resolve_prompts(cfg.data.prompts, model)
    per_source = resolve_source_prompts(data, model, run)
    by_source = [p.for_columns(c) for p, c in zip(per_source, data.source_columns())]
    dataset, collator, info = tokenize_stage(
        model, data, True, str(tmp_path / "cache"), run.for_columns(data.columns), None, by_source
    )
    assert info["pretokenized"] is True, info
    lengths = dataset["anchor_prompt_length"]
    assert set(lengths[:16]) == {prompt_lengths(model, {"a": "task one: "})["a"]}
    assert set(lengths[16:]) == {prompt_lengths(model, {"a": "task number two: "})["a"]}
    assert "negative_1_prompt_length" not in dataset.column_names  # nli: negatives: "" (no prompt); qa: none
    assert set(dataset["positive_prompt_length"]) == {prompt_lengths(model, {"p": "doc: "})["p"]}
    text_collator = TextCollator(preprocess_fn=model.preprocess, prompts={"qa": by_source[0], "nli": by_source[1]})
    named = SourceNamedRows(data.dataset, ["qa", "nli"], [16, 16])
    for src, rows in ((0, list(range(0, 4))), (1, list(range(16, 20)))):
        ours = collator(TokenIdRows(dataset, collator.roles).__getitems__(rows))
        texts = [{c: data.dataset[i][c] for c in data.source_columns()[src]} for i in rows]
        ref = SentenceTransformerDataCollator(preprocess_fn=model.preprocess, prompts=by_source[src])(texts)
        text_path = text_collator(named.__getitems__(rows))
        assert text_path.pop("dataset_name") == ("qa", "nli")[src]
        for batch in (ours, text_path):
            assert set(batch) == set(ref), (src, sorted(batch), sorted(ref))
            for key, value in ref.items():
                assert torch.equal(batch[key], value) if isinstance(value, torch.Tensor) else batch[key] == value, key
        with torch.no_grad():
            for role in data.source_columns()[src]:
                feats = {k[len(role) + 1 :]: v for k, v in ours.items() if k.startswith(role + "_")}
                emb = model(feats)["sentence_embedding"]
                prompt = by_source[src].get(role)
                enc = model.encode([t[role] for t in texts], prompt=prompt, convert_to_tensor=True)
                assert torch.allclose(emb, enc, atol=1e-5, rtol=0), (src, role)
    # "find dog 0" is nli row 0's anchor ("task number two: ...") and row 1's positive ("doc: ..."):
    # one text to the sampler, since each row's own source's prompt length is skipped.
    h = row_hashes(dataset, data.columns)
    assert h[16, 0] == h[17, 1] and len(set(h[:, 0].tolist())) == 32


def test_text_path_batches_take_their_sources_prompts(tiny_model_dir, tmp_path):
    """data.pretokenize: false: the trainer's collator gets sentence-transformers' per-dataset prompts
    and every batch the data loader yields names its source and carries that source's prompt."""
    import cembed.train.recipe as T

    cfg = _two_sources(
        tmp_path,
        {"pretokenize": False},
        model={"name_or_path": str(tiny_model_dir), "device": "cpu"},
        batch={"per_device_train_batch_size": 8, "mini_batch_size": 8},
        train={"output_dir": str(tmp_path / "out"), "max_steps": 1},
    )
    plan, data = T.check_run_inputs(cfg)
    parts = T.build_components(cfg, plan, data, "cpu")
    run = T.build_trainer(cfg, plan, parts, T.RunDir(tmp_path / "out", None), T.QuietRunDisplay())
    assert run.trainer.data_collator.prompts["nli"]["anchor"] == "task number two: "
    loader = run.trainer.get_train_dataloader()
    expected = {
        name: prompt_lengths(parts.model, {"a": p})["a"]
        for name, p in [("qa", "task one: "), ("nli", "task number two: ")]
    }
    seen = set()
    for batch in loader:
        name = batch["dataset_name"]
        seen.add(name)
        assert batch["anchor_prompt_length"] == expected[name]
        assert ("negative_1_input_ids" in batch) is (name == "nli")
    assert seen == {"qa", "nli"}


@pytest.mark.slow
def test_with_source_prompts_the_run_wide_prompts_are_saved(tiny_model_dir, tmp_path):
    import cembed.train.recipe as T

    cfg = _two_sources(
        tmp_path,
        {"cache_dir": str(tmp_path / "cache")},
        model={"name_or_path": str(tiny_model_dir), "device": "cpu"},
        batch={"per_device_train_batch_size": 8, "mini_batch_size": 4},
        train={"output_dir": str(tmp_path / "out"), "max_steps": 2},
    )
    plan, data = T.check_run_inputs(cfg)
    summary = T.run_training(cfg, plan, data)
    tok = summary["tokenization"]
    assert tok["pretokenized"] is True
    assert tok["source_prompts"]["nli"]["anchor"] == {
        "prompt": "task number two: ",
        "from": "data.train.nli.prompts.anchor",
    }
    saved = json.loads((tmp_path / "out" / "config_sentence_transformers.json").read_text())["prompts"]
    assert (saved["query"], saved["document"]) == ("run: ", "doc: ")  # data.prompts: the sources' own are not saved


def test_validate_reports_each_sources_prompts_and_measures_its_rows_with_them(tiny_model_dir, tmp_path):
    from cembed.data.load import load_training_data
    from cembed.data.truncation import model_truncation_report

    cfg = _two_sources(tmp_path, model={"name_or_path": str(tiny_model_dir), "device": "cpu"})
    data = load_training_data(cfg.data)
    report = model_truncation_report(cfg.model, data, prompts_cfg=cfg.data.prompts)
    assert report.source_prompts["nli"].anchor == "task number two: " and report.prompts.anchor == "run: "
    columns = {c.column: c for c in report.columns}
    assert (columns["anchor"].rows, columns["negative_1"].rows) == (32, 16)  # the pairs have no negative_1
    model = _model(tiny_model_dir)
    longest = max(
        len(model.tokenizer(p + t)["input_ids"])
        for p, texts in (
            ("task one: ", data.dataset["anchor"][:16]),
            ("task number two: ", data.dataset["anchor"][16:]),
        )
        for t in texts
    )
    assert columns["anchor"].max_tokens == longest
