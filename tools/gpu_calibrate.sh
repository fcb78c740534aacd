#!/usr/bin/env bash
# Calibrate tiny-cuda on one GPU and judge the random head against the new golden, in one call
# (device time is scarce: engine start-up dominates, and the compile cache is warm after run 1).
# Usage: VALIDATE_CACHE=<folder holding tiny-pair/<fingerprint>> tools/gpu_calibrate.sh OUT_DIR [RUNS]
set -uo pipefail
out=$1 runs=${2:-3}
golden="$out/tiny-cuda-$(python3 -c 'import torch;from validate.device_class import of_gpu_name as f;print(f(torch.cuda.get_device_name(0)))')-tp1.json"
python3 -m validate calibrate --profile tiny-cuda --tp 1 --runs "$runs" \
  --run-dir runs/cal-cuda --out "$golden"
echo "calibrate exit: $?"
python3 -m validate rehearse --profile tiny-cuda --tp 1 --head random --golden "$golden" \
  --reference golden --run-dir runs/cuda-random
echo "random head exit: $?"
tar -czf "$out/records.tgz" runs/cal-cuda/*/record.json runs/cal-cuda/*/summary.md \
  runs/cuda-random/record.json runs/cuda-random/summary.md 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.csv" 2>&1
