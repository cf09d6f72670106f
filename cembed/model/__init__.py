"""Loading and running the encoder: the model kinds (``kinds/``: what a text becomes, how each kind
loads, trains and is saved), the packaged short names, pooling, decoders as embedders, LoRA,
prompts, packed (unpadded) attention and its packing plans.

May import: ``cembed.plan``, ``cembed.config``, ``cembed.files``, ``cembed.errors`` (never data, losses or above).
"""
