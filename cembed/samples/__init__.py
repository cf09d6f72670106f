"""Data shipped inside the package, named in configs by a short ``cembed:<name>``.

The way ``model.name_or_path: all-MiniLM-L6-v2`` resolves to the packaged model, a data path
``cembed:coco-captions`` resolves to the file below this folder (see :data:`SAMPLES`), so the demo
runs from any folder after ``pip install``. Each data folder holds a README with its source and
licence; ``scripts/make_demo_data.py`` builds them.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from cembed.errors import UserError

PREFIX = "cembed:"

# short name -> (path below this package, what it is)
SAMPLES: dict[str, tuple[str, str]] = {
    "coco-captions": (
        "coco_captions/train_pairs.jsonl.gz",
        "40,066 (anchor, positive) MS-COCO caption pairs of 4,000 images (CC BY 4.0)",
    ),
    "coco-captions-heldout": (
        "coco_captions/heldout",
        "BEIR folder, split test: 1,000 held-out COCO images, caption-to-caption retrieval, 1,000 queries / 1,000 documents (CC BY 4.0)",
    ),
}


# `cembed init OUT --example <name>`: ready-to-run configs shipped with the package. Each is the
# repo's configs/<name>.yaml with output_dir relative to where it is written (tests/samples/test_samples.py
# checks they do not drift apart).
EXAMPLES: dict[str, str] = {
    "quickstart": "examples/quickstart.yaml",
    "colbert-quickstart": "examples/colbert-quickstart.yaml",
}


def example_config(name: str) -> str:
    """The text of the packaged example config ``name`` (see :data:`EXAMPLES`).

    Raises:
        UserError: an unknown name, listing the known ones.
    """
    if name not in EXAMPLES:
        raise UserError(f"--example {name}: no such example; known: {', '.join(EXAMPLES)}")
    return files(__name__).joinpath(EXAMPLES[name]).read_text(encoding="utf-8")


def is_sample(path: str) -> bool:
    """Whether ``path`` names packaged data (starts with ``cembed:``)."""
    return path.startswith(PREFIX)


def known_samples() -> list[str]:
    """Every packaged data name, with its prefix (``cembed:coco-captions``, ...)."""
    return [PREFIX + name for name in SAMPLES]


def resolve_sample(name: str) -> Path | None:
    """The packaged file or folder that ``cembed:<name>`` names; ``None`` when ``name`` does not
    start with ``cembed:`` (an ordinary path).

    Raises:
        UserError: an unknown ``cembed:`` name (the message lists the known ones), or packaged data
            missing from the installation.
    """
    if not is_sample(name):
        return None
    key = name[len(PREFIX) :]
    if key not in SAMPLES:
        raise UserError(f"unknown packaged data {name!r}; known: {', '.join(known_samples())}")
    path = Path(str(files(__name__).joinpath(SAMPLES[key][0])))
    if not path.exists():
        raise UserError(f"{name}: packaged data missing at {path}; reinstall cembed")
    return path
