"""cembed.plan.precision is the one place a precision name is turned into a dtype, an autocast or
the trainer's flags: it answers for every name, and no other module keeps its own map."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
import torch

from cembed.config.schema import ModelConfig
from cembed.plan import precision as P

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "fp32": (torch.float32, None, {"bf16": False, "fp16": False}),
    "bf16": (torch.bfloat16, torch.bfloat16, {"bf16": True, "fp16": False}),
    "fp16": (torch.float16, torch.float16, {"bf16": False, "fp16": True}),
}


@pytest.mark.parametrize("name", P.RUN_PRECISIONS)
def test_the_map_answers_dtype_autocast_and_flags_for_every_name(name):
    dtype, autocast, flags = EXPECTED[name]
    assert P.torch_dtype(name) is dtype and P.dtype_name(name) == str(dtype).removeprefix("torch.")
    assert P.autocast_dtype(name) is autocast and P.uses_autocast(name) is (autocast is not None)
    assert P.autocast_name(name) == (None if autocast is None else str(autocast).removeprefix("torch."))
    assert P.trainer_flags(name) == flags
    assert P.precision_from_flags(**flags) == name  # the trainer's flags lead back to the name
    assert P.save_dtype(name) == P.dtype_name(name) and P.save_dtype(None) is None


@pytest.mark.parametrize("name", P.RUN_PRECISIONS)
def test_autocast_context_runs_the_forward_in_the_precision(name):
    if name == "fp16":
        pytest.skip("CPU autocast to fp16 is not what training uses (fp16 needs CUDA)")
    x = torch.ones(2, 2)
    with P.autocast(name, "cpu"):
        assert (x @ x).dtype == EXPECTED[name][0]


def test_auto_and_unknown_names_are_refused_until_resolved():
    for bad in ("auto", "fp8", ""):
        with pytest.raises(ValueError, match="resolve auto first"):
            P.dtype_name(bad)
        with pytest.raises(ValueError):
            P.trainer_flags(bad)


def test_the_config_literals_are_the_precision_module_names():
    """config sits above plan (it cannot import the names), so the Literals are checked here."""
    fields = ModelConfig.model_fields
    assert typing.get_args(fields["precision"].annotation) == P.PRECISIONS
    save = [a for a in typing.get_args(fields["save_dtype"].annotation) if a is not type(None)]
    assert typing.get_args(save[0]) == P.RUN_PRECISIONS
    assert set(P.DTYPE_NAMES) == set(P.RUN_PRECISIONS) == set(P.PRECISIONS) - {"auto"}
    assert P.MASTER_DTYPE == "float32"  # bf16/fp16 are autocast over fp32 master weights


def _precision_maps(tree: ast.AST) -> list[int]:
    """Lines of dict literals keyed by two or more precision names (fp32/bf16/fp16), of
    ``torch.bfloat16`` / ``torch.float16`` references (a hand-written name -> dtype choice) and of
    comparisons with a precision name (``precision == "bf16"``, ``in ("bf16", "fp16")``: a flag map)."""
    names = set(P.RUN_PRECISIONS)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if len(keys & names) >= 2:
                found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in ("bfloat16", "float16"):
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append(node.lineno)
        elif isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(i, ast.Constant) and i.value in names for i in items):
                    found.append(node.lineno)
    return found


def test_no_module_outside_plan_precision_defines_a_precision_map():
    own = ROOT / "cembed" / "plan" / "precision.py"
    assert _precision_maps(ast.parse(own.read_text())), "the check must see the map it protects"
    allowed = {
        # the datasheet's peak TFLOP/s per part and matmul kind (tf32 too): a peak table, not a dtype map
        ("cembed/train/flops.py", "device_peak"),
    }
    offenders = []
    for path in sorted((ROOT / "cembed").rglob("*.py")):
        if path == own:
            continue
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT).as_posix()
        skip = set()
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and (rel, fn.name) in allowed:
                skip |= {n.lineno for n in ast.walk(fn) if hasattr(n, "lineno")}
        offenders += [f"{rel}:{line}" for line in _precision_maps(tree) if line not in skip]
    assert offenders == [], f"ask cembed.plan.precision instead: {offenders}"
