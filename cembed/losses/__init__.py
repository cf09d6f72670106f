"""The loss seam and the built-in losses (may import: model, config, errors).

:mod:`cembed.losses.registry` holds the contract (``register_loss``, ``build_loss``, ``BuiltLoss``);
each built-in loss module registers itself, and this file imports them so that they do
(the one ``__init__`` in cembed that imports).
"""

import cembed.losses.gist  # noqa: F401 - registers cached_gist
import cembed.losses.mnrl  # noqa: F401 - registers cached_mnrl and mnrl
