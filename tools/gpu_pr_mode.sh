#!/usr/bin/env bash
# PR mode on a GPU, in one call (device time is scarce): a clean run of the release, then, right
# after on the same machine, a breaking change to the EAGLE head's compiled forward (vLLM's
# defaults: torch.compile and CUDA graphs), then a harmless one. The kit keys vLLM's compile caches
# by the vLLM under test, so the change is what runs (without that, a cache of the clean run's
# graph once served the unchanged head: acceptance as before, PASS).
# Usage: tools/gpu_pr_mode.sh OUT_DIR [breaking|comment|all]   (records and tables in OUT_DIR;
# the steps can go in separate calls where one call's time is limited)
set -uo pipefail
out=$1 step=${2:-all}
breakages=validate/data/breakages
if [ "$step" != comment ]; then
python3 -m validate compare --profile tiny-cuda --tp 1 \
  --vllm-patch "$breakages/head-input-order.patch" --run-dir runs/gpu-compare-breaking \
  2>&1 | tee "$out/compare-breaking.txt"
echo "compare (breaking) exit: ${PIPESTATUS[0]}" | tee -a "$out/compare-breaking.txt"
fi
if [ "$step" != breaking ]; then
python3 -m validate compare --profile tiny-cuda --tp 1 \
  --vllm-patch "$breakages/comment-only.patch" \
  --baseline-golden runs/gpu-compare-breaking/golden.json --run-dir runs/gpu-compare-comment \
  2>&1 | tee "$out/compare-comment.txt"
echo "compare (comment) exit: ${PIPESTATUS[0]}" | tee -a "$out/compare-comment.txt"
fi
tar -czf "$out/records-$step.tgz" runs/gpu-compare-*/*/record.json runs/gpu-compare-*/*/summary.md \
  runs/gpu-compare-*/compare.* runs/gpu-compare-*/*.log 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.csv" 2>&1
