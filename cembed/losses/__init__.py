"""The loss seam and the built-in losses: the registry (``register_loss`` -> ``BuiltLoss``, the contract
the trainer and the probe read), one module per loss family that registers itself, the length-sorted /
token-budget / packed mini-batch mixin, and the counters the meter reads.

May import: ``cembed.model``, ``cembed.plan``, ``cembed.config``, ``cembed.files``, ``cembed.errors``
(never data, eval, probe, train or cli). This is the one ``__init__`` in cembed that imports: the
built-in loss modules, so that they register.
"""

import cembed.losses.cached_maxsim  # noqa: F401 - registers cached_maxsim
import cembed.losses.gist  # noqa: F401 - registers cached_gist
import cembed.losses.mnrl  # noqa: F401 - registers cached_mnrl and mnrl
import cembed.losses.splade  # noqa: F401 - registers cached_splade
