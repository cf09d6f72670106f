"""The GPU check's offline bundle (made by ``scripts/gpu_bundle.sh``): its check against
``MANIFEST.json`` and the pip call that installs its wheels with no package index.

Standard library only: it runs before the bundle's packages are installed (tests/scripts/test_gpu_check.py
asserts it).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

BUNDLE_LIMIT = 60 * 2**20
# What the bundle must hold beyond the GPU image (torch 2.11, transformers 5.17, sentence-transformers
# 6.0.1, no pydantic, datasets or optuna; typer, rich, pyyaml and xxhash at versions nobody read there):
# see scripts/gpu_bundle.sh.
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
    "optuna",
    "alembic",
    "sqlalchemy",
    "mako",
    "colorlog",
    "typer",
    "rich",
    "pyyaml",
    "xxhash",
    "cembed",
)
# At most one wheel each, not required: the fused MaxSim kernel (scripts/gpu_bundle.sh's KERNELS), which
# the maxsim stage uses on CUDA where it imports.
OPTIONAL_PACKAGES = ("late_interaction_kernels",)
# fallback/ holds these for an image whose pyarrow is below wheels/' datasets' floor (its pyarrow wheel,
# 53 MiB, does not fit beside the model): installed in place of wheels/' own (``chosen_wheels``).
FALLBACK_PACKAGES = ("datasets", "fsspec")
MODEL_FILES = ("modules.json", "config.json", "model.safetensors", "tokenizer.json")


def _dist_name(wheel: str) -> str:
    return wheel.split("/")[-1].split("-")[0].lower().replace("-", "_").replace(".", "_")


def coco_pairs_of(bundle: Path) -> str:
    """The COCO pairs file's path relative to ``bundle`` as its manifest names it: the bundle's own copy
    (``coco_pairs.jsonl.gz``), or the packaged slice in the tree it travels with
    (``../cembed/samples/...``), which the bundle does not carry twice."""
    manifest = bundle / "MANIFEST.json"
    names = json.loads(manifest.read_text()) if manifest.is_file() else {}
    return names.get("coco_pairs", "coco_pairs.jsonl.gz")


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
        if names.count(pkg) > 1:
            problems.append(f"wheels/: {names.count(pkg)} wheels of {pkg} (at most 1)")
    if manifest.get("fallback"):
        fallback = [_dist_name(p.name) for p in (bundle / "fallback").glob("*.whl")]
        for pkg in FALLBACK_PACKAGES:
            if fallback.count(pkg) != 1:
                problems.append(f"fallback/: {fallback.count(pkg)} wheels of {pkg} (need exactly 1)")
    model = bundle / manifest.get("model", "all-MiniLM-L6-v2-fp16")
    problems += [f"model folder lacks {f}" for f in MODEL_FILES if not any(model.rglob(f))]
    if not (bundle / coco_pairs_of(bundle)).is_file():
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


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version (``"24.0.0"`` -> (24, 0, 0); ``"2.11.0+cu130"`` -> (2, 11, 0);
    ``"25.0.0rc1"`` -> (25, 0, 0)): enough to compare against a floor without ``packaging``."""
    return tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def meets_floor(version: str, spec: str) -> bool:
    """Whether ``version`` meets a lower bound written ``>=X`` (the form datasets' pyarrow pin takes)."""
    if not spec.startswith(">="):
        raise ValueError(f"expected a '>=' floor, got {spec!r}")
    return _release(version) >= _release(spec[2:])


def chosen_wheels(bundle: Path, pyarrow: str | None) -> list[str]:
    """The wheels to install for an image whose pyarrow is ``pyarrow`` (None: not read): wheels/ all,
    unless its datasets needs a newer pyarrow and fallback/ has a datasets that does not; then
    fallback/'s wheels replace wheels/' of the same packages."""
    wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    floors = manifest.get("pyarrow") or {}
    if pyarrow is None or "wheels" not in floors or meets_floor(pyarrow, floors["wheels"]):
        return wheels
    fallback = sorted(str(p) for p in (bundle / "fallback").glob("*.whl"))
    if not fallback or not meets_floor(pyarrow, floors["fallback"]):
        return wheels  # nothing fits; the install stage reports the unmet pin
    replaced = {_dist_name(w) for w in fallback}
    return sorted([w for w in wheels if _dist_name(w) not in replaced] + fallback)


def install_command(py: str, bundle: Path, site: Path, pyarrow: str | None = None) -> list[str]:
    """The pip call that installs the bundle's wheels (``chosen_wheels`` for the image's ``pyarrow``)
    into ``site`` without an index."""
    wheels = chosen_wheels(bundle, pyarrow)
    return [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site), *wheels]
