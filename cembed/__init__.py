"""cembed: fine-tune sentence-embedding models with in-batch-negative contrastive losses at batch
sizes far beyond GPU memory, on sentence-transformers' GradCache losses."""

from importlib.metadata import PackageNotFoundError, version

try:  # one source of truth: pyproject.toml's version, as installed
    __version__ = version("cembed")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
