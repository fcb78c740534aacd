#!/usr/bin/env bash
# The kit's GPU path on real hardware, without a container: the tiny pair through the same CLI and
# end-to-end script as every run, with vLLM's defaults (torch.compile, CUDA graphs).
# Usage: tools/gpu_evidence.sh PAIR_DIR OUT_DIR TP [HEAD...]   (HEAD: trained | random)
# Each run's record.json and summary.md are copied to OUT_DIR/<tp>-<head>/.
set -uo pipefail
pair=$1 out=$2 tp=$3; shift 3
heads=("${@:-trained}")
for head in "${heads[@]}"; do
  draft="$pair/head"; [ "$head" = random ] && draft="$pair/random-head"
  run="runs/tiny-cuda-tp$tp-$head"
  python3 -m validate rehearse --profile tiny-cuda --tp "$tp" --target "$pair/target" \
    --draft "$draft" --run-dir "$run"
  echo "exit code for tp=$tp head=$head: $?"
  mkdir -p "$out/tp$tp-$head" && cp "$run"/record.json "$run"/summary.md "$out/tp$tp-$head/" 2>/dev/null
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.csv" 2>&1
