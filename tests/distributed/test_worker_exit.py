"""How a launched worker ends: ``exit_worker`` leaves with the given code, output flushed, without
interpreter finalization (where gloo's threads could abort a finished run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # each test starts a Python worker process

WORKER_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in WORKER_ENV}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=120
    )


def test_exit_worker_flushes_output_and_keeps_the_code():
    # stdout to a pipe is block-buffered: without the flush, os._exit would drop "partial line"
    r = _run(
        "from cembed.distributed.group import exit_worker\n"
        "import atexit; atexit.register(lambda: print('finalized'))\n"
        "print('partial line', end='')\nexit_worker(3)\nprint('not reached')",
        WORKER_ENV,
    )
    assert (r.returncode, r.stdout) == (3, "partial line"), r.stderr


def test_exit_worker_is_a_no_op_outside_a_launched_job():
    r = _run("from cembed.distributed.group import exit_worker\nexit_worker(3)\nprint('went on')", {})
    assert (r.returncode, r.stdout.strip()) == (0, "went on"), r.stderr


@pytest.mark.parametrize(
    ("argv", "code", "shown"),
    [(["--version"], 0, "cembed"), (["suggest-lr", "--base-lr", "-1", "--base-bs", "32", "--bs", "64"], 2, "")],
)
def test_a_launched_worker_ends_every_command_through_exit_worker(argv, code, shown):
    """The CLI's entry point in a launched worker: the command's own exit code (0, or 2 for a user
    mistake), its output flushed, and no interpreter finalization (the atexit hook never runs)."""
    r = _run(
        "import atexit, sys\n"
        "atexit.register(lambda: print('finalized'))\n"
        f"sys.argv = ['cembed', *{argv!r}]\n"
        "from cembed.cli.app import main\n"
        "main()",
        WORKER_ENV,
    )
    assert r.returncode == code, r.stdout + r.stderr
    assert shown in r.stdout and "finalized" not in r.stdout, r.stdout
