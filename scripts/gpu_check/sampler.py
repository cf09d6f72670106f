"""GPU utilisation sampled in a thread while a stage runs (the GPU check's (e)).

Standard library only (tests/test_gpu_check.py asserts it): nvidia-ml-py is imported when present,
else ``nvidia-smi`` is called.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time


class GpuSampler:
    """Samples GPU utilisation (%) and memory used every ``period`` s in a thread, through
    nvidia-ml-py (``pynvml``) or, without it, ``nvidia-smi``."""

    def __init__(self, period: float = 0.25) -> None:
        self.period, self.samples, self.source = period, [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.source = "nvidia-ml-py"

            def read():
                u = pynvml.nvmlDeviceGetUtilizationRates(handle)
                return u.gpu, pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30

            return read
        except Exception:
            if shutil.which("nvidia-smi") is None:
                return None
            self.source = "nvidia-smi"

            def read():
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--id=0",
                        "--query-gpu=utilization.gpu,memory.used",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.split(",")
                return float(out[0]), float(out[1]) / 1024

            return read

    def _run(self) -> None:
        read = self._reader()
        while read is not None and not self._stop.is_set():
            try:
                self.samples.append((time.time(), *read()))
            except Exception:
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def stats(self) -> dict:
        util = [s[1] for s in self.samples]
        if not util:
            return {"source": self.source, "samples": 0}
        return {
            "source": self.source,
            "samples": len(util),
            "mean_pct": round(statistics.fmean(util), 1),
            "median_pct": statistics.median(util),
            "min_pct": min(util),
            "share_ge_90pct": round(sum(u >= 90 for u in util) / len(util), 3),
            "max_mem_gib": round(max(s[2] for s in self.samples), 2),
        }
