"""cembed: fine-tune sentence-embedding models with in-batch-negative contrastive losses at batch
sizes far beyond GPU memory, on sentence-transformers' GradCache losses."""

__version__ = "0.1.0"
