#!/usr/bin/env bash
# Run tidal's GPU checks on an offline CUDA host that has torch, transformers, numpy, safetensors,
# pyarrow, xxhash, psutil, matplotlib, rich and pytest preinstalled, with a wheelhouse in .whl/ for
# the rest (ray, torch_memory_saver, zstandard, and for tidal serve fastapi, starlette, uvicorn, pydantic,
# pydantic-core, httpx, httpcore, h11, anyio, click, and fastapi's own opentelemetry-api and annotated-doc: build it
# with `pip download` of those for the host).
#
#   bash scripts/gpu_host.sh STEP ...
#
# Steps: env, tests, speed (issue 20's figures in one call), ab-train (the loop from an earlier commit's copy and this tree, interleaved), speed-decode (the decode step's options side by side), profile-decode (the preset's decode step's kernels), profile-loop (the preset's loop with two rollouts profiled; PROFILE_TAG and TRAIN05_ARGS for a variant), offload-ab (the early resume's A/B and the offloaded train profiled), bench-attention (SDPA's first calls at new lengths per kernel), decode-experiments (the compiled fused step with the attention call writing the cache, per batch bucket, with its pieces writing it), trainer-shapes (bench trainer at new shapes, both attention orders), decode-options (inductor options beside combo kernels for the decode step), issue-figures (issue 20's before and after on one machine; its halves issue-figures-loops and issue-figures-benches; figures-limits prints them beside their limits), ab-decode (the fast bench and first steps from an earlier commit's copy and this tree), offload-split (the offloaded loop with and without the late release: what the engines' weights resume waits for), first-job (what is open of issue 20, most urgent first: cold and warm first steps and loops with the decode step's default inductor options and with none, the offloaded loop), loop-summary (each loop run's step and phases' means; LOOP_RUNS: a glob of run folders), train-default, train-offload, startup, startup-0.5b, train-0.5b, bench-memory, bench-sync, bench-sync-disk, bench-codec-disk, bench-rollout,
# bench-fast, bench-memory-preload, bench-memory-100, bench-trainer, bench-serve, bench-multiturn, train-guess, bench-async, bench-async-mps, profile-ipc, megatron (or its halves megatron-loop, megatron-state; megatron-2gpu: TP/PP = 2 on a two-GPU host), train-megatron. Each writes $OUT/<step>.log (OUT defaults to ./gpu-logs) and prints its tail.
# Knobs (environment): TESTS_PATHS, TESTS_LIMIT (tests); LOOP_RUNS (loop-summary); TRAIN05_ARGS (extra train flags), TRAIN05_TAG
# (suffix of the log and run folder), TRAIN05_ROLLOUTS (train-0.5b); STARTUP_ROLLOUTS (startup); STARTUP05_RUNS, STARTUP05_ARGS, STARTUP05_TAG (startup-0.5b: its runs share one fresh compile cache, so the first is cold and the rest warm); MEM_GIB, MEM_CYCLES, MEM100_GIB
# (bench-memory*); SYNC_MODELS, SYNC_MODES, SYNC_SOURCES, SYNC_ARGS (bench-sync); TRAINER_ARGS, TRAINER_TAG
# (bench-trainer); AB_BASE, AB_ARGS, AB_ROUNDS (ab-train; AB_BASE for ab-decode too); DECODE_TAGS (decode-experiments: any of default, static, kvwrite); ROLLOUT_ARGS, ROLLOUT_TAG (bench-rollout, e.g. ROLLOUT_ARGS='--paths fast --profile'); FAST_CASES, FAST_ARGS, FAST_TAG (bench-fast); SERVE_ARGS (bench-serve); MEGATRON_K (megatron: a pytest -k expression); MULTITURN_ARGS (bench-multiturn); ASYNC_MODES, ASYNC_ROLLOUTS, ASYNC_ARGS, ASYNC_TAG (bench-async, bench-async-mps); TAIL (lines of each log printed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
if [ -d .whl ]; then
  # Installed once per wheelhouse (a step that runs others, such as speed, calls this script again).
  stamp=$(ls .whl | md5sum | cut -c1-32)
  if [ "$(cat /tmp/site/.wheelhouse 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    echo "$stamp" > /tmp/site/.wheelhouse
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# The fast bench's flags for the 0.5B preset's decode step: fused, its pieces writing the cache, flex, two-stage sampling.
PRESET_STEP="--fused --fused-kv-write --decode-attention flex --sampler-noise blocks --skip-hf"
run() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? $((SECONDS - t))s"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
}

# Each step's phases and where its generate went (the decode/* metrics), one line a step.
steps_table() {
  [ -f "$1" ] || return 0
  python3 - "$1" <<'PY'
import json, sys
keys = ("generate_s", "decode/engine_s", "decode/call_s", "decode/prefill_s", "decode/decode_s", "decode/capture_s", "decode/graph_captures",
        "decode/compactions", "decode/waves", "decode/steps", "train_s", "train_compile_s", "sync_s", "gen_tokens_per_s", "elapsed_s")
# With --offload: the trainer's pause and resume, each state class's seconds and GB/s.
def memory(k):
    return k.startswith(("memory/trainer_pause/", "memory/trainer_resume/")) and k.endswith(("_s", "/seconds", "/gbps"))
for line in open(sys.argv[1]):
    r = json.loads(line)
    shown = [k for k in keys if isinstance(r.get(k), (int, float))] + sorted(k for k in r if memory(k))
    print(f"step {r['step']}: " + " ".join(f"{k.replace('memory/trainer_', '')}={r[k]:.3g}" for k in shown))
PY
}

for s in "$@"; do
  case $s in
    env) run env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c "import torch, transformers, ray, torch_memory_saver; print(torch.__version__, torch.version.cuda, transformers.__version__, ray.__version__)"' ;;
    tests) TAIL=30 run tests "${TESTS_LIMIT:-420}" python3 -m pytest -q -m gpu ${TESTS_PATHS:-tests/gpu} -p no:cacheprovider -o addopts="" -rfE --durations=10 ;;
    train-default) run train-default 150 python3 -m tidal.bench.reward_curve --num-rollout 40 --output-dir "$OUT/run-default" ;;
    train-offload) run train-offload 120 python3 -m tidal.cli train --no-progress --offload --num-rollout 5 --output-dir "$OUT/run-offload" ;;
    startup-0.5b) TAIL=6 run startup-0.5b${STARTUP05_TAG:-} 540 python3 -m tidal.bench.startup --runs ${STARTUP05_RUNS:-2} --fresh-cache -- --preset qwen2.5-0.5b-1gpu --num-rollout 1 --rollout-batch-size 64 --rollout-max-response-len 256 ${STARTUP05_ARGS:-} ;;
    startup) TAIL=5 run startup 300 python3 -m tidal.bench.startup --runs 3 -- --num-rollout ${STARTUP_ROLLOUTS:-5} ;;
    speed)
      # Issue 20's figures in one call (~7 min on an H100): first steps cold and warm, the preset's loop resident and
      # with --offload, pause/resume against a pinned copy, decode at fixed and variable lengths.
      STARTUP05_TAG=-speed bash "$0" startup-0.5b
      TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-speed TAIL=1 bash "$0" train-0.5b
      TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-speed-offload TRAIN05_ARGS=--offload TAIL=1 bash "$0" train-0.5b
      MEM_GIB=6 MEM_CYCLES=3 bash "$0" bench-memory
      FAST_CASES=fast-prefill FAST_TAG=-speed bash "$0" bench-fast
      # Variable lengths as the preset's engine decodes them: compiled, fused (its pieces writing the cache), flex,
      # sampling in two stages.
      FAST_CASES=fast-varlen-compiled FAST_ARGS="$PRESET_STEP" FAST_TAG=-speed-varlen bash "$0" bench-fast ;;
    speed-decode)
      # The decode step's options side by side on one machine (~4 min): the model's forward, the fused step (the
      # 0.5B preset's) with the sampler's noise per block and word (the CUDA default), in a buffer, and drawn in
      # its kernel.
      ROLLOUT_TAG=-forward ROLLOUT_ARGS="--paths fast --skip-hf" bash "$0" bench-rollout
      ROLLOUT_TAG=-fused ROLLOUT_ARGS="--paths fast --fused --fused-kv-write" bash "$0" bench-rollout
      ROLLOUT_TAG=-fused-buffer ROLLOUT_ARGS="--paths fast --fused --fused-kv-write --skip-hf --sampler-noise buffer" bash "$0" bench-rollout
      ROLLOUT_TAG=-fused-drawn ROLLOUT_ARGS="--paths fast --fused --fused-kv-write --skip-hf --sampler-noise drawn" bash "$0" bench-rollout ;;
    profile-decode)
      # The preset's decode step under torch.profiler (compiled, fused writing the cache, flex, two-stage sampling): the kernels of a
      # warm rollout by category, to see what bounds decode after the sampler.
      TAIL=${TAIL:-4} FAST_CASES=fast-compiled FAST_ARGS="$PRESET_STEP --profile fast-compiled" FAST_TAG=-profile bash "$0" bench-fast ;;
    profile-loop)
      # The preset's loop with rollouts 3 and 4 under torch.profiler (--profile-rollouts): each engine's generate and
      # the trainer's train as they run beside the other actors; the summaries' lines, the traces under the run.
      TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-profile${PROFILE_TAG:-} TRAIN05_ARGS="--profile-rollouts 3 4 ${TRAIN05_ARGS:-}" TAIL=1 bash "$0" train-0.5b
      for f in "$OUT"/run-0.5b-profile${PROFILE_TAG:-}/profiles/*.json; do case $f in *.trace.json) ;; *) python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(d['profile'], 'wall', d['wall_s'], 'device', d['total_s'], d['by_category'])
for name, p in (d.get('phases') or {}).items():
    print('   ', name, p)" "$f" ;; esac; done ;;
    offload-ab)
      # The offloaded loop's open questions on one machine (~7 min on an H100): the early resume off / all / weights,
      # interleaved twice, then the offloaded train profiled (its phases' CUDA runtime calls: does the first
      # micro-batch cudaMalloc the activations' blocks the pause freed?).
      for round in 1 2; do for mode in off all weights; do
        TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-ab-$mode$round TRAIN05_ARGS="--offload --train-resume-early $mode" TAIL=1 bash "$0" train-0.5b
      done; done
      PROFILE_TAG=-offload TRAIN05_ARGS="--offload" bash "$0" profile-loop ;;
    train-0.5b)
      run train-0.5b${TRAIN05_TAG:-} 200 python3 -m tidal.cli train --no-progress --preset qwen2.5-0.5b-1gpu --num-rollout ${TRAIN05_ROLLOUTS:-5} --rollout-batch-size 64 --rollout-max-response-len 256 --output-dir "$OUT/run-0.5b${TRAIN05_TAG:-}" ${TRAIN05_ARGS:-}
      steps_table "$OUT/run-0.5b${TRAIN05_TAG:-}/metrics.jsonl" ;;
    ab-train)
      # The preset's loop from a copy of an earlier commit (AB_BASE: a folder made by scripts/ab_base.sh) and from
      # this tree, interleaved AB_ROUNDS times (default 2) on one machine, with AB_ARGS (e.g. --offload); then each
      # run's mean step and phases, so that a change is compared on one host.
      [ -d "${AB_BASE:-}" ] || { echo "ab-train: AB_BASE must name a folder made by scripts/ab_base.sh"; exit 2; }
      [ -e "$AB_BASE/.whl" ] || [ ! -d .whl ] || ln -sfn "$PWD/.whl" "$AB_BASE/.whl"
      out=$(realpath "$OUT")
      for round in $(seq "${AB_ROUNDS:-2}"); do
        TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-ab-head$round TRAIN05_ARGS="${AB_ARGS:-}" TAIL=0 bash "$0" train-0.5b | grep "^==="
        (cd "$AB_BASE" && OUT=$out TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-ab-base$round TRAIN05_ARGS="${AB_ARGS:-}" TAIL=0 \
          bash scripts/gpu_host.sh train-0.5b | grep "^===")
      done
      LOOP_RUNS="run-0.5b-ab-*" bash "$0" loop-summary ;;
    ab-decode)
      # The decode step and the first step from a copy of an earlier commit (AB_BASE, as for ab-train) and from this
      # tree, one after the other on one machine (~5 min on an H100): the fast bench's compiled fixed-length,
      # variable-length and prefill cases with the preset's step, then a cold and a warm first step of each; then
      # each fast bench line side by side. The loops: ab-train.
      [ -d "${AB_BASE:-}" ] || { echo "ab-decode: AB_BASE must name a folder made by scripts/ab_base.sh"; exit 2; }
      [ -e "$AB_BASE/.whl" ] || [ ! -d .whl ] || ln -sfn "$PWD/.whl" "$AB_BASE/.whl"
      out=$(realpath "$OUT")
      for tree in head base; do
        dir=.; [ $tree = base ] && dir=$AB_BASE
        (cd "$dir" && OUT=$out FAST_CASES=fast-compiled,fast-varlen-compiled,fast-prefill FAST_ARGS="$PRESET_STEP" \
          FAST_TAG=-ab-$tree TAIL=0 bash scripts/gpu_host.sh bench-fast | grep "^===")
        (cd "$dir" && OUT=$out STARTUP05_TAG=-ab-$tree TAIL=3 bash scripts/gpu_host.sh startup-0.5b)
      done
      for f in "$OUT"/bench-fast-ab-*.log; do echo "== $f"; grep '"case": "fast' "$f" | python3 -c "
import json, sys
keys = ('case', 'tokens_per_s', 'decode_s', 'cold_seconds', 'capture_s', 'logprob_max_abs_diff', 'logprob_mean_abs_diff',
        'floor_fraction', 'prefill_s_shared', 'error')
for line in sys.stdin:
    r = json.loads(line)
    print({k: r[k] for k in keys if r.get(k) is not None})"; done ;;
    issue-figures|issue-figures-loops|issue-figures-benches)
      # Issue 20's before and after on one machine (~10 min on an H100; its halves -loops and -benches fit one call
      # of 10 minutes each): the preset's loop from a copy of the code before the issue's work (AB_BASE, made by
      # scripts/ab_base.sh; 151fcf3) and from this tree, this tree's loop with --offload, each loop's step and
      # phases; then this tree's trainer bench (the preset's trainer: its measured matmul peak and train floor), fast
      # bench (fixed and variable lengths, the preset's step: the decode floor) and first steps cold and warm; the
      # base's fast bench (its compiled step, its variable lengths); last each figure beside its limit, the step's
      # too (its decode steps and train at their floors). Most needed first, so that a cut call loses the least.
      [ -d "${AB_BASE:-}" ] || { echo "issue-figures: AB_BASE must name a folder made by scripts/ab_base.sh"; exit 2; }
      [ -e "$AB_BASE/.whl" ] || [ ! -d .whl ] || ln -sfn "$PWD/.whl" "$AB_BASE/.whl"
      out=$(realpath "$OUT")
      if [ "$s" != issue-figures-benches ]; then
        TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-after TAIL=0 bash "$0" train-0.5b | grep "^==="
        (cd "$AB_BASE" && OUT=$out TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-before TAIL=0 bash scripts/gpu_host.sh train-0.5b | grep "^===")
        TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-after-offload TRAIN05_ARGS=--offload TAIL=0 bash "$0" train-0.5b | grep "^==="
        LOOP_RUNS="run-0.5b-*" bash "$0" loop-summary
      fi
      [ "$s" = issue-figures-loops ] && continue
      TRAINER_TAG=-after TRAINER_ARGS="--compile-layers --max-tokens-per-gpu 32768" TAIL=0 bash "$0" bench-trainer | grep "^==="
      FAST_CASES=fast-compiled,fast-varlen-compiled FAST_ARGS="$PRESET_STEP" FAST_TAG=-after TAIL=0 bash "$0" bench-fast | grep "^==="
      STARTUP05_TAG=-after TAIL=4 bash "$0" startup-0.5b
      (cd "$AB_BASE" && OUT=$out FAST_CASES=fast-compiled,fast-varlen FAST_TAG=-before TAIL=0 bash scripts/gpu_host.sh bench-fast | grep "^===")
      # 151fcf3's script names its log bench-fast.log whatever FAST_TAG says.
      [ -f "$OUT/bench-fast-before.log" ] || mv "$OUT/bench-fast.log" "$OUT/bench-fast-before.log" 2>/dev/null
      bash "$0" figures-limits ;;
    figures-limits)
      # issue-figures' figures beside their limits, from the logs and runs in $OUT: the fast benches' decode floor, the
      # trainer bench's train floor (its FLOPs at the matmul peak it measured), and the resident loop's step against
      # its floor: the loop's decode steps at the fast bench's floor rate plus the train floor.
      python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
def rows(path, case=None):
    found = []
    for line in open(path) if os.path.exists(path) else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and (case is None or str(r.get("case", "")).startswith(case)):
            found.append(r)
    return found
fast_keys = ("case", "tokens_per_s", "decode_s", "decode_floor_tokens_per_s", "floor_fraction", "logprob_max_abs_diff", "logprob_mean_abs_diff", "error")
floor_rate = None
for tag in ("after", "before"):
    for r in rows(os.path.join(out, f"bench-fast-{tag}.log"), "fast"):
        print(tag, {k: r[k] for k in fast_keys if r.get(k) is not None})
        if tag == "after" and r["case"] == "fast-compiled" and r.get("decode_floor_tokens_per_s"):
            floor_rate = r["decode_floor_tokens_per_s"]
trainer = [r for r in rows(os.path.join(out, "bench-trainer-after.log")) if "train_floor_s" in r]
train_floor = trainer[-1]["train_floor_s"] if trainer else None
for r in trainer[-1:]:
    keys = ("train_s", "train_tokens_per_s", "matmul_tflops", "train_floor_s", "train_peak_fraction", "loss", "grad_norm")
    print("trainer", {k: r[k] for k in keys if k in r})
for path in sorted(glob.glob(os.path.join(out, "run-0.5b-after", "metrics.jsonl"))):
    steps = [json.loads(line) for line in open(path)]
    if len(steps) < 3 or floor_rate is None or train_floor is None:
        print("step limit: needs the resident loop, the fast bench and the trainer bench"); break
    step = (steps[-1]["elapsed_s"] - steps[1]["elapsed_s"]) / (len(steps) - 2)
    tokens = statistics.mean(r["gen_tokens"] for r in steps[1:])
    decode_floor = tokens / floor_rate
    print(f"resident step {step:.4f} s; limit {decode_floor + train_floor:.4f} s (decode {tokens:.0f} tokens at "
          f"{floor_rate:.0f} tokens/s: {decode_floor:.4f} s, train floor {train_floor:.4f} s); goal 1.6 s")
PY
      ;;
    decode-experiments)
      # The compiled fused decode step with the cache written by the attention call (two eager index_copy a layer;
      # one dynamic graph per piece), the same with a graph per batch bucket specialised to its size, and with the
      # pieces writing the cache (the preset's since round eight); at fixed and variable lengths.
      for tag in ${DECODE_TAGS:-default static kvwrite}; do extra=""; [ $tag = static ] && extra=--compile-static; [ $tag = kvwrite ] && extra=--fused-kv-write
        TAIL=3 FAST_CASES=fast-compiled,fast-varlen-compiled FAST_ARGS="--fused --decode-attention flex --sampler-noise blocks --skip-hf $extra" FAST_TAG=-$tag bash "$0" bench-fast; done ;;
    bench-attention) TAIL=4 run bench-attention 120 python3 -m tidal.bench.attention ;;
    trainer-shapes)
      # The trainer with new micro-batch shapes at every call (responses of 64-512 tokens), in its own SDPA order and
      # with cuDNN's first: what cuDNN's per-shape graph builds cost a train call (16,384 tokens a micro-batch: at 32,768 the 512-token
      # responses' logits buffer, 9.24 GiB, ran an H100 out of memory).
      for order in trainer cudnn-first; do TAIL=1 TRAINER_TAG=-shapes-$order TRAINER_ARGS="--compile-layers --max-tokens-per-gpu 16384 --response-len-min 64 --response-len 512 --attention-order $order" bash "$0" bench-trainer; done ;;
    bench-memory) run bench-memory 200 python3 -m tidal.bench.memory --gib ${MEM_GIB:-16} --cycles ${MEM_CYCLES:-5} --disk-dir /var/tmp/tidal-disk ;;
    bench-sync) run bench-sync 300 python3 -m tidal.bench.weight_sync --model ${SYNC_MODELS:-qwen2.5-0.5b-shape,qwen3-4b-shape} --modes ${SYNC_MODES:-full,delta} --transports tensor --sources ${SYNC_SOURCES:-backup,device} ${SYNC_ARGS:-} ;;
    bench-sync-disk) TAIL=20 run bench-sync-disk 420 python3 -m tidal.bench.weight_sync --model ${SYNC_MODELS:-qwen3-4b-shape} --modes delta --transports tensor,disk --sources backup --disk-dir /var/tmp ${SYNC_ARGS:-} ;;
    bench-codec-disk) TAIL=20 run bench-codec-disk 420 bash -c 'for e in overwrite xor; do python3 -m tidal.bench.delta_codec --format both --encoding $e --reps 3 --disk-dir /var/tmp || exit 1; done' ;;
    bench-rollout) TAIL=${TAIL:-12} run bench-rollout${ROLLOUT_TAG:-} 240 python3 -m tidal.bench.rollout --shape qwen2.5-0.5b-shape --prompts 64 --samples 8 --prompt-len 64 --new-tokens 256 ${ROLLOUT_ARGS:-} ;;
    bench-fast) TAIL=20 run bench-fast${FAST_TAG:-} 300 python3 -m tidal.rollout.fast.bench --shape qwen2.5-0.5b-shape --prompts 64 --samples 8 --prompt-len 64 --new-tokens 256 --varlen-min 16 --varlen-max 1024 --skip-hf-varlen --cases ${FAST_CASES:-fast,fast-eager,fast-tms,fast-prefill,fast-varlen,fast-varlen-nocompact} ${FAST_ARGS:-} ;;
    bench-memory-preload) run bench-memory-preload 200 python3 -m tidal.bench.memory --gib ${MEM_GIB:-16} --cycles ${MEM_CYCLES:-5} --hook-mode preload --policies release,retain ;;
    bench-memory-100) run bench-memory-100 240 python3 -m tidal.bench.memory --gib ${MEM100_GIB:-4} --cycles 100 --policies retain ;;
    bench-trainer) TAIL=${TAIL:-45} run bench-trainer${TRAINER_TAG:-} 300 python3 -m tidal.bench.trainer --device cuda --model qwen2.5-0.5b-shape --samples 512 --prompt-len 32 --response-len 256 --max-tokens-per-gpu 8192 ${TRAINER_ARGS:---profile} ;;
    bench-serve) run bench-serve 420 python3 -m tidal.bench.serve --shape qwen2.5-0.5b-shape --requests 512 --prompt-len 64 --new-tokens 256 ${SERVE_ARGS:-} ;;
    bench-multiturn) run bench-multiturn 300 python3 -m tidal.bench.multiturn --shape qwen2.5-0.5b-shape --trajectories 256 --turns 4 --prompt-len 512 --obs-len 128 --new-tokens 64 --prefix-cache-mb 16384 ${MULTITURN_ARGS:-} ;;
    train-guess) run train-guess 200 python3 -m tidal.cli train --no-progress --task guess --num-rollout 30 --output-dir "$OUT/run-guess" ;;
    bench-async) TAIL=16 run bench-async${ASYNC_TAG:-} 560 python3 -m tidal.bench.async_modes --modes ${ASYNC_MODES:-sync,one-step,full} --preset qwen2.5-0.5b-1gpu --num-rollout ${ASYNC_ROLLOUTS:-6} --rollout-batch-size 64 --rollout-max-response-len 256 --output-dir "$OUT/run-async${ASYNC_TAG:-}" ${ASYNC_ARGS:-} ;;
    bench-async-mps)
      # The same bench with the trainer and engine processes sharing the GPU through a private CUDA MPS daemon
      # (kernels of both run concurrently instead of time-sliced); ASYNC_ARGS may add --rollout-env-vars with
      # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / CUDA_MPS_CLIENT_PRIORITY for the engine. The daemon is stopped after.
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/tidal-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/tidal-mps/log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      if nvidia-cuda-mps-control -d; then
        TAIL=16 run bench-async-mps${ASYNC_TAG:-} 560 python3 -m tidal.bench.async_modes --modes ${ASYNC_MODES:-sync,one-step} --preset qwen2.5-0.5b-1gpu --num-rollout ${ASYNC_ROLLOUTS:-6} --rollout-batch-size 64 --rollout-max-response-len 256 --output-dir "$OUT/run-async-mps${ASYNC_TAG:-}" ${ASYNC_ARGS:-}
        echo quit | nvidia-cuda-mps-control
      else
        echo "=== bench-async-mps: nvidia-cuda-mps-control -d failed; skipped"
      fi
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
    profile-ipc) TAIL=20 run profile-ipc 120 python3 scripts/profile_ipc.py ;;
    megatron|megatron-loop|megatron-state|megatron-2gpu)
      k=${s#megatron}; k=${k#-}
      case $k in loop) expr="loop or matches_fsdp" ;; state) expr="pause_resume or checkpoint" ;; 2gpu) expr="two_gpus" ;; *) expr="${MEGATRON_K:-}" ;; esac
      TAIL=100 run "$s" 600 python3 -m pytest -q -s -m gpu tests/gpu/test_megatron_gpu.py -k "$expr" -p no:cacheprovider -o addopts="" -rfE --durations=6 ;;
    first-job)
      # What is open of issue 20 in one call, most urgent first, each run's log packed as it ends (~4.5 min on an
      # H100): a cold and a warm first step with the decode step's default inductor options (combo kernels), a cold one with none, the
      # offloaded loop (its sync split: the engines' resumes beside the push), the resident loop with and without
      # combo kernels; then every loop's means (loop-summary).
      STARTUP05_RUNS=2 STARTUP05_TAG=-combo TAIL=3 bash "$0" startup-0.5b
      STARTUP05_RUNS=1 STARTUP05_TAG=-nocombo STARTUP05_ARGS="--rollout-compile-options {}" TAIL=2 bash "$0" startup-0.5b
      TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-offload TRAIN05_ARGS=--offload TAIL=1 bash "$0" train-0.5b
      TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-combo TAIL=1 bash "$0" train-0.5b
      TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-nocombo TRAIN05_ARGS="--rollout-compile-options {}" TAIL=1 bash "$0" train-0.5b
      bash "$0" loop-summary ;;
    offload-split)
      # Whether the engines' weights resume waits behind the trainer's optimizer copy out (round fifteen: 49 ms
      # against 3 ms for the KV cache): the offloaded loop with the retained host copy (the late release) and with
      # --offload-host-memory release (the copy ends inside the pause), then both loops' means (~3 min on an H100).
      TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-offload-release TRAIN05_ARGS="--offload --offload-host-memory release" TAIL=1 bash "$0" train-0.5b
      TRAIN05_ROLLOUTS=6 TRAIN05_TAG=-offload-retain TRAIN05_ARGS=--offload TAIL=1 bash "$0" train-0.5b
      LOOP_RUNS="run-0.5b-offload-*" bash "$0" loop-summary ;;
    decode-options)
      # More of inductor's options for the preset's decode step beside combo kernels (the CUDA default), in one process
      # (~3 min on an H100): fusing nodes that share no memory, combining kernels of mixed sizes, timing each
      # combination before keeping it.
      FAST_CASES=fast-compiled FAST_TAG=-options FAST_ARGS="$PRESET_STEP \
--inductor-options {\"combo_kernels\":true} --inductor-options {\"combo_kernels\":true,\"aggressive_fusion\":true} \
--inductor-options {\"combo_kernels\":true,\"combo_kernel_allow_mixed_sizes\":2} --inductor-options {\"combo_kernels\":true,\"benchmark_combo_kernel\":true}" \
        TAIL=40 bash "$0" bench-fast ;;
    loop-summary)
      # Each loop run's step (steps 1.., step 0 compiles) and its phases' means, with the offloaded sync's split.
      python3 - "$OUT" "${LOOP_RUNS:-run-0.5b-*}" <<'PY'
import glob, json, os, statistics, sys
keys = ("generate_s", "gen_tokens_per_s", "logprob_diff", "decode/engine_s", "decode/call_s", "decode/decode_s", "decode/prefill_s", "train_s", "sync_s", "sync/encode_s", "sync/apply_s", "pause_s", "resume_s", "release_s",
        "sync/seconds", "sync/engine_resume_weights_s", "sync/engine_resume_kv_s", "memory/trainer_pause/settle_s",
        "memory/trainer_pause/free_transients_s")
for path in sorted(glob.glob(os.path.join(sys.argv[1], sys.argv[2], "metrics.jsonl"))):
    rows = [json.loads(line) for line in open(path)]
    if len(rows) < 3:
        print(os.path.basename(os.path.dirname(path)), "unfinished"); continue
    step = (rows[-1]["elapsed_s"] - rows[1]["elapsed_s"]) / (len(rows) - 2)
    means = {k: statistics.mean(r[k] for r in rows[1:]) for k in keys if all(k in r for r in rows[1:])}
    print(os.path.basename(os.path.dirname(path)), f"first={rows[0]['elapsed_s']:.2f}", f"step={step:.4f}", " ".join(f"{k.split('/')[-1]}={v:.4f}" for k, v in means.items()))
PY
      ;;
    train-megatron) run train-megatron 200 python3 -m tidal.bench.reward_curve --train-backend megatron --num-rollout 40 --output-dir "$OUT/run-megatron" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
