"""What a model's files say of its shape without loading its weights (issue 39 item 6): the embedding
dimension through the module stack, the backbone's modules on the meta device; each the loaded
model's own answer."""

from __future__ import annotations

import json
import shutil

from sentence_transformers import SentenceTransformer
from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

from cembed.config.schema import ModelConfig
from cembed.model.load import load_model
from cembed.model.shape import backbone_modules, embedding_dimension


def test_the_dimension_and_modules_are_the_loaded_models(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    model = load_model(cfg, "cpu", for_training=False)
    assert embedding_dimension(cfg) == model.get_embedding_dimension() == 32
    loaded = {name: type(m).__name__ for name, m in model[0].model.named_modules() if name}
    assert backbone_modules(cfg) == loaded and loaded["encoder.layer.0.attention.self.query"] == "Linear"


def test_pooling_modes_a_dense_projection_and_normalize_set_the_dimension(tiny_model_dir, tmp_path):
    transformer = Transformer(str(tiny_model_dir.parent / "hf"))
    stacks = {
        "two-modes": [transformer, Pooling(32, ("mean", "max"))],
        "dense": [transformer, Pooling(32, "mean"), Dense(32, 12), Normalize()],
    }
    for name, modules in stacks.items():
        model = SentenceTransformer(modules=modules, device="cpu")
        model.save(str(tmp_path / name))
        assert embedding_dimension(ModelConfig(name_or_path=str(tmp_path / name))) == model.get_embedding_dimension()
    assert embedding_dimension(ModelConfig(name_or_path=str(tmp_path / "two-modes"))) == 64
    assert embedding_dimension(ModelConfig(name_or_path=str(tmp_path / "dense"))) == 12


def test_an_older_pooling_config_and_an_unknown_module(tmp_path, tiny_model_dir):
    folder = tmp_path / "old"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
    )
    assert embedding_dimension(ModelConfig(name_or_path=str(folder))) == 64  # sentence-transformers 2-5's format
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Odd", "type": "my_package.OddModule"})
    (folder / "modules.json").write_text(json.dumps(modules))
    assert embedding_dimension(ModelConfig(name_or_path=str(folder))) is None  # not read here: loading decides


def test_a_plain_checkpoint_is_its_hidden_size_and_nothing_known_is_none(tiny_model_dir, tmp_path):
    plain = tiny_model_dir.parent / "hf"
    assert embedding_dimension(ModelConfig(name_or_path=str(plain))) == 32
    assert backbone_modules(ModelConfig(name_or_path=str(plain)))["pooler.dense"] == "Linear"
    missing = ModelConfig(name_or_path=str(tmp_path / "nothing"))
    assert embedding_dimension(missing) is None and backbone_modules(missing) is None
    assert backbone_modules(ModelConfig(name_or_path=str(plain), trust_remote_code=True)) is None
