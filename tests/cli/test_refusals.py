"""Clear refusals instead of tracebacks on CUDA-only paths, simulated on CPU: bf16 on a GPU without
bf16, launchers that leave out LOCAL_RANK / LOCAL_WORLD_SIZE, a small /dev/shm with data-loader workers."""

from __future__ import annotations

import pytest
import torch

from cembed.config.schema import CembedConfig
from cembed.errors import UserError


def _cfg(**sections) -> CembedConfig:
    base = {"data": {"train": "pairs.jsonl"}, "batch": {"per_device_train_batch_size": 64}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return CembedConfig.model_validate(base)


def test_bf16_on_a_gpu_without_bf16_is_refused(monkeypatch):
    import cembed.plan.resolve as P

    monkeypatch.setattr(P, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-32GB")
    with pytest.raises(UserError, match=r"bf16 is not supported by this GPU \(Tesla V100.*7\.0.*fp16"):
        P.resolve_plan(_cfg(model={"precision": "bf16"}))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert P.resolve_plan(_cfg(model={"precision": "bf16"})).precision == "bf16"


def _fake_cuda_group(monkeypatch, visible: int):
    import torch.distributed as dist

    calls = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("set_device", i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.setdefault("backend", backend))
    return calls


def test_launcher_without_local_world_size(monkeypatch):
    """2 nodes x 8 GPUs started by a launcher that sets no LOCAL_WORLD_SIZE (srun with a hand-made
    environment): rank 9 is local rank 1 on its node, not a 16-process node."""
    from cembed.distributed.group import init_distributed

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    calls = _fake_cuda_group(monkeypatch, visible=8)
    assert init_distributed("cuda") == "cuda:1"
    assert calls == {"set_device": 1, "backend": "nccl"}
    monkeypatch.setenv("LOCAL_RANK", "8")
    with pytest.raises(UserError, match="LOCAL_RANK 8: only 8 CUDA device"):
        init_distributed("cuda")
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(UserError, match="LOCAL_RANK is not set, so every process would use GPU 0"):
        init_distributed("cuda")


def test_small_shm_with_workers_warns(monkeypatch, tmp_path):
    import shutil

    import cembed.plan.resolve as P

    small = shutil.disk_usage(tmp_path)._replace(total=64 * 1024**2)
    monkeypatch.setattr(P.shutil, "disk_usage", lambda path: small)
    warning = P.shm_warning(65536, 2, 256, workers=2)
    assert warning and "768 MiB" in warning and "3072 MiB of shared memory" in warning and "64 MiB" in warning
    assert "--shm-size=4g" in warning and "dataloader_num_workers: 0" in warning
    assert P.shm_warning(65536, 2, 256, workers=0) is None
    assert P.shm_warning(8, 2, 32, workers=2) is None
    plan = P.resolve_plan(
        _cfg(
            model={"max_seq_length": 256},
            batch={"per_device_train_batch_size": 65536},
            train={"dataloader_num_workers": 2},
        )
    )
    assert any("Bus error" in w for w in plan.warnings)


def test_user_error_text_with_brackets_prints_verbatim(capsys):
    """A message quoting a library's error (gloo: ``[/path/pair.cc:553] Connection closed``) is
    printed as text, not read as rich markup (a closing tag there raised MarkupError: a traceback)."""
    import typer

    from cembed.cli.common import user_errors
    from cembed.errors import UserError

    message = "run failed: RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:553] Connection closed [bold]x"

    @user_errors
    def fails():
        raise UserError(message)

    with pytest.raises(typer.Exit) as stop:
        fails()
    assert stop.value.exit_code == 2
    assert message in " ".join(capsys.readouterr().err.split())
