"""Library warnings (issue 39 item 8): the command line filters the libraries' deprecation notes and
UserWarnings at its edge (the app's callback, before every command); cembed's own code leaves Python's
warning filters alone (a program that imports cembed keeps its warnings), and a user who asks for
warnings (``python -W``, ``PYTHONWARNINGS``) gets them."""

from __future__ import annotations

import sys
import warnings

import pytest
from conftest import distinct_pairs
from typer.testing import CliRunner

from cembed.cli.app import app

# (category, the module a library's warning is attributed to): what a command's libraries emit
EMITTED = [
    (FutureWarning, "transformers.modeling_utils"),  # e.g. `is_gradient_checkpointing` is deprecated (via peft)
    (DeprecationWarning, "torch.utils._pytree"),
    (UserWarning, "peft.tuners.lora"),
    (UserWarning, "cembed.model.load"),  # cembed's own: shown
]


def _validate_emitting(monkeypatch, write_config, pairs_file, tiny_model_dir, tmp_path, warnoptions):
    """``cembed validate`` in this process, its model load emitting :data:`EMITTED`; returns the
    warnings that got through, as ``(category name, module)``."""
    import cembed.model.load as load

    original = load.load_model

    def load_model(*args, **kwargs):
        for category, module in EMITTED:
            warnings.warn_explicit(f"{module} says so", category, f"{module}.py", 1, module=module)
        return original(*args, **kwargs)

    monkeypatch.setattr(load, "load_model", load_model)
    monkeypatch.setattr(sys, "warnoptions", warnoptions)
    config = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(32)))},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run")},
        }
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what an unfiltered process would print
        r = CliRunner().invoke(app, ["validate", str(config)])
    assert r.exit_code == 0, r.output
    return {(w.category.__name__, w.message.args[0].split(" says")[0]) for w in caught}


def test_the_command_line_shows_no_library_deprecation_note(
    monkeypatch, write_config, pairs_file, tiny_model_dir, tmp_path
):
    shown = _validate_emitting(monkeypatch, write_config, pairs_file, tiny_model_dir, tmp_path, [])
    assert shown == {("UserWarning", "cembed.model.load")}


def test_a_user_who_asks_for_warnings_gets_them(monkeypatch, write_config, pairs_file, tiny_model_dir, tmp_path):
    shown = _validate_emitting(monkeypatch, write_config, pairs_file, tiny_model_dir, tmp_path, ["default"])
    assert shown == {(c.__name__, m) for c, m in EMITTED}


def test_cembeds_own_code_leaves_the_warning_filters_alone():
    from cembed.model.load import quiet_libraries

    with warnings.catch_warnings():
        before = list(warnings.filters)
        quiet_libraries()
        assert warnings.filters == before


@pytest.mark.parametrize("warnoptions", [[], ["default"]])
def test_the_edge_filter_installs_only_without_the_users_own(monkeypatch, warnoptions):
    from cembed.cli.common import filter_library_warnings

    monkeypatch.setattr(sys, "warnoptions", warnoptions)
    with warnings.catch_warnings():
        warnings.resetwarnings()
        filter_library_warnings()
        installed = [
            (action, category.__name__, module and module.pattern)
            for action, _, category, module, _ in warnings.filters
        ]
    assert (
        installed == []
        if warnoptions
        else installed
        == [
            ("ignore", "UserWarning", r"(?!cembed(\.|$))"),
            ("ignore", "FutureWarning", None),
            ("ignore", "PendingDeprecationWarning", None),
            ("ignore", "DeprecationWarning", None),
        ]
    )
