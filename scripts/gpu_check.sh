#!/usr/bin/env bash
# The device check (one command, a few minutes): the engine tests on the GPU machine, then
# scripts/gpu_check.py's one JSON line (spd == ar in fp32 on CUDA; fly vs ar at batch 1 and 8).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
FLY_TEST_DEVICE=cuda timeout 240 python -m pytest -q -x -m "not serve and not real" tests/test_engine.py
timeout 300 python scripts/gpu_check.py "$@"
