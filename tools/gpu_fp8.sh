#!/usr/bin/env bash
# tiny-fp8 on one GPU (vLLM 0.25.0's defaults: torch.compile + CUDA graphs): the pair and its FP8
# target generated on the GPU host, a golden calibrated from 3 runs, a clean run judged by it
# (live reference), then each quantized-path breakage of the sensitivity catalogue against it.
# Device calls are limited to 10 minutes and this takes longer, so it runs detached:
#   setsid nohup tools/gpu_fp8.sh DIR >/dev/null 2>&1 &   # then poll DIR/steps.log
# DIR gets steps.log, each step's log, the golden, each run's record.json and summary.md.
# The host needs loguru beside the gpu-wheels parts (compressed-tensors imports it; vLLM reads an
# FP8 compressed-tensors checkpoint through it): `pip download loguru -d .whl/extra` here, carry
# .whl/extra, and `pip install --no-index --no-deps --target /tmp/site .whl/extra/*.whl` there.
set -uo pipefail
dir=$1
mkdir -p "$dir"
# Each device call lays the working tree anew: run from a copy, so a poll cannot change the code
# under a run.
rm -rf /root/kit-snapshot && mkdir -p /root/kit-snapshot
tar --exclude=./.whl --exclude=./.git --exclude=./runs -cf - . | tar -xf - -C /root/kit-snapshot
cd /root/kit-snapshot || exit 1
export VALIDATE_CACHE=${VALIDATE_CACHE:-/root/kit-cache}
step() {  # step NAME COMMAND...: run it, log it, keep its record
  local name=$1; shift
  echo "$(date -u +%T) start $name: $*" >> "$dir/steps.log"
  "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  echo "$(date -u +%T) end $name: exit $rc" >> "$dir/steps.log"
  for rec in runs/"$name"/record.json runs/"$name"/*/record.json; do
    [ -f "$rec" ] || continue
    sub=$(dirname "${rec#runs/}"); mkdir -p "$dir/$sub"
    cp "$(dirname "$rec")"/summary.md "$dir/$sub/" 2>/dev/null
    python3 -c "import json,sys;r=json.load(open(sys.argv[1]));[r.pop(k,None) for k in ('outputs','reference_outputs','raw_counters')];json.dump(r,open(sys.argv[2],'w'),indent=1)" "$rec" "$dir/$sub/record.json"
  done
}
gpu=$(python3 -c 'import torch;print(torch.cuda.get_device_name(0).lower().split()[-1])')
golden="$dir/tiny-fp8-$gpu-tp1.json"
step quantize python3 -m validate.quantize
step cal-fp8 python3 -m validate calibrate --profile tiny-fp8 --tp 1 --runs 3 --run-dir runs/cal-fp8 --out "$golden"
step fp8-clean python3 -m validate rehearse --profile tiny-fp8 --tp 1 --golden "$golden" --run-dir runs/fp8-clean
for b in draft-target-quant-config fp8-moe-shard-scales-swapped; do
  step "fp8-$b" python3 -m validate rehearse --profile tiny-fp8 --tp 1 --golden "$golden" \
    --reference golden --vllm-patch "validate/data/breakages/$b.patch" --run-dir "runs/fp8-$b"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$dir/nvidia-smi.csv" 2>&1
touch "$dir/done"
