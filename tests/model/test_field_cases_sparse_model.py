"""Field cases (issue 41's round) for loading a sparse model: each built from a public bug report about
sparse (SPLADE) models, tried as a new user would and compared with a reference computed without cembed
(plain sentence-transformers' ``SparseEncoder`` and ``SparseInformationRetrievalEvaluator`` on the saved
folder). docs/development.md lists the round."""

from __future__ import annotations

import json

from conftest import distinct_pairs, make_tiny_splade
from typer.testing import CliRunner

from cembed.cli.app import app


def test_a_cosine_sparse_folder_trains_and_saves_as_dot(write_config, pairs_file, tmp_path):
    """neuml/txtai#946 ("Change sparse vector normalization logic": most SPLADE models are trained with dot
    product on unnormalized vectors; a consumer reads ``similarity_fn_name`` to decide). A SparseEncoder
    folder saved with ``similarity_fn_name: cosine`` trained one step by ``cached_splade`` (InfoNCE on dot
    products): the saved folder says ``dot``, so plain sentence-transformers scores it as it was trained
    and as ``cembed eval`` scores it; ``validate`` says the cosine was replaced. Reference: the saved
    folder's ``config_sentence_transformers.json`` read by plain ``SparseEncoder``."""
    from sentence_transformers import SparseEncoder

    model = make_tiny_splade(tmp_path / "src", bias=-0.1)
    model.similarity_fn_name = "cosine"
    model.save(str(tmp_path / "cosine"))
    config = write_config(
        {
            "model": {"kind": "sparse", "name_or_path": str(tmp_path / "cosine"), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(16))), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(config)])
    assert r.exit_code == 0, r.output
    assert "dot (the model's SparseEncoder config; its cosine similarity replaced by dot)" in r.output
    r = CliRunner().invoke(app, ["train", str(config)])
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "run" / "config_sentence_transformers.json").read_text())
    assert saved["similarity_fn_name"] == "dot"
    assert SparseEncoder(str(tmp_path / "run"), device="cpu").similarity_fn_name == "dot"
