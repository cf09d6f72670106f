"""The GPU check's offline bundle (made by ``scripts/gpu_bundle.sh``): its check against
``MANIFEST.json`` and the pip call that installs its wheels with no package index.

Standard library only: it runs before the bundle's packages are installed (tests/scripts/test_gpu_check.py
asserts it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

BUNDLE_LIMIT = 60 * 2**20
# What the bundle must hold beyond the GPU image (torch 2.11, transformers 5.17, sentence-transformers
# 6.0.1, no pydantic or datasets): see scripts/gpu_bundle.sh.
BUNDLE_PACKAGES = (
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_inspection",
    "typing_extensions",
    "datasets",
    "dill",
    "multiprocess",
    "fsspec",
    "sentence_transformers",
    "cembed",
)
# Brought only when the image's is too old for the bundled datasets (scripts/gpu_bundle.sh decides):
# at most one wheel each.
OPTIONAL_PACKAGES = ("pyarrow",)
MODEL_FILES = ("modules.json", "config.json", "model.safetensors", "tokenizer.json")


def _dist_name(wheel: str) -> str:
    return wheel.split("/")[-1].split("-")[0].lower().replace("-", "_").replace(".", "_")


def check_bundle(bundle: Path | None) -> dict:
    """Check a bundle against its ``MANIFEST.json``: every listed file present with its size and
    sha256, the total within 60 MiB, one wheel per needed package (at most one of each optional
    one), the model folder complete.

    Returns:
        ``{"ok": bool, "problems": [...], "wheels": [...], "total_mib": float, ...}``; ``ok`` is
        True with ``bundle: null`` when no bundle is used.
    """
    if bundle is None:
        return {"ok": True, "bundle": None, "note": "no --bundle: the current environment is used"}
    problems: list[str] = []
    manifest_path = bundle / "MANIFEST.json"
    if not manifest_path.is_file():
        return {"ok": False, "bundle": str(bundle), "problems": [f"{manifest_path} is missing"]}
    manifest = json.loads(manifest_path.read_text())
    for rel, meta in manifest.get("files", {}).items():
        path = bundle / rel
        if not path.is_file():
            problems.append(f"missing {rel}")
        elif path.stat().st_size != meta["bytes"]:
            problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {meta['bytes']}")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != meta["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest")
    wheels = sorted(str(p.relative_to(bundle)) for p in (bundle / "wheels").glob("*.whl"))
    names = [_dist_name(w) for w in wheels]
    for pkg in BUNDLE_PACKAGES:
        count = names.count(pkg)
        if count != 1:
            problems.append(f"wheels/: {count} wheels of {pkg} (need exactly 1)")
    for pkg in OPTIONAL_PACKAGES:
        count = names.count(pkg)
        if count > 1:
            problems.append(f"wheels/: {count} wheels of {pkg} (at most 1)")
    model = bundle / manifest.get("model", "all-MiniLM-L6-v2-fp16")
    problems += [f"model folder lacks {f}" for f in MODEL_FILES if not any(model.rglob(f))]
    if not (bundle / manifest.get("coco_pairs", "coco_pairs.jsonl.gz")).is_file():
        problems.append("coco pairs file missing")
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    if total > BUNDLE_LIMIT:
        problems.append(f"bundle is {total / 2**20:.1f} MiB, over 60 MiB")
    return {
        "ok": not problems,
        "bundle": str(bundle),
        "problems": problems,
        "wheels": wheels,
        "model": str(model),
        "total_mib": round(total / 2**20, 2),
    }


def install_command(py: str, bundle: Path, site: Path) -> list[str]:
    """The pip call that installs the bundle's wheels into ``site`` without an index."""
    wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
    return [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site), *wheels]
