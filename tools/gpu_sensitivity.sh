#!/usr/bin/env bash
# The sensitivity suite's acceptance-rule breakages on one GPU (tiny-cuda, vLLM's defaults:
# torch.compile + CUDA graphs), with the comment-only control: the unpatched release first (live
# reference, its record becomes the golden), then each breakage against it.
# Device calls are limited to 10 minutes and the suite takes longer, so it runs detached:
#   setsid nohup tools/gpu_sensitivity.sh DIR >/dev/null 2>&1 &   # then poll DIR/suite.log
# DIR gets suite.log, the suite's folder (sensitivity.md/.json, each run's record) and records.tgz.
set -uo pipefail
dir=$1
# shellcheck source=tools/snapshot.sh
source "$(dirname "$0")/snapshot.sh"  # from here on in a copy of the tree
python3 -m validate sensitivity --profile tiny-cuda --tp 1 --run-dir "$dir/suite" \
  --only accept-second-choice --only verify-shifted-logits --only rejected-draft-kept \
  --only draft-from-rejected --only comment-only > "$dir/suite.log" 2>&1
echo "sensitivity exit: $?" >> "$dir/suite.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$dir/nvidia-smi.csv" 2>&1
tar -czf "$dir/records.tgz" -C "$dir" suite/sensitivity.md suite/sensitivity.json \
  suite/golden.json suite/release/record.json $(cd "$dir" && ls suite/*/record.json suite/*/summary.md suite/*.log 2>/dev/null)
touch "$dir/done"
