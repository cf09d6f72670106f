"""The largest ``mini_batch_size`` (or token budget) whose cached-loss step fits: one worst-case step,
the runners that try it (a child process or CUDA), the search, and ``mini_batch_size: auto``.

May import: ``cembed.losses``, ``cembed.model``, ``cembed.plan``, ``cembed.config``, ``cembed.distributed``,
``cembed.files``, ``cembed.errors`` (never data or eval: a trial is built from synthetic rows).
"""
