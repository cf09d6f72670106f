"""Quiet libraries (issue 32 item 6): no library's deprecation note or warning reaches the terminal
on the normal path, and a Ctrl-C is announced once, not once more by every data-loader worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, distinct_pairs

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _config(write_config, model_dir, tmp_path, **train) -> str:
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(400)))
    return write_config(
        {
            "model": {"name_or_path": str(model_dir), "device": "cpu"},
            "data": {"train": str(data)},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "out"), "max_steps": 20, **train},
        }
    )


@pytest.mark.slow
def test_estimate_prints_no_library_warning(write_config, tiny_model_dir, tmp_path):
    # It printed sentence-transformers' "The `tokenize` method is deprecated, please use `preprocess`
    # instead." (the packing check tokenized its probe texts with the deprecated method).
    path = _config(write_config, tiny_model_dir, tmp_path)
    cmd = [sys.executable, "-m", "cembed", "estimate", str(path), "--gpu", "H100-SXM"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr
    assert "deprecat" not in (r.stdout + r.stderr).lower() and r.stderr == "", r.stderr
    assert "estimate for 1 x H100-SXM" in r.stdout


def test_a_data_loader_worker_neither_announces_nor_stops_on_ctrl_c():
    """A worker forked while the handler is installed inherits it: there SIGINT and SIGTERM are
    ignored (the main process announces them, stops the run and ends its workers; a scheduler's
    SIGTERM reaches every process of the job, and a worker it ended would fail the step)."""
    from cembed.train.checkpoint import InterruptCallback

    seen = []
    callback = InterruptCallback(lambda signum, step: seen.append((os.getpid(), signum)))
    callback.install()
    try:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the worker: Ctrl-C reaches it too
            try:
                os.kill(os.getpid(), signal.SIGINT)
                notice = callback.notice
                if notice is not None:
                    notice.join()
                os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's SIGTERM to every process: ignored too
                os.write(write, json.dumps([callback.signum, len(seen)]).encode())
            finally:
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(child, 0)
        assert json.loads(os.read(read, 100)) == [None, 0]  # no announcement, no stop requested
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0  # the worker lived on through both
        os.kill(os.getpid(), signal.SIGINT)  # the main process: announced once
        callback.notice.join()
        assert seen == [(os.getpid(), signal.SIGINT)] and callback.signum == signal.SIGINT
    finally:
        callback.uninstall()


# Ctrl-C as a terminal sends it, at the end of step 2: SIGINT to the whole process group, the
# data-loader workers included.
CTRL_C_AT_STEP_2 = textwrap.dedent(
    """
    import os, signal, sys
    from cembed.cli.app import main
    import cembed.train.recipe as T

    class CtrlCAtStep2(T.InterruptCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2 and self.signum is None:
                os.killpg(os.getpgid(0), signal.SIGINT)
            return super().on_step_end(args, state, control, **kw)

    T.InterruptCallback = CtrlCAtStep2
    sys.argv = ["cembed", "train", sys.argv[1]]
    main()
    """
)


@pytest.mark.slow
def test_ctrl_c_is_announced_once_with_data_loader_workers(write_config, tiny_model_dir, tmp_path):
    path = _config(write_config, tiny_model_dir, tmp_path, dataloader_num_workers=2, save_steps=100)
    r = subprocess.run(
        [sys.executable, "-c", CTRL_C_AT_STEP_2, str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        start_new_session=True,  # its own process group: the Ctrl-C reaches it and its workers only
    )
    assert r.returncode == 130, r.stdout[-2000:] + r.stderr[-3000:]
    notices = [line for line in r.stdout.splitlines() if line.startswith("Ctrl-C:")]
    assert notices == ["Ctrl-C: finishing step 2, then saving a checkpoint; Ctrl-C again to abandon"], r.stdout
    assert r.stderr.splitlines() == [
        "interrupted by SIGINT at step 2: checkpoint saved to " + str(tmp_path / "out" / "checkpoint-2"),
        f"resume with: cembed train {path} --resume",
    ], r.stderr


# Ctrl-C while a tokenizer process of `datasets.map(num_proc=2)` works on its first batch: SIGINT to
# the whole process group (a terminal sends it so), the tokenizer processes included.
CTRL_C_WHILE_TOKENIZING = textwrap.dedent(
    """
    import os, signal, sys, time
    from cembed.cli.app import main
    import cembed.data.tokens.encode as encode  # the tokenizing map

    MAIN, FLAG, tokenize_batch = os.getpid(), sys.argv[3], encode._tokenize_batch

    def ctrl_c_in_a_worker(*args, **kwargs):
        if os.getpid() != MAIN:
            try:
                os.close(os.open(FLAG, os.O_CREAT | os.O_EXCL))  # the first worker here sends it, once
            except FileExistsError:
                pass
            else:
                os.killpg(os.getpgid(0), signal.SIGINT)
                time.sleep(1)
        return tokenize_batch(*args, **kwargs)

    encode._tokenize_batch = ctrl_c_in_a_worker
    sys.argv = ["cembed", "prepare-data", sys.argv[1], "--output", sys.argv[2]]
    main()
    """
)


@pytest.mark.slow
def test_ctrl_c_while_tokenizing_in_worker_processes_prints_no_traceback(write_config, tiny_model_dir, tmp_path):
    # It printed a worker's KeyboardInterrupt traceback, then the main process's, ending in datasets'
    # multiprocess TimeoutError (exit 1).
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(20_000)))
    path = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(data), "num_proc": 2},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        }
    )
    out = tmp_path / "prepared"
    r = subprocess.run(
        [sys.executable, "-c", CTRL_C_WHILE_TOKENIZING, str(path), str(out), str(tmp_path / "sent")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        start_new_session=True,
    )
    assert (tmp_path / "sent").exists()  # the Ctrl-C was sent while tokenizing
    assert r.returncode == 130, r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-4000:]
    assert not out.exists() or not any(out.iterdir())  # nothing half-written is left as the output
