"""Field cases (issue 41's round) for evaluating a sparse model: each built from a public bug report about
sparse (SPLADE) retrieval in sentence-transformers, Text Embeddings Inference or pyserini, tried as a new
user would and compared with a reference computed without cembed (plain sentence-transformers'
``SparseInformationRetrievalEvaluator``, ``encode_query`` / ``encode_document`` one text at a time).
docs/development.md lists the round."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_splade

from cembed.eval.evaluators import evaluate_retrieval
from cembed.eval.score import score_model
from cembed.eval.sets import load_beir

WORDS = "man woman people dog cat train table street car room plate food bus red blue white black two".split()


@pytest.fixture(scope="module")
def beir(tmp_path_factory):
    """A BEIR folder of 30 documents (3 to 11 words: mini-batches with padding) and 10 queries."""
    folder = tmp_path_factory.mktemp("beir")
    docs = {f"d{i}": " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 9)) for i in range(30)}
    queries = {f"q{i}": " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(2 + i % 3)) for i in range(10)}
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in docs.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (folder / "qrels").mkdir()
    lines = (
        ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in range(10)] + [f"q{i}\td{i + 15}\t1" for i in (0, 4)]
    )
    (folder / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    return folder


def test_an_inference_free_folder_keeps_max_active_dims_through_its_router(beir, tmp_path):
    """sentence-transformers#3695 (``max_active_dims`` passed into the Router's tokenize misrouted an
    inference-free model's queries) and #4046 ("Saving a SparseEncoder currently drops max_active_dims").
    An inference-free SPLADE folder saved with ``max_active_dims: 3``: ``cembed eval``'s metrics and active
    dimensions are plain sentence-transformers' ``SparseInformationRetrievalEvaluator``'s on the same
    folder, no query or document has more than 3 active dimensions, and the queries went down the static
    route (their active tokens are the query's own)."""
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

    splade = make_tiny_splade(tmp_path / "src", bias=-0.1)
    query = SparseStaticEmbedding(tokenizer=splade[0].tokenizer, frozen=False)
    router = Router.for_query_document(query_modules=[query], document_modules=[splade[0], splade[1]])
    SparseEncoder(modules=[router], device="cpu", similarity_fn_name="dot", max_active_dims=3).save(
        str(tmp_path / "model")
    )
    plain = SparseEncoder(str(tmp_path / "model"), device="cpu")
    assert plain.max_active_dims == 3
    rs = load_beir(beir)
    stock = SparseInformationRetrievalEvaluator(rs.queries, rs.corpus, rs.relevant_docs, name=rs.name)(plain)
    report = score_model(str(tmp_path / "model"), [beir], [], device="cpu", cache_dir=tmp_path / "cache")
    ours = report.sets[rs.name]["metrics"]
    for key in ("dot_ndcg@10", "dot_mrr@10", "dot_map@100", "query_active_dims", "corpus_active_dims"):
        assert ours[f"{rs.name}_{key}"] == pytest.approx(stock[f"{rs.name}_{key}"], abs=1e-6), key
    assert 0 < ours[f"{rs.name}_query_active_dims"] <= 3 and 0 < ours[f"{rs.name}_corpus_active_dims"] <= 3
    text = next(iter(rs.queries.values()))
    active = set(plain.encode_query([text], convert_to_tensor=True).to_dense()[0].nonzero().flatten().tolist())
    assert active <= set(plain.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_documents_sparse_vector_does_not_depend_on_its_batch(beir, tmp_path):
    """huggingface/text-embeddings-inference#189 and castorini/pyserini#2328 (SPLADE pooling is
    ``max(log(1 + relu(logits)) * attention_mask)``: a padded position must not add a weight). ``cembed
    eval``'s corpus, encoded in batches of 1, 4 and 32 (documents of 3 to 11 words, so each batch pads
    differently), is each document encoded alone by plain ``encode_document``."""
    model = make_tiny_splade(tmp_path / "src", bias=-0.1).eval()
    rs = load_beir(beir)
    alone = torch.cat([model.encode_document([text], convert_to_tensor=True).to_dense() for text in rs.corpus.values()])
    for batch_size in (1, 4, 32):
        _, corpus = evaluate_retrieval(model, rs, batch_size=batch_size, cache_dir=tmp_path / f"cache{batch_size}")
        torch.testing.assert_close(corpus.on_device("cpu").to_dense(), alone, rtol=0, atol=1e-5)
