"""A failing or hung peer: the collective timeout told as its cause, and the failure mark that ends
a rank holding the launcher's SIGTERM (cembed.distributed.peers). The whole job is
tests/distributed/test_collective_timeout.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO

from cembed.distributed.peers import announce_failure, collective_timeout_s, end_when_a_peer_fails

GLOO_SEND = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 6000ms "
    "for send operation to complete"
)
GLOO_RECV = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete"
NCCL = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=600000) ran for 600081 milliseconds before timing out."
)


@pytest.mark.parametrize(
    ("message", "seconds"),
    [(GLOO_SEND, 6.0), (GLOO_RECV, 1800.0), (NCCL, 600.0), ("Connection closed by peer [127.0.0.1]:1234", None)],
)
def test_collective_timeout_is_recognised_with_its_seconds(message, seconds):
    assert collective_timeout_s(RuntimeError(message)) == seconds


def test_without_a_process_group_nothing_is_announced_or_watched():
    assert announce_failure() is False
    assert end_when_a_peer_fails(143) is None


# A store the test controls in place of the process group's: the watcher must end the process with
# the given code once the mark is set, while the main thread is busy (sleeping) and never returns;
# the failure that ended the attempt before the launcher's restart (attempt 0) does not count.
WATCHED = """
import time, torch.distributed as dist
from cembed.distributed import peers
store = dist.HashStore()
store.set("cembed/failed/attempt0", "1")
peers._store = lambda: store
peers.end_when_a_peer_fails(143)
time.sleep(1)
print("still running", flush=True)
assert peers.announce_failure()
time.sleep(60)
print("not reached", flush=True)
"""


@pytest.mark.slow  # starts a Python process
def test_a_watched_rank_ends_with_its_code_once_a_peer_announces_failure():
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", WATCHED], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert (r.returncode, r.stdout) == (143, "still running\n"), r.stderr
    assert took < 50, took  # not the 60 s sleep: the watcher ended it
