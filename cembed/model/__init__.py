"""Loading and running the encoder: the packaged short names, pooling, decoders as embedders, LoRA,
prompts, packed (unpadded) attention and its packing plans.

May import: ``cembed.plan``, ``cembed.config``, ``cembed.files``, ``cembed.errors`` (never data, losses or above).
"""
