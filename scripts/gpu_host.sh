#!/usr/bin/env bash
# Run tidal's GPU checks on an offline CUDA host that has torch, transformers, numpy, safetensors,
# pyarrow, xxhash, psutil, matplotlib, rich and pytest preinstalled, with a wheelhouse in .whl/ for
# the rest (ray, torch_memory_saver, zstandard): build it elsewhere with a `pip download` of those.
#
#   bash scripts/gpu_host.sh [STEP ...]      steps: env tests bench-memory bench-sync bench-rollout train
#
# Each step writes its output to $OUT/<step>.log when OUT is set (else ./gpu-logs/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests bench-memory bench-sync bench-rollout train)
run() { local name=$1; shift; echo "=== $name: $*"; local t=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo "=== $name rc=$rc $((SECONDS - t))s"; tail -n 25 "$OUT/$name.log"; }
for s in "${steps[@]}"; do
  case $s in
    env) run env bash -c 'nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c "import torch, transformers, ray, torch_memory_saver; print(torch.__version__, torch.version.cuda, transformers.__version__, ray.__version__)"; python3 -c "import yaml, rich, matplotlib, psutil, xxhash, zstandard, safetensors; print(\"deps ok\")"' ;;
    tests) run tests python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" ;;
    bench-memory) run bench-memory python3 -m tidal.bench.memory ;;
    bench-sync) run bench-sync python3 -m tidal.bench.weight_sync ;;
    bench-rollout) run bench-rollout python3 -m tidal.bench.rollout --shape qwen2.5-0.5b-shape --prompts 64 --samples 8 --prompt-len 64 --new-tokens 256 ;;
    train) run train python3 -m tidal.bench.reward_curve --num-rollout 30 --no-progress ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
