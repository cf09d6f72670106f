"""Training runs of a multi-vector model end to end (issue 40 item 4): a run evaluates by MaxSim before,
during and after training and saves a folder that plain sentence-transformers loads as a
``MultiVectorEncoder`` and that scores as ``cembed eval`` scores it; a run killed by SIGTERM and resumed
ends with the uninterrupted run's weights; LoRA trains one and saves it merged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import KILL_AT_STEP_3, REPO, WORDS
from safetensors.torch import load_file

from cembed.config.file import config_from_dict
from cembed.train.recipe import check_run_inputs, run_training

pytestmark = pytest.mark.slow  # training runs

ROWS = [
    {
        "anchor": f"{WORDS[i % len(WORDS)]} {i} {'on the table' * (i % 3)}",
        "positive": f"the {WORDS[(i * 3) % len(WORDS)]} {i}, {'near a red car, ' * (1 + i % 4)}done",
    }
    for i in range(64)
]


def beir_folder(folder):
    """A BEIR folder of 30 documents and 10 queries (one relevant document each)."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = {f"d{i}": ROWS[i]["positive"] for i in range(30)}
    queries = {f"q{i}": ROWS[i]["anchor"] for i in range(10)}
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in docs.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (folder / "qrels").mkdir(exist_ok=True)
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(10))
    )
    return folder


def config(tmp_path, model_dir, out: str, **sections) -> dict:
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {
        "model": {
            "kind": "multi_vector",
            "name_or_path": str(model_dir),
            "device": "cpu",
            "dim": 16,
            "query_length": 12,
            "document_length": 24,
            "skiplist": "punctuation",
        },
        "data": {"train": str(data), "cache_dir": str(tmp_path / "cache")},
        "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-3, "base_batch_size": 16},
        "train": {"max_steps": 3, "logging_steps": 1, "output_dir": str(tmp_path / out), "seed": 4},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def run(cfg: dict, base):
    cfg = config_from_dict(cfg, base=base)
    plan, data = check_run_inputs(cfg)
    return run_training(cfg, plan, data)


def test_the_saved_folder_loads_in_plain_sentence_transformers_and_scores_as_cembed_eval(tiny_model_dir, tmp_path):
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator

    from cembed.eval.score import score_model
    from cembed.eval.sets import load_beir

    beir = beir_folder(tmp_path / "beir")
    name = load_beir(beir).name
    key = f"{name}_maxsim_ndcg@10"
    summary = run(config(tmp_path, tiny_model_dir, "run", eval={"retrieval": [str(beir)], "eval_steps": 3}), tmp_path)
    ev = summary["eval"]
    assert key in ev["before"] and key in ev["after"] and ev["during"][0]["step"] == 3

    saved = tmp_path / "run"
    plain = MultiVectorEncoder(str(saved), device="cpu")  # plain sentence-transformers
    assert json.loads((saved / "config_sentence_transformers.json").read_text())["model_type"] == "MultiVectorEncoder"
    assert (plain[0].query_length, plain[0].document_length, plain.get_embedding_dimension()) == (12, 24, 16)
    assert "Multi-Vector Encoder" in (saved / "README.md").read_text()  # its own model card
    rs = load_beir(beir)
    stock = MultiVectorInformationRetrievalEvaluator(rs.queries, rs.corpus, rs.relevant_docs, name=name)(plain)
    report = score_model(str(saved), [beir], [], no_cache=True)
    metrics = report.sets[name]["metrics"]
    for k in ("ndcg@10", "mrr@10", "recall@10", "map@100"):
        assert metrics[f"{name}_maxsim_{k}"] == pytest.approx(stock[f"{name}_maxsim_{k}"], abs=1e-5), k
    assert metrics[key] == pytest.approx(ev["after"][key], abs=1e-5)  # the run's own last evaluation

    from cembed.eval.maxsim_retrieval import ragged
    from cembed.model.load import load_eval_model
    from cembed.model.maxsim import maxsim_scores

    ours = load_eval_model(str(saved))
    q, d = list(rs.queries.values()), list(rs.corpus.values())
    reference = plain.similarity(plain.encode_query(q), plain.encode_document(d))
    scores = maxsim_scores(ragged(ours.encode_query(q)), ragged(ours.encode_document(d)))
    assert float((scores - reference).abs().max()) <= 1e-5


def test_sigterm_then_resume_equals_uninterrupted(tiny_dropout_model_dir, write_config, tmp_path):
    env_run = dict(cwd=REPO, capture_output=True, text=True, timeout=600)
    runs = {}
    for out in ("straight", "killed"):
        cfg = config(tmp_path, tiny_dropout_model_dir, out, train={"max_steps": 6, "save_steps": 3})
        runs[out] = write_config(cfg, name=f"{out}.yaml")
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(runs["straight"])], **env_run)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", KILL_AT_STEP_3, str(runs["killed"])], **env_run)
    assert r.returncode == 143, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(runs["killed"]), "--resume"], **env_run)
    assert r.returncode == 0, r.stderr
    a, b = (load_file(str(tmp_path / out / "model.safetensors")) for out in ("straight", "killed"))
    dense = {
        k: load_file(str(tmp_path / out / "1_Dense" / "model.safetensors"))
        for k, out in enumerate(("straight", "killed"))
    }
    max_dw = max(
        max((a[k] - b[k]).abs().max().item() for k in a),
        max((dense[0][k] - dense[1][k]).abs().max().item() for k in dense[0]),
    )
    assert max_dw <= 1e-6, max_dw
    assert json.loads((tmp_path / "killed" / "run_summary.json").read_text())["resumed_from"].endswith("checkpoint-3")


def test_lora_trains_a_multi_vector_model_and_saves_it_merged(tiny_model_dir, tmp_path):
    from sentence_transformers import MultiVectorEncoder

    lora = {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["query", "value"]}
    summary = run(config(tmp_path, tiny_model_dir, "lora", model={"lora": lora}), tmp_path)
    assert summary["lora"]["merged"] and summary["steps"] == 3
    plain = MultiVectorEncoder(str(tmp_path / "lora"), device="cpu")
    assert not any("lora" in name for name, _ in plain.named_parameters())
    assert plain.encode_query(["a dog"])[0].shape[1] == 16
    assert torch.isfinite(torch.tensor(summary["last_loss"]))
