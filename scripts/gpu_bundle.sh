#!/usr/bin/env bash
# Build the offline bundle for `scripts/gpu_check.sh --bundle DIR` (issue 14), where the package
# index is reachable. The GPU image it targets has Python 3.12, torch 2.11, transformers 5.17,
# sentence-transformers 6.0.1 and no pydantic or datasets, and no network. The bundle holds:
#   wheels/   the exact wheels cembed needs beyond that image (manylinux x86-64, cp312), at the
#             versions of the environment this script runs in, plus the cembed wheel of this tree
#   all-MiniLM-L6-v2-fp16/   the packaged all-MiniLM-L6-v2 with fp16 weights (cembed trains it in
#             fp32 master weights; the original fp32 copy, 88 MB, is too big to carry)
#   coco_pairs.jsonl.gz      real COCO caption pairs (val2017, 50,071 rows; else the packaged train slice)
#   MANIFEST.json            every file with its size and sha256, the wheel versions, the total
# pyarrow: the bundled datasets needs a recent pyarrow (its wheel's Requires-Dist, read below; 5.2.0 needs
# >=24.0.0), and the image's version is not known ahead. IMAGE_PYARROW=<version> (as the check's install
# stage reports it under versions.pyarrow) tells this script the image's: when it does not meet the
# requirement, the bundle brings the pyarrow wheel of this environment's version (about 53 MiB).
# Unset, nothing is brought and a warning says so (the install stage then reports the unmet pin).
# It refuses a bundle over 60 MiB (a device call carries 64 MiB with the tree); pyarrow and the fp16 model
# together exceed it, so a too-old image pyarrow needs an older datasets instead (see the message).
# Usage: IMAGE_PYARROW=<version> bash scripts/gpu_bundle.sh DIR   (env: PYTHON, IMAGE_PYARROW)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: gpu_bundle.sh DIR}
PY=${PYTHON:-python3}
LIMIT_MIB=${BUNDLE_LIMIT_MIB:-60}
# What the image lacks or has too old: pydantic (and its three needs), datasets (dill, multiprocess;
# fsspec pinned at or below datasets' bound), sentence-transformers >= 6.2 (the image has 6.0.1).
# Everything else cembed imports is in the image (torch, transformers, accelerate, typer, rich,
# pyyaml, xxhash, matplotlib, pyarrow, pandas, huggingface-hub, nvidia-ml-py).
PACKAGES="pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess fsspec sentence-transformers"
rm -rf "$DIR" && mkdir -p "$DIR/wheels"
pins=$($PY - "$PACKAGES" <<'EOF'
import sys
from importlib import metadata
print(" ".join(f"{n}=={metadata.version(n)}" for n in sys.argv[1].split()))
EOF
)
echo "wheels: $pins"
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR/wheels" $pins
# Does the image's pyarrow meet the bundled datasets' requirement? (yes / no / unknown, and the requirement)
read -r pyarrow_ok pyarrow_req < <($PY - "$DIR/wheels" "${IMAGE_PYARROW:-}" <<'EOF'
import glob, sys, zipfile
from email.parser import Parser

from packaging.requirements import Requirement

wheel = glob.glob(sys.argv[1] + "/datasets-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
req = next((r for r in reqs if r.name == "pyarrow" and (r.marker is None or r.marker.evaluate({"extra": ""}))), None)
if req is None:
    print("yes none")
elif not sys.argv[2]:
    print("unknown", str(req).replace(" ", ""))
else:
    print("yes" if req.specifier.contains(sys.argv[2], prereleases=True) else "no", str(req).replace(" ", ""))
EOF
)
case $pyarrow_ok in
  yes) echo "pyarrow: the image's ${IMAGE_PYARROW:-} meets datasets' ${pyarrow_req}; not bundled" ;;
  unknown) echo "warning: pyarrow not bundled: datasets needs ${pyarrow_req} and the image's version is unknown;" \
    "the check's install stage reports it (versions.pyarrow, unmet); rebuild with IMAGE_PYARROW=<it>" >&2 ;;
  no)
    have=$($PY -c 'from importlib import metadata; print(metadata.version("pyarrow"))')
    echo "pyarrow: the image's ${IMAGE_PYARROW} does not meet datasets' ${pyarrow_req}; bundling pyarrow==${have}"
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DIR/wheels" "pyarrow==${have}" ;;
esac
$PY -m pip wheel -q --no-deps --no-build-isolation -w "$DIR/wheels" . >/dev/null
rm -rf build cembed.egg-info 2>/dev/null || true
$PY - "$DIR" "$LIMIT_MIB" "$pyarrow_ok" "$pyarrow_req" "${IMAGE_PYARROW:-}" <<'EOF'
import hashlib, json, shutil, sys
from pathlib import Path

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
shutil.copyfile(coco, out / "coco_pairs.jsonl.gz")
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
    "coco_pairs": "coco_pairs.jsonl.gz",
    "coco_source": coco.name,
    "pyarrow": {"datasets_requires": sys.argv[4], "image": sys.argv[5] or None, "image_meets_it": sys.argv[3]},
    "files": files,
    "total_bytes": total,
}
(out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
mib = total / 2**20
print(f"bundle {out}: {len(files)} files, {mib:.1f} MiB (limit {limit:g} MiB)")
for rel, f in files.items():
    if rel.startswith("wheels/") or f["bytes"] > 2**20:
        print(f"  {f['bytes'] / 2**20:7.2f} MiB  {rel}")
if mib > limit:
    advice = ""
    if sys.argv[3] == "no":
        advice = (
            f"; the pyarrow wheel the image's {sys.argv[5]} needs (datasets {sys.argv[4]}) does not fit beside the "
            "model: install a datasets release whose pyarrow floor the image meets here (cembed needs datasets>=2.19) "
            "and rebuild"
        )
    sys.exit(f"bundle is {mib:.1f} MiB, over the {limit:g} MiB limit{advice}")
EOF
