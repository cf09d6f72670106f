"""When one rank of a job fails or hangs.

- :func:`collective_timeout_s`: recognise a collective that waited ``distributed.timeout_minutes``
  for a rank that never came (gloo's and NCCL's wording), so the failure is told as its cause in
  one line instead of a transport's message.
- :func:`announce_failure` / :func:`end_when_a_peer_fails`: a failing rank marks the process
  group's store; a rank that the launcher then signals while it holds the signal to finish its
  step (:class:`cembed.train.checkpoint.InterruptCallback`) ends at once when it sees the mark.
  Without it a rank hung mid-step (a stuck read, a deadlock) would outlive the launcher's SIGTERM
  until torchrun's SIGKILL, 30 s later: a step whose peer failed can never finish anyway.
"""

from __future__ import annotations

import os
import re
import threading
import time

FAILED_KEY = "cembed/failed"
_POLL_S = 0.2

# gloo: "Timed out waiting 6000ms for send operation to complete"; NCCL: "WorkNCCL(... Timeout(ms)=600000)"
_TIMEOUT_PATTERNS = (re.compile(r"Timed out waiting (\d+)\s*ms for (?:send|recv)"), re.compile(r"Timeout\(ms\)=(\d+)"))


def collective_timeout_s(err: BaseException) -> float | None:
    """The timeout in seconds if ``err`` is a collective that timed out waiting for another rank
    (torch's gloo or NCCL error), else None."""
    text = str(err)
    for pattern in _TIMEOUT_PATTERNS:
        match = pattern.search(text)
        if match:
            return int(match.group(1)) / 1000
    return None


def failed_key() -> str:
    """The store key of a failure in this attempt of the job: a group that torch's elastic agent
    restarts (``--max-restarts``) must not read the failure that ended the attempt before."""
    return f"{FAILED_KEY}/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store():
    """The initialized process group's key-value store, or None outside a multi-process job."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


def announce_failure() -> bool:
    """Mark this rank's failure in the process group's store (read by :func:`end_when_a_peer_fails`).

    Returns:
        Whether the mark was written; False without a multi-process group or when the store (the
        launcher's) cannot be reached, which is no reason to hide the rank's own error.
    """
    try:
        store = _store()
        if store is None:
            return False
        store.set(failed_key(), os.environ.get("RANK", "?"))
        return True
    except Exception:  # noqa: BLE001 - a store that is gone cannot be told; the error itself still shows
        return False


def _watch(store, key: str, exit_code: int) -> None:
    # check() returns at once: a blocking wait() would hold the store's connection, which the
    # main thread may still need to finish its step.
    while True:
        try:
            if store.check([key]):
                os._exit(exit_code)  # not sys.exit: it would only end this thread
        except Exception:  # noqa: BLE001 - the launcher's store is gone: it can no longer be asked
            return
        time.sleep(_POLL_S)


def end_when_a_peer_fails(exit_code: int) -> threading.Thread | None:
    """Start a daemon thread that ends this process with ``exit_code`` as soon as another rank has
    announced its failure (:func:`announce_failure`).

    For a rank holding a launcher's signal until its step ends: when a peer has failed, that step
    waits in a collective that can only time out, or never comes back at all. The thread does
    not need the main thread (which may be stuck) and only reads the store.

    Returns:
        The watching thread, or None outside a multi-process job.
    """
    store = _store()
    if store is None:
        return None
    thread = threading.Thread(
        target=_watch, args=(store, failed_key(), exit_code), name="cembed-peer-failed", daemon=True
    )
    thread.start()
    return thread
