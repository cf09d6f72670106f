#!/usr/bin/env bash
# Build the offline bundle for `scripts/gpu_check.sh --bundle DIR` (issue 14), where the package
# index is reachable. The GPU image it targets has Python 3.12, torch 2.11, transformers 5.17,
# sentence-transformers 6.0.1 and no pydantic or datasets, and no network. The bundle holds:
#   wheels/   the exact wheels cembed needs beyond that image (manylinux x86-64, cp312), at the
#             versions of the environment this script runs in, plus the cembed wheel of this tree
#   all-MiniLM-L6-v2-fp16/   the packaged all-MiniLM-L6-v2 with fp16 weights (cembed trains it in
#             fp32 master weights; the original fp32 copy, 88 MB, is too big to carry)
#   coco_pairs.jsonl.gz      real COCO caption pairs (val2017, 50,071 rows; without ../shared the manifest
#                            points at the packaged train slice in the tree instead of a second copy)
#   MANIFEST.json            every file with its size and sha256, the wheel versions, the total
# pyarrow: the image's version was never read (KINDS.md lists pyarrow without one) and its wheel (53 MiB)
# does not fit beside the model, so the bundle adapts instead: wheels/ holds the datasets of this
# environment (5.2.0 needs pyarrow>=24) and fallback/ an older datasets with the fsspec it accepts
# (5.0.0: pyarrow>=21, fsspec<=2026.4.0); the check's install stage reads the image's pyarrow and installs
# fallback/'s wheels in place of wheels/' datasets and fsspec when the image's is below the first floor
# (scripts/gpu_check/bundle.py). MANIFEST.json records both floors, read from the wheels.
# The wheel set is resolved against the image's packages (scripts/gpu_check/image_packages.txt) on CPU
# by tests/scripts/test_gpu_bundle.py. It refuses a bundle over 60 MiB (a device call carries 64 MiB with
# the tree). Usage: bash scripts/gpu_bundle.sh DIR   (env: PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: gpu_bundle.sh DIR}
PY=${PYTHON:-python3}
LIMIT_MIB=${BUNDLE_LIMIT_MIB:-60}
# What the image lacks, has too old, or has at a version nobody read there (image_packages.txt says
# which): pydantic (and its needs), datasets (dill, multiprocess; fsspec at or below datasets' bound),
# sentence-transformers >= 6.3 (the image has 6.0.1), optuna (cembed's sweep; alembic, sqlalchemy, mako,
# colorlog), and typer, rich, pyyaml, xxhash at the versions CI tests (the image's were never read; small).
# Everything else cembed needs is in the image at a version that meets cembed's floors (torch,
# transformers, accelerate, pyarrow, numpy, huggingface-hub, tokenizers; matplotlib for the plots only).
PACKAGES="pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess fsspec
  sentence-transformers optuna alembic sqlalchemy mako colorlog typer rich pyyaml xxhash"
# The datasets, and the fsspec its bound admits, for an image whose pyarrow is below 24 (5.0.0 needs >=21).
FALLBACK="datasets==5.0.0 fsspec==2026.4.0"
# Optional, not a requirement of cembed (so not in this environment): the fused MaxSim kernel the maxsim
# stage compares with the tiled path on CUDA (pure Python + Triton; the image has triton 3.6.0).
# Left out of a bundle that would then not fit one device call with the tree (MANIFEST.json's "kernels"
# says which). KERNELS= (empty) builds without it.
KERNELS=${KERNELS-late-interaction-kernels==0.4.5}
rm -rf "$DIR" && mkdir -p "$DIR/wheels" "$DIR/fallback"
pins=$($PY - "$PACKAGES" <<'EOF'
import sys
from importlib import metadata
print(" ".join(f"{n}=={metadata.version(n)}" for n in sys.argv[1].split()))
EOF
)
echo "wheels: $pins"
download() {  # DEST SPEC...: exact wheels for CPython 3.12 on manylinux x86-64, no dependencies
  local dest=$1; shift
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "$@"
}
# shellcheck disable=SC2086
download "$DIR/wheels" $pins
if [ -n "$KERNELS" ]; then
  echo "kernels: $KERNELS"
  # shellcheck disable=SC2086
  download "$DIR/wheels" $KERNELS
fi
echo "fallback: $FALLBACK"
# shellcheck disable=SC2086
download "$DIR/fallback" $FALLBACK
$PY -m pip wheel -q --no-deps --no-build-isolation -w "$DIR/wheels" . >/dev/null
rm -rf build cembed.egg-info 2>/dev/null || true
$PY - "$DIR" "$LIMIT_MIB" <<'EOF'
import glob, hashlib, json, shutil, sys, zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement


def pyarrow_floor(folder):
    """The pyarrow requirement of the datasets wheel in ``folder`` (e.g. ``pyarrow>=24.0.0``)."""
    with zipfile.ZipFile(glob.glob(f"{folder}/datasets-*.whl")[0]) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(r) for r in Parser().parsestr(meta).get_all("Requires-Dist") or []]
    return next(str(r.specifier) for r in reqs if r.name == "pyarrow" and not r.marker)


out, limit = Path(sys.argv[1]), float(sys.argv[2])
import torch
from sentence_transformers import SentenceTransformer

from cembed.model.load import resolve_model_path

model = SentenceTransformer(resolve_model_path("all-MiniLM-L6-v2"), device="cpu")
model.half().save(str(out / "all-MiniLM-L6-v2-fp16"))
for extra in ("README.md",):  # the model card is not needed to load it
    (out / "all-MiniLM-L6-v2-fp16" / extra).unlink(missing_ok=True)
coco = Path("..") / "shared" / "data" / "coco_captions" / "caption_pairs_val2017.jsonl.gz"
if not coco.is_file():
    import cembed.samples as samples

    coco = Path(samples.__file__).parent / "coco_captions" / "train_pairs.jsonl.gz"
# The packaged slice travels with the tree already (cembed/samples/): the manifest points at it from the
# bundle's folder at the repository root instead of carrying a second copy (the tree and the bundle must
# fit one device call's 64 MiB together).
packaged = coco.name == "train_pairs.jsonl.gz"
coco_pairs = "../cembed/samples/coco_captions/train_pairs.jsonl.gz" if packaged else "coco_pairs.jsonl.gz"
if not packaged:
    shutil.copyfile(coco, out / "coco_pairs.jsonl.gz")
# The kernel wheel only where the bundle still fits one device call with the tree it travels with (the
# tracked and untracked, not ignored, files, as tests/scripts/test_gpu_bundle.py counts them); else the
# maxsim stage runs without it and says so.
import subprocess

tree = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True, text=True, check=True
).stdout.split("\0")
tree_bytes = sum(Path(f).stat().st_size for f in tree if f and Path(f).is_file())
bundle_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) + 16 * 2**10  # + the manifest
if not packaged and tree_bytes + bundle_bytes > 64 * 2**20:  # the val2017 pairs do not fit beside the tree
    bundle_bytes -= (out / "coco_pairs.jsonl.gz").stat().st_size
    (out / "coco_pairs.jsonl.gz").unlink()
    coco = Path(__import__("cembed.samples").samples.__file__).parent / "coco_captions" / "train_pairs.jsonl.gz"
    packaged, coco_pairs = True, "../cembed/samples/coco_captions/train_pairs.jsonl.gz"
    print("coco pairs: the packaged slice in the tree (val2017's would not fit one device call)")
kernels = "none asked (KERNELS empty)"
for wheel in sorted((out / "wheels").glob("late_interaction_kernels-*.whl")):
    if tree_bytes + bundle_bytes > 64 * 2**20:
        wheel.unlink()
        kernels = f"left out: the tree ({tree_bytes / 2**20:.2f} MiB) and the bundle ({bundle_bytes / 2**20:.2f} MiB) exceed one call's 64 MiB"
    else:
        kernels = f"included: {wheel.name}"
print(f"kernels: {kernels}")
files = {}
for path in sorted(p for p in out.rglob("*") if p.is_file()):
    rel = str(path.relative_to(out))
    files[rel] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
total = sum(f["bytes"] for f in files.values())
manifest = {
    "python": "3.12",
    "platform": "manylinux x86-64",
    "torch_used_to_convert": torch.__version__,
    "wheels": sorted(p for p in files if p.startswith("wheels/")),
    "model": "all-MiniLM-L6-v2-fp16",
    "coco_pairs": coco_pairs,
    "coco_source": coco.name,
    "fallback": sorted(p for p in files if p.startswith("fallback/")),
    # the pyarrow each datasets needs: the install stage picks fallback/ below the first (bundle.py)
    "pyarrow": {"wheels": pyarrow_floor(out / "wheels"), "fallback": pyarrow_floor(out / "fallback")},
    "files": files,
    "total_bytes": total,
    "kernels": kernels,  # the fused MaxSim kernel's wheel (KERNELS), or why not
}
(out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
mib = total / 2**20
print(f"bundle {out}: {len(files)} files, {mib:.1f} MiB (limit {limit:g} MiB)")
for rel, f in files.items():
    if rel.startswith(("wheels/", "fallback/")) or f["bytes"] > 2**20:
        print(f"  {f['bytes'] / 2**20:7.2f} MiB  {rel}")
if mib > limit:
    sys.exit(f"bundle is {mib:.1f} MiB, over the {limit:g} MiB limit")
EOF
