"""Field cases (issue 41's round) for what ``cembed init`` and ``cembed mine-negatives`` do with a sparse
model: each built from a public bug report about sparse (SPLADE) models in txtai, MTEB or
sentence-transformers, tried as a new user would and compared with a reference computed without cembed
(the folder's own sentence-transformers config, plain ``mine_hard_negatives``). docs/development.md lists
the round."""

from __future__ import annotations

import json

import pytest
from conftest import distinct_pairs, make_tiny_splade
from typer.testing import CliRunner

from cembed.cli.app import app


@pytest.fixture(scope="module")
def inference_free(tmp_path_factory):
    """An inference-free SPLADE folder (a ``Router``: a static query side, a SPLADE document side), its
    modules saved in sub-folders (``query_0_SparseStaticEmbedding``, ``document_0_Transformer``)."""
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

    root = tmp_path_factory.mktemp("inference_free")
    splade = make_tiny_splade(root / "src", bias=-0.1)
    query = SparseStaticEmbedding(tokenizer=splade[0].tokenizer, frozen=False)
    router = Router.for_query_document(query_modules=[query], document_modules=[splade[0], splade[1]])
    SparseEncoder(modules=[router], device="cpu", similarity_fn_name="dot").save(str(root / "model"))
    return root / "model"


def test_init_writes_a_sparse_starter_for_an_inference_free_folder(inference_free, pairs_file, tmp_path):
    """neuml/txtai#934 ("Inference-Free Splade ... isn't properly handled because the weights are saved in
    a sub folder"). ``cembed init --model`` an inference-free SPLADE folder: the starter says
    ``model.kind: sparse`` with ``cached_splade``, its comment says what the folder is, and ``validate``
    accepts it. Reference: the folder's ``config_sentence_transformers.json`` (``model_type:
    SparseEncoder``) and plain sentence-transformers, which loads it as a ``Router``."""
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder import SparseEncoder

    assert (
        json.loads((inference_free / "config_sentence_transformers.json").read_text())["model_type"] == "SparseEncoder"
    )
    assert isinstance(SparseEncoder(str(inference_free), device="cpu")[0], Router)
    out = tmp_path / "starter.yaml"
    data = pairs_file(distinct_pairs(64))
    r = CliRunner().invoke(app, ["init", str(out), "--model", str(inference_free), "--data", str(data)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    kind_line = next(line for line in text.splitlines() if line.strip().startswith("kind:"))
    assert kind_line.split("#")[0].split() == ["kind:", "sparse"]
    assert "sparse vector" in kind_line and "MultiVectorEncoder" not in kind_line, kind_line
    assert "name: cached_splade" in text
    r = CliRunner().invoke(app, ["validate", str(out)])
    assert r.exit_code == 0, r.output
    assert "inference-free SPLADE" in r.output


def test_mine_negatives_refuses_a_sparse_model_in_one_line(tmp_path, pairs_file):
    """embeddings-benchmark/mteb#2873 (a SparseEncoder's output handed to code written for dense
    embeddings: ``.numpy()`` on a sparse tensor breaks). ``cembed mine-negatives --model`` a SPLADE folder.
    Reference: plain sentence-transformers' ``mine_hard_negatives`` with the same model fails
    (``SparseEncoder.encode() has been called with additional keyword arguments ... convert_to_numpy``: the
    installed library cannot mine with a sparse model; when a release can, the ``pytest.raises`` below fails
    and cembed should mine with it); cembed refuses before encoding, in one line naming the kind, saying that
    the installed sentence-transformers (its version) cannot mine with it and why, and the workaround, and
    writes nothing."""
    import sentence_transformers
    from datasets import Dataset
    from sentence_transformers import SparseEncoder
    from sentence_transformers.util import mine_hard_negatives

    make_tiny_splade(tmp_path / "src", bias=-0.1).save(str(tmp_path / "splade"))
    rows = distinct_pairs(24)
    with pytest.raises(ValueError, match="additional keyword arguments"):
        mine_hard_negatives(
            Dataset.from_list(rows), SparseEncoder(str(tmp_path / "splade"), device="cpu"), verbose=False
        )
    out = tmp_path / "mined.jsonl"
    args = ["mine-negatives", str(pairs_file(rows)), "--model", str(tmp_path / "splade"), "-o", str(out)]
    r = CliRunner().invoke(app, [*args, "--device", "cpu"])
    assert r.exit_code != 0 and not out.exists()
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1, r.output
    assert "a sparse model (one vocabulary-wide sparse vector per text)" in lines[0]
    version = sentence_transformers.__version__
    assert f"the installed sentence-transformers {version} cannot mine with a sparse model" in lines[0]
    assert "normalize_embeddings, convert_to_numpy" in lines[0]
    assert "mine with a dense model (e.g. all-MiniLM-L6-v2), then train this one on the mined file" in lines[0]
    assert "keyword arguments" not in lines[0]
