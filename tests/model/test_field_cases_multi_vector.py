"""Field cases (issue 40 item 4's round) for the multi-vector (late-interaction, ColBERT) kind: each built
from a public bug report about late-interaction training or evaluation in sentence-transformers, PyLate or
Stanford ColBERT, tried as a new user would and compared with a reference computed without cembed (plain
sentence-transformers' ``MultiVectorEncoder``, its loss and evaluator, a by-hand MaxSim, the tokenizer's
own ids). docs/development.md lists the round."""

from __future__ import annotations

import json
import string

import pytest
import torch
from typer.testing import CliRunner

from cembed.cli.app import app

QUERIES = [
    "what is the tallest mountain in the whole wide world and how high is it exactly",
    "two dogs",
    "where do penguins live, and what do they eat?",
    "red car",
    "how many people live in the city of paris today",
    "train station",
]
DOCUMENTS = [
    "mount everest is the tallest mountain, at 8,849 metres above sea level.",
    "two dogs are playing in the park.",
    "penguins live in the southern hemisphere; they eat fish, squid and krill.",
    "a red car is parked near a white car on the street by the river.",
    "paris has about two million people living within the city limits.",
    "the train station is busy in the morning.",
]


def _rows() -> list[dict]:
    return [{"anchor": q, "positive": d} for q, d in zip(QUERIES, DOCUMENTS)]


def _config(write_config, pairs_file, tiny_model_dir, tmp_path, **model) -> str:
    return str(
        write_config(
            {
                "model": {"kind": "multi_vector", "name_or_path": str(tiny_model_dir), "device": "cpu", "dim": 16}
                | model,
                "data": {"train": str(pairs_file(_rows())), "cache_dir": str(tmp_path / "cache")},
                "batch": {"per_device_train_batch_size": 6, "mini_batch_size": 3},
                "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
            }
        )
    )


def _plain(tiny_model_dir, **settings):
    """Plain sentence-transformers: ``MultiVectorEncoder`` built from the same folder, ``settings`` set on
    its Transformer as a user of the library sets them."""
    from sentence_transformers import MultiVectorEncoder

    model = MultiVectorEncoder(str(tiny_model_dir), device="cpu")
    for name, value in settings.items():
        setattr(model[0], name, value)
    return model


def test_validate_counts_queries_cut_at_the_query_length(write_config, pairs_file, tiny_model_dir, tmp_path):
    """RAGatouille#99 "query length" (a query longer than ColBERT's query maximum is cut, silently),
    ColBERT.jl#16 (documents truncated to doc_maxlen): ``validate`` reports the rows each column loses at the
    length the model cuts it at (``query_length`` for queries, ``document_length`` for documents), not at
    ``max_seq_length``. Reference: the tokenizer's own lengths against each cut."""
    path = _config(write_config, pairs_file, tiny_model_dir, tmp_path, query_length=8, document_length=14)
    r = CliRunner().invoke(app, ["validate", path, "--json"])
    assert r.exit_code == 0, r.output
    columns = {c["column"]: c for c in json.loads(r.output)["truncation"]["columns"]}
    tokenizer = _plain(tiny_model_dir).tokenizer
    lengths = {
        role: [len(ids) for ids in tokenizer([row[role] for row in _rows()])["input_ids"]]
        for role in ("anchor", "positive")
    }
    for role, cut in (("anchor", 8), ("positive", 14)):
        assert columns[role]["limit"] == cut
        assert columns[role]["truncated"] == sum(n > cut for n in lengths[role]) > 0
        assert columns[role]["max_tokens"] == max(lengths[role])
    text = CliRunner().invoke(app, ["validate", path]).output
    assert f"anchor {sum(n > 8 for n in lengths['anchor'])} (" in text and "cut at 8 tokens" in text


def test_a_length_beyond_the_position_table_is_refused_by_validate(write_config, pairs_file, tmp_path):
    """qdrant/fastembed#413 (a late-interaction input longer than the model can take once the document
    marker is added failed inside the model): ``model.document_length`` (or ``query_length``,
    ``query_expansion``) above the model's position table is refused by ``validate`` and ``train`` in one
    line naming the field, where train failed at step 0 with ``IndexError: index out of range in self``.
    Reference: plain sentence-transformers with the same ``document_length`` fails in the model."""
    from conftest import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "p62", positions=62)
    long = ["answer text words " * 30]
    with pytest.raises((IndexError, RuntimeError)):  # positions beyond the table
        _plain(model_dir, document_length=100).encode_document(long)
    for field, value in (("document_length", 100), ("query_length", 70), ("query_expansion", 63)):
        path = _config(write_config, pairs_file, model_dir, tmp_path, **{field: value})
        for command in ("validate", "train"):
            r = CliRunner().invoke(app, [command, path])
            assert r.exit_code == 2, r.output
            assert r.output.strip().splitlines()[-1] == (
                f"error: model.{field}: {value} is longer than the model's position table (62 positions, bert); "
                f"set model.{field} to at most 62"
            )
    fits = _config(write_config, pairs_file, model_dir, tmp_path, document_length=62, query_length=16)
    assert CliRunner().invoke(app, ["validate", fits]).exit_code == 0


def _tevatron_rows(n: int) -> list[dict]:
    return [
        {"query": f"question {i}", "positive": f"answer {i}", "negatives": [f"wrong {i} a", f"wrong {i} b"]}
        for i in range(n)
    ]


def test_init_maps_a_column_of_negative_lists(pairs_file, tiny_model_dir, tmp_path):
    """lightonai/pylate#117 "Fine-tuning multiple hard negatives in a single training instance" (Tevatron's
    ``<query, positive, [negatives]>``): ``cembed init`` proposes the column of lists as the negatives
    (training expands it into one column per position), where it left it out and the starter trained
    without hard negatives, saying nothing. Reference: the file read with ``json``: two negatives a row."""
    data = pairs_file(_tevatron_rows(24), "tevatron.jsonl")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert {len(r["negatives"]) for r in rows} == {2}
    out = tmp_path / "starter.yaml"
    r = CliRunner().invoke(app, ["init", str(out), "--data", str(data), "--model", str(tiny_model_dir)])
    assert r.exit_code == 0, r.output
    assert '    negatives: ["negatives"]' in out.read_text()
    checked = CliRunner().invoke(app, ["validate", str(out), "--json"])
    report = json.loads(checked.output)
    assert [c["column"] for c in report["truncation"]["columns"]] == ["anchor", "positive", "negative_1", "negative_2"]
    assert any("holds lists of 2 negatives: expanded into 2 columns" in w for w in report["warnings"])


def test_init_writes_a_multi_vector_starter_for_a_colbert_folder(pairs_file, other_kind_dirs, tmp_path):
    """A PyLate / ColBERT user starting from a late-interaction checkpoint (lightonai/pylate#161 and #165:
    sentence-transformers models with their own Dense layers loaded as ColBERT models): ``cembed init
    --model <MultiVectorEncoder folder>`` writes ``model.kind: multi_vector`` and its loss
    (``cached_maxsim`` at scale 1), where it wrote a dense starter that ``validate`` refused. Reference:
    plain sentence-transformers loads the folder as a ``MultiVectorEncoder``."""
    from conftest import distinct_pairs
    from sentence_transformers import MultiVectorEncoder

    folder = other_kind_dirs["MultiVectorEncoder"]
    assert type(MultiVectorEncoder(str(folder), device="cpu")) is MultiVectorEncoder
    out = tmp_path / "colbert.yaml"
    data = pairs_file(distinct_pairs(24), "pairs.jsonl")
    r = CliRunner().invoke(app, ["init", str(out), "--data", str(data), "--model", str(folder)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "  kind: multi_vector" in text and "  name: cached_maxsim" in text and "  scale: 1.0" in text
    checked = CliRunner().invoke(app, ["validate", str(out), "--json"])
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.output)["model"]["kind"] == "multi_vector"


def test_the_meter_counts_every_dense_layer_of_a_token_head(tiny_model_dir, tmp_path):
    """lightonai/pylate#161, #165 (a sentence-transformers model with several Dense layers, e.g.
    EmbeddingGemma's two, loaded as a ColBERT model keeps them all): the model cembed builds from such a
    model keeps both layers at token level as plain sentence-transformers does (the same token vectors),
    and the meter's FLOPs per token count both (2 x in x out each), where they counted the last one only.
    Reference: plain ``MultiVectorEncoder`` on the same folder, and the layers' sizes by hand."""
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer
    from sentence_transformers.base.modules.dense import Dense

    from cembed.config.model import model_config
    from cembed.model.load import load_model
    from cembed.train.flops import build_flop_model, encoder_shape

    dense = SentenceTransformer(str(tiny_model_dir), device="cpu")
    dense.append(Dense(32, 48, activation_function=torch.nn.Tanh()))
    dense.append(Dense(48, 24, bias=False, activation_function=torch.nn.Identity()))
    dense.save(str(tmp_path / "two_dense"))
    plain = MultiVectorEncoder(str(tmp_path / "two_dense"), device="cpu")
    ours = load_model(model_config(kind="multi_vector", name_or_path=str(tmp_path / "two_dense")), "cpu")
    assert [type(m).__name__ for m in ours] == [type(m).__name__ for m in plain]
    for a, b in zip(plain.encode_document(DOCUMENTS), ours.encode_document(DOCUMENTS)):
        torch.testing.assert_close(torch.as_tensor(b), torch.as_tensor(a), rtol=0, atol=0)
    n = encoder_shape(ours)[0]
    assert build_flop_model(ours, True, "fp32", "cpu").non_embedding_params - n == 32 * 48 + 48 * 24


def test_expansion_tokens_are_scored_but_not_attended_to(tiny_model_dir):
    """stanford-futuredata/ColBERT#69 "[MASK] token has 0 attention?", lightonai/pylate#9 (the
    attend_to_expansion_tokens option): with ``model.query_expansion: 12`` a short query becomes 12
    token vectors, the [MASK] positions scored and not attended to (their input mask 0). Reference: plain
    sentence-transformers with the same expansion set on its Transformer: the same ids, masks and vectors."""
    from cembed.config.model import model_config
    from cembed.model.load import load_model

    ours = load_model(model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), query_expansion=12), "cpu")
    plain = _plain(tiny_model_dir, query_expansion={"strategy": "fixed", "attend": False, "length": 12})
    plain[1].load_state_dict(ours[1].state_dict())  # the same projection (a new one is random)
    features = ours.preprocess(["two dogs", "red car"], task="query")
    reference = plain.preprocess(["two dogs", "red car"], task="query")
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(features[key], reference[key]), key
    assert features["input_ids"].shape[1] == 12 and (features["attention_mask"] == 0).sum() > 0
    mask_id = ours.tokenizer.mask_token_id
    assert bool((features["input_ids"][features["attention_mask"] == 0] == mask_id).all())
    vectors = ours.encode_query(["two dogs", "red car"])
    assert [len(v) for v in vectors] == [12, 12]  # every position scored, the expansion too
    for a, b in zip(plain.encode_query(["two dogs", "red car"]), vectors):
        torch.testing.assert_close(torch.as_tensor(b), torch.as_tensor(a), rtol=1e-6, atol=1e-6)


def _maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    """MaxSim by hand: each query token's largest dot product with a document token, summed."""
    return float((q @ d.T).max(dim=1).values.sum())


def test_skiplist_leaves_document_punctuation_out_of_maxsim(tiny_model_dir):
    """lightonai/pylate#5 "Add the skiplist", #14 (punctuation is encoded but not scored, in documents
    only): with ``model.skiplist: punctuation`` a document's punctuation tokens are left out of its token
    vectors and of MaxSim, a query's are kept. Reference: plain sentence-transformers without a skiplist
    (the same weights), its document token vectors at the non-punctuation ids kept by hand, MaxSim by hand."""
    from cembed.config.model import model_config
    from cembed.model.load import load_model

    ours = load_model(
        model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), skiplist="punctuation"), "cpu"
    )
    plain = _plain(tiny_model_dir)
    plain[1].load_state_dict(ours[1].state_dict())
    tokenizer = plain.tokenizer
    punctuation = {tokenizer.convert_tokens_to_ids(c) for c in string.punctuation} - {tokenizer.unk_token_id}
    query = "where do penguins live, and what do they eat?"
    q_ours, q_plain = ours.encode_query([query])[0], plain.encode_query([query])[0]
    assert len(q_ours) == len(q_plain)  # a query keeps its punctuation
    for text in DOCUMENTS:
        ids = tokenizer(text)["input_ids"]
        keep = torch.tensor([i not in punctuation for i in ids])
        assert not bool(keep.all())  # every document here has punctuation
        reference = torch.as_tensor(plain.encode_document([text])[0])[keep]
        got = torch.as_tensor(ours.encode_document([text])[0])
        torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
        assert ours.similarity([q_ours], [got]).item() == pytest.approx(
            _maxsim(torch.as_tensor(q_plain), reference), rel=1e-6
        )


def test_a_documents_scores_do_not_depend_on_the_batch_it_is_encoded_in(tiny_model_dir, tmp_path):
    """stanford-futuredata/ColBERT#314 (a document's relevance scores differed when it was encoded in a batch
    with other documents): ``cembed eval``'s corpus encoding gives every document the token vectors it gets
    alone, whatever the batch size (documents of very different lengths, a skiplist). Reference: plain
    sentence-transformers encoding each document alone, MaxSim by hand."""
    from cembed.config.model import model_config
    from cembed.eval.embedding_cache import corpus_embeddings
    from cembed.model.load import load_model

    ours = load_model(
        model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), skiplist="punctuation"), "cpu"
    )
    plain = _plain(tiny_model_dir)
    plain[1].load_state_dict(ours[1].state_dict())
    plain[2].skiplist_words = list(ours[2].skiplist_words)
    plain[2].resolve_with_tokenizer(plain.tokenizer)
    corpus = {f"d{i}": text for i, text in enumerate(DOCUMENTS + ["a", "a " * 40 + "end."])}
    alone = [torch.as_tensor(plain.encode_document([t])[0]) for t in corpus.values()]
    queries = [torch.as_tensor(v) for v in plain.encode_query(QUERIES)]
    for batch_size in (1, 3, 32):
        ce = corpus_embeddings(ours, corpus, batch_size=batch_size)
        rows = ce.on_device("cpu")
        for got, ref in zip(rows, alone):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        by_hand = torch.tensor([[_maxsim(q, d) for d in alone] for q in queries])
        torch.testing.assert_close(ours.similarity(queries, rows), by_hand, rtol=1e-5, atol=1e-5)


def test_documents_equal_once_cut_are_duplicates_for_the_sampler(write_config, pairs_file, tiny_model_dir, tmp_path):
    """ColBERT.jl#16 (documents cut at doc_maxlen), the false-negative half: documents that differ only after
    ``document_length`` are the same document to the model, so the no-duplicates sampler treats them as one
    and ``validate`` says it cannot fill a batch, naming the column and where it is cut (it named
    max_seq_length only). Reference: the tokenizer's ids cut at 12 by hand: one distinct document."""
    rows = [
        {"anchor": f"question {i}", "positive": "the man sits at the table near the bus " * 2 + f"end {i}"}
        for i in range(12)
    ]
    path = write_config(
        {
            "model": {"kind": "multi_vector", "name_or_path": str(tiny_model_dir), "device": "cpu", "dim": 16}
            | {"document_length": 12},
            "data": {"train": str(pairs_file(rows)), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 6, "mini_batch_size": 3},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        }
    )
    tokenizer = _plain(tiny_model_dir).tokenizer
    cut = {tuple(ids[:11] + ids[-1:]) for ids in tokenizer([r["positive"] for r in rows])["input_ids"]}
    assert len(cut) == 1 and len({r["positive"] for r in rows}) == 12
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 2
    assert "column 'positive' (role positive) has only 1 distinct texts" in r.output
    assert "max_seq_length 64, positive cut at 12)" in r.output
