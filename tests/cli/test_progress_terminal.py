"""``cembed train`` at a real terminal (a pseudo-terminal, so rich draws its live progress bar as it
does for a person): the ETA from the first step, the current loss and LR, Ctrl-C acknowledged at
once and the run ending with a checkpoint, then a resume that says where it continues and whose bar
starts there, and a second Ctrl-C that abandons at once.

Driven with the standard library's ``pty`` (pexpect is not installed in the project's venv). The
steps are slowed to ~0.5 s by a callback added in the child (``SLOW_STEPS``), so that a person's
keystroke lands inside a step, as it does in a real run whose steps take minutes.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import sys
import textwrap
import threading
import time

import pytest
from conftest import REPO

from cembed.train.checkpoint import MARKER

pytestmark = [
    pytest.mark.slow,  # trains in a subprocess at a pseudo-terminal
    pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal"),
]

MAX_STEPS = 8
BATCH = 8

# `cembed train ARGS` with every optimizer step slowed by a sleep before it (CEMBED_TEST_STEP_S, default 0.5 s).
SLOW_STEPS = textwrap.dedent(
    """
    import os, sys, time
    from transformers import TrainerCallback
    import cembed.train.recipe as T

    class Slow(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            time.sleep(float(os.environ.get("CEMBED_TEST_STEP_S", "0.5")))

    build = T.build_trainer
    def build_trainer(*args, **kwargs):
        run = build(*args, **kwargs)
        run.trainer.add_callback(Slow())
        return run

    T.build_trainer = build_trainer
    from cembed.cli.app import main
    sys.argv = ["cembed", "train", *sys.argv[1:]]
    main()
    """
)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][A-Za-z0-9]")
# The progress bar as drawn: "train ━━━━ 3/8  loss 1.9587  lr 7.14e-04  21.2 samples/s  eta 0:00:02"
BAR = re.compile(
    r"train\s+\S*\s*(?P<step>\d+)/(?P<total>\d+)\s+loss (?P<loss>\S+)\s+lr (?P<lr>\S+)\s+"
    r"(?P<rate>\S+) samples/s\s+(?:eta )?(?P<eta>\d+:\d\d:\d\d|-:--:--|\S+)"
)


class Terminal:
    """A child process on a pseudo-terminal (160 x 40): what it draws, as text without escape codes."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal (Ctrl-C -> SIGINT)
            os.chdir(REPO)
            os.execve(argv[0], argv, env)
        self.raw = bytearray()
        self.lock = threading.Lock()
        self.returncode: int | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            with self.lock:
                self.raw += chunk

    def text(self) -> str:
        with self.lock:
            raw = self.raw.decode("utf-8", "replace")
        return ANSI.sub("", raw)

    def lines(self) -> list[str]:
        return [line for line in re.split(r"[\r\n]+", self.text()) if line.strip()]

    def bars(self) -> list[re.Match]:
        return [m for m in map(BAR.search, self.lines()) if m]

    def expect(self, pattern: str, timeout: float) -> re.Match:
        """Wait until ``pattern`` appears in the text; fail with the screen after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.text())
            if found:
                return found
            if time.monotonic() > deadline or (not self.reader.is_alive() and not re.search(pattern, self.text())):
                pytest.fail(f"{pattern!r} not on the terminal within {timeout:.0f}s:\n{self.screen()}")
            time.sleep(0.05)

    def expect_bar(self, predicate, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for m in self.bars() if predicate(m)]
            if found:
                return found[0]
            if not self.reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"no matching progress bar within {timeout:.0f}s:\n{self.screen()}")

    def ctrl_c(self) -> float:
        os.write(self.fd, b"\x03")  # the terminal turns it into SIGINT for the foreground process
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.reader.join(5)
                self.returncode = os.waitstatus_to_exitcode(status)
                return self.returncode
            time.sleep(0.05)
        pytest.fail(f"still running after {timeout:.0f}s:\n{self.screen()}")

    def screen(self, last: int = 40) -> str:
        return "\n".join(self.lines()[-last:])

    def close(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


@pytest.fixture
def terminal():
    opened: list[Terminal] = []
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "40"}
    env.pop("NO_COLOR", None)

    def start(*args: str) -> Terminal:
        t = Terminal([sys.executable, "-c", SLOW_STEPS, *args], env)
        opened.append(t)
        return t

    yield start
    for t in opened:
        t.close()


def _config(write_config, tiny_model_dir, tmp_path):
    rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(96)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu", "max_seq_length": 16},
            "data": {"train": str(tmp_path / "pairs.jsonl"), "pretokenize": False},
            "batch": {"per_device_train_batch_size": BATCH, "mini_batch_size": 4},
            "optim": {"learning_rate": 1e-3, "base_batch_size": BATCH},
            # logging every 4 steps: the bar must still show each step's loss and LR
            "train": {"max_steps": MAX_STEPS, "logging_steps": 4, "output_dir": str(tmp_path / "out"), "seed": 5},
        }
    )


def test_progress_interrupt_and_resume_at_a_terminal(terminal, write_config, tiny_model_dir, tmp_path):
    config = _config(write_config, tiny_model_dir, tmp_path)
    out = tmp_path / "out"

    # --- a fresh run: ETA from step 1, each step's loss and LR, then one Ctrl-C -----------------
    run = terminal(str(config))
    step3 = run.expect_bar(lambda m: int(m["step"]) >= 3, timeout=180)
    assert step3["total"] == str(MAX_STEPS)
    by_step = {int(m["step"]): m for m in run.bars()}  # the last drawing of each step
    first = by_step[1]
    assert re.fullmatch(r"\d+:\d\d:\d\d", first["eta"]), f"no ETA after step 1: {first.group(0)!r}"
    assert [by_step[s]["loss"] for s in (1, 2, 3)] != [first["loss"]] * 3, "loss not updated each step"
    assert len({by_step[s]["lr"] for s in (1, 2, 3)}) == 3, (
        f"lr not updated each step: {[by_step[s]['lr'] for s in (1, 2, 3)]}"
    )
    sent = run.ctrl_c()
    ack = run.expect(r"finishing step (\d+), then saving.*Ctrl-C again to abandon", timeout=5)
    assert time.monotonic() - sent < 5
    k = int(ack[1])
    assert 3 < k < MAX_STEPS
    run.expect(rf"interrupted by SIGINT at step {k}: checkpoint saved to \S*checkpoint-{k}", timeout=60)
    run.expect(r"resume with: cembed train \S+ --resume", timeout=10)
    assert run.wait(30) == 128 + signal.SIGINT
    assert (out / f"checkpoint-{k}" / MARKER).is_file()

    # --- the resume: says where it continues, the bar starts there; two Ctrl-C abandon at once ---
    resumed = terminal(str(config), "--resume")
    resumed.expect(rf"resuming from \S*checkpoint-{k} at step {k} of {MAX_STEPS}", timeout=180)
    bar = resumed.expect_bar(lambda m: True, timeout=60)
    assert int(bar["step"]) == k, f"the resumed bar starts at {bar['step']}/{bar['total']}, not {k}"
    resumed.expect_bar(lambda m: int(m["step"]) == k + 1, timeout=30)
    resumed.ctrl_c()
    resumed.expect(r"finishing step \d+, then saving", timeout=5)
    sent = resumed.ctrl_c()
    abandoned = resumed.expect(r"abandoned step (\d+) \(Ctrl-C again\): not saved", timeout=5)
    assert resumed.wait(10) == 128 + signal.SIGINT
    assert time.monotonic() - sent < 10
    # \s+ before the path: a long tmp path (pytest-xdist adds a folder) wraps at the terminal's width
    resumed.expect(rf"last complete checkpoint is\s+\S*checkpoint-{k}\s+resume with: cembed train", timeout=1)
    assert f"abandoned: second SIGINT during step {abandoned[1]}" in (out / "train.log").read_text()
