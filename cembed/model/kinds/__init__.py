"""Model kinds, the model layer's half: what a kind loads or builds, what its forward returns for a text,
how it is trained (the sentence-transformers trainer, arguments, collator and card classes it builds on),
scored, counted and saved. ``registry`` holds the base class and the registry by name, one module per
kind (``dense``, ``multi_vector``) registers itself, and ``lookup`` is what the rest of cembed asks: the
kind of a name, of a loaded model, of a saved folder. Kinds never import each other (the
``model-kinds`` contract).
"""
