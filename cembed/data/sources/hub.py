"""The ``hub`` source kind: a dataset id on the Hugging Face Hub (or its local cache)."""

from __future__ import annotations

import os

from cembed.config.sources import (
    HubSource,
)
from cembed.errors import HubUnavailable, UserError, first_line


def load_hub(source: HubSource):
    """Load ``source.split`` of a hub dataset (``source.subset`` its configuration) as a ``datasets.Dataset``.

    Raises:
        HubUnavailable: the hub is offline or unreachable (and the dataset is not cached).
        UserError: the dataset, subset or split cannot be loaded (unknown id, ...).
    """
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(source.path, source.subset, split=source.split)
    except Exception as err:
        first = first_line(err)
        message = (
            f"data: cannot load hub dataset {source.path!r} (subset={source.subset}, split={source.split}): {first}"
        )
        # datasets raises the builtin ConnectionError both offline and when the hub cannot be reached.
        if isinstance(err, ConnectionError):
            raise HubUnavailable(message, source.path, hub_unavailable_reason(first)) from None
        raise UserError(message) from None


def hub_unavailable_reason(error_line: str) -> str:
    """Why the hub could not serve a dataset: ``offline: HF_DATASETS_OFFLINE=1`` (naming the variable
    that switched offline mode on), or ``hub unreachable: <the library's message>``."""
    import datasets

    if datasets.config.HF_HUB_OFFLINE:
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            value = os.environ.get(var, "")
            if value.upper() in ("1", "ON", "YES", "TRUE"):
                return f"offline: {var}={value}"
        return "offline mode"
    return f"hub unreachable: {error_line[:200]}"
