"""Multi-process training (may import: errors; torch): the process group (``group``), the
collectives the ranks agree through (``collectives``), the launcher (``launch``) and one module per
strategy (``ddp``, ``fsdp``)."""
