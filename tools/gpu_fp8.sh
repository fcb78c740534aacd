#!/usr/bin/env bash
# The FP8 targets on one GPU (vLLM 0.25.0's defaults: torch.compile + CUDA graphs), in one go,
# and tiny-cuda's serving bench (step bench-cuda: the full sweep, 3 repeats, the plot; vLLM's
# OpenAI server needs uvicorn, python-multipart, model-hosting-container-standards, jmespath and
# supervisor beside loguru in .whl/extra: docs/evidence/gpu-bench/README.md):
#   tiny-fp8 (Maverick's format): a clean run judged by its committed golden (calibrated again
#     only if this host's pair has other weights), each quantized-path breakage against it,
#     `compare` against that golden (a breakage: REGRESSION; a comment-only change: OK);
#   tiny-fp8-attn (attention FP8 too): a golden from 3 runs, a clean run judged by it, the q/k
#     scale breakage against it, and the same breakage on tiny-fp8 (no FP8 attention: must PASS).
# Device calls are limited to 10 minutes and this takes longer, so it runs detached:
#   setsid nohup tools/gpu_fp8.sh DIR >/dev/null 2>&1 &   # then poll DIR/steps.log
# DIR gets steps.log, each step's log, the new golden, each run's record.json and summary.md.
# The steps run in the order of what #23 needs most: the tiny-fp8 breakages and `compare` first,
# then the FP8-attention variant's golden and its breakage, then the clean and control runs; a
# device machine lost midway (30 minutes at most) still leaves the first steps' records in DIR.
# STEPS="name name ..." runs only those steps (steps whose evidence is already committed can be
# left out).
# The host needs loguru beside the gpu-wheels parts (compressed-tensors imports it; vLLM reads an
# FP8 compressed-tensors checkpoint through it): `pip download loguru -d .whl/extra` here, carry
# .whl/extra, and `pip install --no-index --no-deps --target /tmp/site .whl/extra/*.whl` there.
set -uo pipefail
dir=$1
# shellcheck source=tools/snapshot.sh
source "$(dirname "$0")/snapshot.sh"  # from here on in a copy of the tree
export VALIDATE_CACHE=${VALIDATE_CACHE:-/root/kit-cache}
# The card's clocks, power and load once a second for the whole run (read only: the card's
# settings are left as found): where a bench point's repeats differ, this says whether the card
# changed pace.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
  --format=csv -l 1 > "$dir/gpu-clocks.csv" 2>&1 &
clocks=$!
trap 'kill $clocks 2>/dev/null' EXIT
step() {  # step NAME COMMAND...: run it, log it, keep its records
  local name=$1; shift
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
    echo "$(date -u +%T) skip $name" >> "$dir/steps.log"; return 0
  fi
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
  cp runs/"$name"/compare.md runs/"$name"/*.png runs/"$name"/sensitivity.* runs/"$name"/bench/*-host-probe.txt \
    "$dir/$name/" 2>/dev/null
  return $rc
}
b=validate/data/breakages
gpu=$(python3 -c 'import torch;from validate.device_class import of_gpu_name as f;print(f(torch.cuda.get_device_name(0)))')
fp8=validate/data/goldens/tiny-fp8-$gpu-tp1.json
attn="$dir/tiny-fp8-attn-$gpu-tp1.json"
step quantize python3 -m validate.quantize --variant target-fp8
step quantize-attn python3 -m validate.quantize --variant target-fp8-attn
# tiny-fp8-attn without a golden (any card): the sensitivity suite's own (its clean run, live
# reference, must PASS; then the q/k scale and the MoE scale breakages against it): 4 engine
# starts instead of calibrate's 6 and two judged runs
step sens-attn python3 -m validate sensitivity --profile tiny-fp8-attn --tp 1 \
  --only fp8-qk-scales-not-permuted --only fp8-moe-shard-scales-swapped --run-dir runs/sens-attn
# BENCH_ARGS: more options for it (a shorter sweep: --concurrency 1,4)
# shellcheck disable=SC2086
step bench-cuda python3 -m validate bench --profile tiny-cuda --tp 1 --run-dir runs/bench-cuda ${BENCH_ARGS:-}
step fp8-clean python3 -m validate rehearse --profile tiny-fp8 --tp 1 --golden "$fp8" \
  --run-dir runs/fp8-clean
if [ $? = 2 ]; then  # this host's pair is not the golden's: calibrate it here
  fp8="$dir/tiny-fp8-$gpu-tp1.json"
  step cal-fp8 python3 -m validate calibrate --profile tiny-fp8 --tp 1 --runs 3 \
    --run-dir runs/cal-fp8 --out "$fp8"
  rm -rf runs/fp8-clean
  step fp8-clean python3 -m validate rehearse --profile tiny-fp8 --tp 1 --golden "$fp8" \
    --run-dir runs/fp8-clean
fi
step fp8-draft-target-quant-config python3 -m validate rehearse --profile tiny-fp8 --tp 1 \
  --golden "$fp8" --reference golden --vllm-patch "$b/draft-target-quant-config.patch" \
  --run-dir runs/fp8-draft-target-quant-config
step fp8-compare-moe-scales python3 -m validate compare --profile tiny-fp8 --tp 1 \
  --baseline-golden "$fp8" --vllm-patch "$b/fp8-moe-shard-scales-swapped.patch" \
  --run-dir runs/fp8-compare-moe-scales
step cal-attn python3 -m validate calibrate --profile tiny-fp8-attn --tp 1 --runs 3 \
  --run-dir runs/cal-attn --out "$attn"
step attn-qk-scales python3 -m validate rehearse --profile tiny-fp8-attn --tp 1 --golden "$attn" \
  --reference golden --vllm-patch "$b/fp8-qk-scales-not-permuted.patch" --run-dir runs/attn-qk-scales
step attn-clean python3 -m validate rehearse --profile tiny-fp8-attn --tp 1 --golden "$attn" \
  --run-dir runs/attn-clean
step fp8-qk-scales-control python3 -m validate rehearse --profile tiny-fp8 --tp 1 --golden "$fp8" \
  --reference golden --vllm-patch "$b/fp8-qk-scales-not-permuted.patch" \
  --run-dir runs/fp8-qk-scales-control
step fp8-compare-comment python3 -m validate compare --profile tiny-fp8 --tp 1 \
  --baseline-golden "$fp8" --vllm-patch "$b/comment-only.patch" --run-dir runs/fp8-compare-comment
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$dir/nvidia-smi.csv" 2>&1
touch "$dir/done"
