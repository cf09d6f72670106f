"""scripts/gpu_check.sh, the one-call GPU verification, in its CPU dry-run: the plan (stages,
commands, timeouts, a fresh run folder each time) and the offline bundle's check against its
manifest. No CUDA, no torch import."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ["install", "env", "correctness", "sticky", "fp16_skip", "gather", "probe", "train", "stock"]
WHEELS = [
    "pydantic-2.14.4-py3-none-any.whl",
    "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "annotated_types-0.8.0-py3-none-any.whl",
    "typing_inspection-0.4.5-py3-none-any.whl",
    "typing_extensions-4.16.0-py3-none-any.whl",
    "datasets-5.2.0-py3-none-any.whl",
    "dill-0.4.1-py3-none-any.whl",
    "multiprocess-0.70.19-py312-none-any.whl",
    "fsspec-2026.9.0-py3-none-any.whl",
    "sentence_transformers-6.2.0-py3-none-any.whl",
    "cembed-0.1.0-py3-none-any.whl",
]


def dry_run(*extra: str) -> tuple[int, dict]:
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def fake_bundle(folder: Path) -> Path:
    """A bundle laid out as scripts/gpu_bundle.sh lays it out (placeholder bytes), with its manifest."""
    for name in WHEELS:
        (folder / "wheels").mkdir(parents=True, exist_ok=True)
        (folder / "wheels" / name).write_bytes(name.encode())
    model = folder / "all-MiniLM-L6-v2-fp16"
    (model / "0_Transformer").mkdir(parents=True)
    for name in (
        "modules.json",
        "0_Transformer/config.json",
        "0_Transformer/model.safetensors",
        "0_Transformer/tokenizer.json",
    ):
        (model / name).write_text(name)
    (folder / "coco_pairs.jsonl.gz").write_bytes(b"pairs")
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    manifest = {"model": model.name, "coco_pairs": "coco_pairs.jsonl.gz", "files": files}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    return folder


def test_dry_run_prints_the_plan_without_cuda():
    rc, plan = dry_run()
    assert rc == 0 and plan["dry_run"] is True and plan["ok"] is True
    assert [s["name"] for s in plan["stages"]] == STAGES
    assert (plan["batch"], plan["seq"], plan["deadline_s"]) == (65536, 256, 470.0)
    for stage in plan["stages"]:
        assert stage["command"].endswith(f"scripts/gpu_check.py --stage {stage['name']} --run-dir {plan['run_dir']}")
        assert 0 < stage["timeout_s"] <= 240 and stage["what"]
    assert plan["bundle_check"] == {"ok": True, "bundle": None, "note": "no --bundle: the current environment is used"}
    # a second run gets a fresh folder, so it never trips on the first one's outputs
    _, again = dry_run()
    assert again["run_dir"] != plan["run_dir"] and Path(plan["run_dir"]).parent == Path("/tmp/cembed-gpu-check")
    rc, subset = dry_run("--stages", "env,probe", "--batch", "1024")
    assert [s["name"] for s in subset["stages"]] == ["env", "probe"] and subset["batch"] == 1024


def test_dry_run_checks_the_bundle_against_its_manifest(tmp_path):
    bundle = fake_bundle(tmp_path / "bundle")
    rc, plan = dry_run("--bundle", str(bundle))
    assert rc == 0 and plan["ok"] is True, plan["bundle_check"]
    check = plan["bundle_check"]
    assert check["problems"] == [] and len(check["wheels"]) == len(WHEELS)
    install = plan["stages"][0]["command"].split()
    assert install[1:9] == ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    assert sorted(Path(w).name for w in install[10:]) == sorted(WHEELS)

    (bundle / "wheels" / "datasets-5.2.0-py3-none-any.whl").write_bytes(b"changed")
    (bundle / "wheels" / "dill-0.4.1-py3-none-any.whl").unlink()
    (bundle / "wheels" / "fsspec-2025.1.0-py3-none-any.whl").write_bytes(b"second fsspec")
    rc, plan = dry_run("--bundle", str(bundle))
    assert rc == 1 and plan["ok"] is False
    assert sorted(plan["bundle_check"]["problems"]) == sorted(
        [
            "missing wheels/dill-0.4.1-py3-none-any.whl",
            "wheels/datasets-5.2.0-py3-none-any.whl: 7 bytes, manifest says 31",
            "wheels/: 0 wheels of dill (need exactly 1)",
            "wheels/: 2 wheels of fsspec (need exactly 1)",
        ]
    )


def test_a_run_refuses_an_existing_output_folder(tmp_path):
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path), "--stages", "env"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and json.loads(r.stdout) == {
        "ok": False,
        "error": f"{tmp_path} exists; give a fresh --out",
    }
