#!/usr/bin/env bash
# The one-call GPU verification of cembed (issue 14; stage budgets sum under a 570 s deadline). Runs the folder
# scripts/gpu_check/ as a program (its __main__.py, standard library only): each stage (stages.py, the
# one module that imports cembed) in its own process with a timeout, then one JSON with a pass/fail
# status per stage and (a) bf16 cached vs fp32 plain loss/gradient + dropout replay on the GPU,
# (b) probe-minibatch at 256 tokens, batch 65536, (c) tokens/s, MFU, data-wait, padded share at
# batch 65536 on COCO pairs, (d) stock sentence-transformers' step on the same batch and the ratio,
# (e) GPU utilisation sampled during (c) and (d), (f) estimate --calibrate vs the real run's wall time;
# (g) per attention implementation, packed rows vs rows alone and packed vs padded step (issue 34; alone:
#     --stages install,env,attention); (h) the cached MaxSim loss: tiled vs fused kernel (if present) vs
#     stock (issue 40; alone: --stages install,env,maxsim); plus issue 13's CUDA-only checks.
#
#   bash scripts/gpu_check.sh                     # in an environment where cembed is installed
#   bash scripts/gpu_check.sh --bundle DIR        # offline: install the bundle made by gpu_bundle.sh
#   bash scripts/gpu_check.sh --dry-run [--bundle DIR]   # the plan and the bundle check, no CUDA
#   bash scripts/gpu_check.sh --device cpu --quick       # the same stages on CPU, small sizes (CI)
#   options: --out DIR (fresh run folder) --stages a,b --deadline S --batch N --seq N --steps N
# Every run writes to a new folder under /tmp/cembed-gpu-check, so runs never trip on each other.
# env: PYTHON (the interpreter; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
exec "${PYTHON:-python3}" scripts/gpu_check "$@"
