"""cembed.files: atomic writes honour the umask; user messages show paths relative where shorter."""

from __future__ import annotations

import os
import stat

import pytest

from cembed.files import display_path, write_json_atomic


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_write_gets_the_umask_mode(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = write_json_atomic(tmp_path / "run_summary.json", {"status": "completed"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode  # mkstemp alone gives 0o600 whatever the umask


def test_display_path_relative_inside_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path / "runs")
    assert display_path(tmp_path / "runs" / "demo" / "run_summary.json") == os.path.join("demo", "run_summary.json")
    assert display_path(tmp_path / "x.jsonl") == str(tmp_path / "x.jsonl")  # outside: never "../x.jsonl"
    assert display_path("/") == "/"
    assert display_path("data/x.jsonl") == "data/x.jsonl"  # already relative: unchanged


def test_saved_model_files_get_the_umask_mode_whatever_the_library_wrote(tmp_path):
    from cembed.files import save_model_atomic

    class Model:  # writes its weights the way transformers does: a private mkstemp file, renamed
        def save_pretrained(self, folder):
            import tempfile

            os.makedirs(os.path.join(folder, "1_Pooling"))
            fd, tmp = tempfile.mkstemp(dir=folder)
            os.write(fd, b"weights")
            os.close(fd)
            os.replace(tmp, os.path.join(folder, "model.safetensors"))
            with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
                f.write("{}")

    old = os.umask(0o022)
    try:
        out = save_model_atomic(Model(), tmp_path / "run")
    finally:
        os.umask(old)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644  # not 0o600
    assert stat.S_IMODE((out / "1_Pooling").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "1_Pooling" / "config.json").stat().st_mode) == 0o644


def test_file_lock_is_exclusive_and_runs_unlocked_where_refused(tmp_path, monkeypatch):
    """The one lock of the folder writers: held -> True (another holder cannot take it); no fcntl, or
    a file system that refuses locks -> the block still runs, told False."""
    import builtins
    import fcntl

    from cembed.files import file_lock

    path = tmp_path / ".lock"
    with file_lock(path) as held:
        assert held is True
        with open(path, "a") as other:  # another open file description: flock excludes it
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path, "a") as other:  # released at the end of the block
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)

    def refuse(handle, op):
        raise OSError(37, "No locks available")  # ENOLCK

    monkeypatch.setattr(fcntl, "flock", refuse)
    with file_lock(path) as held:
        assert held is False
    monkeypatch.undo()
    real_import = builtins.__import__

    def no_fcntl(name, *args, **kwargs):
        if name == "fcntl":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fcntl)
    with file_lock(tmp_path / "other.lock") as held:
        assert held is False
    assert not (tmp_path / "other.lock").exists()
