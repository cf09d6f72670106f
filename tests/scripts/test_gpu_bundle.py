"""scripts/gpu_bundle.sh's bundle against the GPU image as it is (issue 32, item 7): Python 3.12, torch
2.11, transformers 5.17, sentence-transformers 6.0.1, pyarrow of a version nobody read, no datasets,
pydantic or optuna, and no package index. The bundle is built once into the repo-ignored ``.gpu-bundle/``
(rebuilt when the script or pyproject.toml changes; skipped only when pip cannot reach the index), then
pip resolves its wheels with no index against the image's packages (scripts/gpu_check/image_packages.txt)
as metadata-only stand-in wheels: a requirement the bundle and the image together do not meet fails."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "gpu_check"))
from bundle import _dist_name, check_bundle, chosen_wheels  # noqa: E402

BUNDLE = REPO / ".gpu-bundle"
IMAGE = REPO / "scripts" / "gpu_check" / "image_packages.txt"
DEVICE_CARRY_LIMIT = 64 * 2**20  # what one device call carries: the tree and the carried bundle
# What the image has and the bundle must not bring (it would shadow the image's CUDA builds, or not fit).
IMAGE_ONLY = ("torch", "transformers", "pyarrow", "tokenizers", "numpy", "accelerate", "huggingface_hub")


def _norm(name: str) -> str:
    """A project name as bundle._dist_name spells a wheel's (``huggingface-hub`` -> ``huggingface_hub``)."""
    return name.lower().replace("-", "_").replace(".", "_")


def image_pins() -> dict[str, str]:
    """``name -> version`` from image_packages.txt (``name==version  # seen|assumed``)."""
    pins = {}
    for line in IMAGE.read_text().splitlines():
        spec = line.split("#")[0].strip()
        if spec:
            name, version = spec.split("==")
            pins[name] = version
    return pins


def stub_wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel holding only the metadata of ``name`` ``version`` (no requirements): the image's installed
    package as pip's resolver sees it."""
    norm = name.replace("-", "_")
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    info = f"{norm}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def resolve(wheels: list[str], pyarrow: str, work: Path) -> subprocess.CompletedProcess:
    """``pip install --dry-run --no-index`` of ``wheels`` for CPython 3.12 manylinux x86-64, every other
    requirement met only by the image's packages (pinned, as stand-ins) with pyarrow at ``pyarrow``."""
    bundled = {_dist_name(w) for w in wheels}
    image = {**image_pins(), "pyarrow": pyarrow}
    stubs = work / "image"
    stubs.mkdir(parents=True)
    pins = {n: v for n, v in image.items() if _norm(n) not in bundled}
    for name, version in pins.items():
        stub_wheel(stubs, name, version)
    constraints = work / "image-constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(stubs)]
    cmd += ["-c", str(constraints), "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for platform in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        cmd += ["--platform", platform]
    cmd += ["--target", str(work / "target"), "--report", str(work / "report.json"), *wheels]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})


def resolved(work: Path) -> dict[str, str]:
    """``name -> version`` pip would install, from its ``--report``."""
    report = json.loads((work / "report.json").read_text())
    return {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}


def _stamp() -> str:
    return hashlib.sha256(
        b"".join((REPO / p).read_bytes() for p in ("scripts/gpu_bundle.sh", "pyproject.toml"))
    ).hexdigest()


@pytest.fixture(scope="module")
def bundle() -> Path:
    """The bundle in ``.gpu-bundle/``, built by scripts/gpu_bundle.sh unless one built from the same
    script and pyproject.toml is there; skips only when pip cannot reach the package index."""
    stamp = BUNDLE / "STAMP"
    if stamp.is_file() and stamp.read_text() == _stamp() and check_bundle(BUNDLE)["ok"]:
        return BUNDLE
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "colorlog"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        pytest.skip(f"pip cannot reach the package index to build the bundle: {probe.stderr.strip()[-200:]}")
    built = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_bundle.sh"), str(BUNDLE)],
        capture_output=True,
        text=True,
        timeout=900,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    stamp.write_text(_stamp())
    return BUNDLE


@pytest.mark.slow
def test_the_bundle_resolves_against_the_image(bundle, tmp_path):
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    floor = manifest["pyarrow"]["wheels"].removeprefix(">=")
    wheels = chosen_wheels(bundle, floor)
    r = resolve(wheels, floor, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = resolved(tmp_path)
    # the image's own builds stay: pip takes torch, transformers and pyarrow from the image's stand-ins
    assert (got["torch"], got["transformers"], got["pyarrow"]) == ("2.11.0", "5.17.0", floor)
    # and sentence-transformers from the bundle, at cembed's floor or above (the image's 6.0.1 is below it)
    assert got["sentence_transformers"].split(".")[:2] >= ["6", "3"], got["sentence_transformers"]
    assert {_dist_name(w) for w in wheels} <= set(got)


@pytest.mark.slow
def test_an_older_image_pyarrow_gets_the_fallback_datasets(bundle, tmp_path):
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    old = manifest["pyarrow"]["fallback"].removeprefix(">=")  # below wheels/' datasets' floor
    assert manifest["pyarrow"]["wheels"] != manifest["pyarrow"]["fallback"]
    everything = chosen_wheels(bundle, None)
    r = resolve(everything, old, tmp_path / "wheels")
    assert r.returncode != 0 and "datasets 5.2.0 depends on pyarrow>=24.0.0" in r.stdout + r.stderr, r.stderr[-2000:]
    picked = chosen_wheels(bundle, old)
    assert sorted(_dist_name(w) for w in set(picked) - set(everything)) == ["datasets", "fsspec"]
    r = resolve(picked, old, tmp_path / "fallback")
    assert r.returncode == 0, r.stderr[-3000:]
    assert resolved(tmp_path / "fallback")["pyarrow"] == old


@pytest.mark.slow
def test_the_bundle_leaves_the_image_its_packages_and_fits_one_call(bundle):
    names = {_dist_name(p.name) for p in bundle.rglob("*.whl")}
    assert not names & set(IMAGE_ONLY), names & set(IMAGE_ONLY)
    tree = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    tree_bytes = sum((REPO / f).stat().st_size for f in tree if f and (REPO / f).is_file())
    bundle_bytes = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    print(f"tree {tree_bytes / 2**20:.2f} MiB + bundle {bundle_bytes / 2**20:.2f} MiB")
    assert tree_bytes + bundle_bytes < DEVICE_CARRY_LIMIT
