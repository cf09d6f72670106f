"""Property-based: any generated data rows and config mapping end in success or a clean exit-2
error, never a traceback."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cembed.cli.app import app

cell = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "   ", "\t", "same text"]),
    st.integers(-5, 5),
    st.floats(allow_nan=True),
    st.none(),
    st.lists(st.text(max_size=4), max_size=2),
    st.booleans(),
)
row = st.dictionaries(st.sampled_from(["anchor", "positive", "neg", "extra"]), cell, min_size=0, max_size=4)
scalar = st.one_of(
    st.integers(-3, 70000), st.floats(-1, 1e3, allow_nan=False), st.text(max_size=6), st.booleans(), st.none()
)
section = st.dictionaries(
    st.sampled_from(
        [
            "per_device_train_batch_size",
            "mini_batch_size",
            "learning_rate",
            "lr_scaling",
            "name",
            "max_steps",
            "device",
            "precision",
            "columns",
            "max_samples",
            "drop_invalid_rows",
            "bogus",
            "scale",
            "symmetric",
        ]
    ),
    st.one_of(
        scalar,
        st.lists(scalar, max_size=2),
        st.dictionaries(st.sampled_from(["anchor", "positive", "negatives", "x"]), scalar, max_size=2),
    ),
    max_size=3,
)
config = st.dictionaries(
    st.sampled_from(["model", "data", "batch", "optim", "loss", "sampler", "train", "extra"]),
    st.one_of(section, scalar),
    max_size=5,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rows=st.lists(row, min_size=0, max_size=12), cfg=config, keep_data_path=st.booleans())
def test_validate_never_crashes(rows, cfg, keep_data_path):
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        if keep_data_path:
            section = cfg.get("data") if isinstance(cfg.get("data"), dict) else {}
            cfg = {**cfg, "data": {**section, "train": str(data)}}
        path = Path(tmp) / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        r = CliRunner().invoke(app, ["validate", str(path)])
        assert r.exit_code in (0, 2), f"exit {r.exit_code}: {r.output}\n{r.exception!r}"
        assert "Traceback" not in r.output
        if r.exit_code == 2:
            assert r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) <= 4, r.output
