"""The training recipe and everything it owns: the checks before training (all of ``validate``), the
trainer's arguments, ``CembedTrainer``, the throughput meter and FLOPs, checkpoints and resume, evaluation
during training, ``run_summary.json`` and publishing.

May import every package below it; never ``cembed.cli``, rich or typer (the recipe is handed a display).
"""
