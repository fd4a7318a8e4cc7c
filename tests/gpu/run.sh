#!/usr/bin/env bash
# Runs the CUDA build (made by tests/gpu/build-cuda.sh, carried in .gpubin/) on a GPU machine:
#
#   bash tests/gpu/run.sh check   # tests/cuda/ (CUDA vs CPU, NCCL world 1) + a launched run
#   bash tests/gpu/run.sh bench   # tests/bench/gpu.rs: training MFU and generation vs PyTorch
#   bash tests/gpu/run.sh profile # the bench's training run under tests/gpu/kernel_profile.c
#   bash tests/gpu/run.sh overlap # two ranks sharing the GPU over tcp, --prefetch off and on
#   bash tests/gpu/run.sh quick   # a few GPU tests and our training rows alone (a lease's last minutes)
#   bash tests/gpu/run.sh ab      # our batch-8 rows with each not-yet-measured change switched off
#   bash tests/gpu/run.sh kernels # the flash kernels alone, each variant beside PyTorch's sdpa, and
#                                 # their kernel profiles (under a minute)
#   bash tests/gpu/run.sh all     # the three in one call (a lent machine's minutes are few), then
#                                 # a table of the parts; the profile (at batch 8 unless
#                                 # PROFILE_BATCH says) goes to $OUT if set; stops after a failed
#                                 # check unless ALL_KEEP_GOING=1
#
# With the device tool: run(command="bash tests/gpu/run.sh check", carry=[".gpubin"]).
# Needs the NVIDIA driver and a Python venv with torch (its nvidia/cu13 and nvidia/nccl wheels
# provide libcublas, libcudart, libcurand and libnccl); FSDP_BENCH_PYTHON names it (default: the
# first of /opt/torch/.venv/bin/python and python3 that imports torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-check}

PY=${FSDP_BENCH_PYTHON:-}
if [ -z "$PY" ]; then
  for c in /opt/torch/.venv/bin/python python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import torch' 2>/dev/null; then PY=$c; break; fi
  done
fi
[ -n "$PY" ] || { echo "no Python with torch found: set FSDP_BENCH_PYTHON" >&2; exit 2; }
export FSDP_BENCH_PYTHON=$PY
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

BIN=${GPUBIN:-/tmp/gpubin}
mkdir -p "$BIN"
# Python's lzma, in case the machine has no xz.
for f in .gpubin/*.xz; do
  "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "$BIN/$(basename "$f" .xz)"
  chmod +x "$BIN/$(basename "$f" .xz)"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ldd "$BIN/fsdp-app" | grep 'not found'; then echo "missing libraries (above)" >&2; exit 2; fi

# Every part of `check` runs even when an earlier one fails (device time is scarce: one call
# should show every failure), and the script fails at the end if any did.
failed=()
part() { local name=$1; shift; echo "== $name"; if "$@"; then echo "== $name: ok"; else echo "== $name: FAILED"; failed+=("$name"); fi; }

# Where the bench's 1.1B model and the training runs' outputs go: one directory for every part
# and every call on a warm machine, so that a call after `all` (`ab`, `quick`, `overlap`) reuses
# the model instead of writing its 4.4 GB again (the fixture lands whole: written aside, then
# renamed), and a part's outputs replace its last ones instead of filling the disk (each part
# clears its own first; the trained checkpoints are 4.4 GB each).
bench=${FSDP_BENCH_DIR:-/tmp/fsdp-bench}
export FSDP_BENCH_DIR=$bench
mkdir -p "$bench"

# The bench's 1.1B Llama (random weights; tests/bench/gpu.rs makes the same one) in $1/llama-1b,
# unless it is there already, and $2 rows of 2048 tokens in $1/data.jsonl.
bench_model() {
  [ -f "$1/llama-1b/config.json" ] || part "fixture, 1.1B" "$BIN/fsdp-app" fixture --name llama --out "$1/llama-1b" \
    --set vocab_size=32000 --set hidden_size=2048 --set intermediate_size=8192 --set num_hidden_layers=16 \
    --set num_attention_heads=32 --set num_key_value_heads=8 --set head_dim=64 --set max_position_embeddings=4096 \
    --set rope_scaling=null --set tie_word_embeddings=false
  "$PY" -c 'import json, sys
for i in range(int(sys.argv[1])): print(json.dumps({"input_ids": [(i * 7919 + j * 104729) % 32000 for j in range(2048)]}))' "$2" > "$1/data.jsonl"
}

# One rank of the bench's 1.1B training under the launcher (NCCL, bf16, activation checkpointing,
# rows of 2048 tokens), the model and data in $1 (bench_model's): output directory $2, $3 rows a
# step, $4 steps, then more finetune flags.
train_1b() {
  local work=$1 out=$2 batch=$3 steps=$4
  shift 4
  "$BIN/fsdp-app" launch --nproc-per-node 1 -- finetune --model "$work/llama-1b" \
    --data "$work/data.jsonl" --output-dir "$out" --device cuda --backend nccl --param-dtype bf16 \
    --activation-checkpointing --seq-len 2048 --batch-size "$batch" --max-steps "$steps" --no-shuffle "$@"
}

# $2... run with the space-separated NAME=VALUE assignments in $1 exported (a subshell).
with_env() { local vars=$1; shift; ( for v in $vars; do export "${v?}"; done; "$@" ); }

# A row per LABEL=DIR given: the median tokens/s of the run's steps 3 on, and its losses.
median_rows() {
  "$PY" -c 'import json, statistics, sys
for arg in sys.argv[1:]:
    label, d = arg.split("=", 1)
    rows = [json.loads(l) for l in open(d + "/metrics.jsonl")]
    print("|", label, "|", round(statistics.median(r["tokens_per_s"] for r in rows[2:])), "tokens/s |", [round(r["loss"], 4) for r in rows])' "$@"
}

# Whether the runs in $1 and $2 logged the same number of finite losses, each within $3 (relative).
same_losses() {
  "$PY" -c 'import json, math, sys
loss = lambda d: [json.loads(l)["loss"] for l in open(d + "/metrics.jsonl")]
a, b, tol = loss(sys.argv[1]), loss(sys.argv[2]), float(sys.argv[3])
print("losses:", a, b, sep="\n  ")
sys.exit(0 if a and len(a) == len(b) and all(math.isfinite(x) and abs(x - y) <= tol * abs(x) for x, y in zip(a, b)) else 1)' "$@"
}

case "$what" in
  check)
    # Bounded, so that a kernel that never returns still leaves time for the launched runs.
    part "tests/cuda/" timeout -k 5 "${CUDA_TESTS_LIMIT_S:-150}" "$BIN/cuda-tests" --test-threads 1 --nocapture
    # The CLI end to end: one rank under the launcher, NCCL backend, bf16 compute.
    work=$(mktemp -d)
    # Heads of 64 values, so that attention runs on the flash kernels.
    part "fixture" "$BIN/fsdp-app" fixture --name llama --out "$work/model" --set head_dim=64
    # lr 1e-2: each step's update moves the next loss by more than bf16's rounding does. $1 the
    # output directory, then variables for the environment.
    train_1_rank() { local out=$1; shift; env "$@" "$BIN/fsdp-app" launch --nproc-per-node 1 -- finetune --model "$work/model" \
      --data tests/reference/train-data.jsonl --output-dir "$out" --device cuda --backend nccl --lr 1e-2 \
      --param-dtype bf16 --activation-checkpointing --seq-len 16 --batch-size 4 --max-steps 6 --no-shuffle; }
    part "launch, 1 rank, nccl, bf16" train_1_rank "$work/out"
    # The same with our CUDA kernels off (candle's composed ops, eager attention): the switches
    # a lent machine bisects with, and a whole run's check of the kernels' forward and backward.
    part "launch, 1 rank, composed ops" train_1_rank "$work/out-composed" FSDP_CUDA_KERNELS=0 FSDP_FLASH_ATTENTION=0
    part "kernels vs composed ops: losses within 1%" same_losses "$work/out" "$work/out-composed" 1e-2
    part "generate on cuda" "$BIN/fsdp-app" generate --model "$work/out" --device cuda --prompt "Hello" --max-new-tokens 8 --json
    # Two ranks sharing the one GPU (NCCL refuses two ranks on a device; the tcp backend does not).
    part "launch, 2 ranks, tcp" "$BIN/fsdp-app" launch --nproc-per-node 2 -- finetune --model "$work/model" \
      --data tests/reference/train-data.jsonl --output-dir "$work/out2" --device cuda:0 --backend tcp \
      --param-dtype bf16 --seq-len 16 --batch-size 2 --max-steps 6 --no-shuffle
    # The same with the collectives on a thread of their own, started a unit ahead: the same
    # losses (the same kernels in the same order; 1e-6 leaves room for a nondeterministic one).
    part "launch, 2 ranks, tcp, prefetch" "$BIN/fsdp-app" launch --nproc-per-node 2 -- finetune --model "$work/model" \
      --data tests/reference/train-data.jsonl --output-dir "$work/out3" --device cuda:0 --backend tcp \
      --param-dtype bf16 --seq-len 16 --batch-size 2 --max-steps 6 --no-shuffle --prefetch on
    part "prefetch: same losses" same_losses "$work/out2" "$work/out3" 1e-6
    ;;
  overlap)
    # Two ranks sharing the GPU over tcp (NCCL refuses two ranks on one device), the bench's
    # 1.1B model at batch 1 x 2048, --prefetch off, then on: tokens/s of steps 3 on. Not in
    # `all` (about two minutes); run it when a lent machine has the time.
    bench_model "$bench" 32
    rm -rf "$bench"/overlap-*
    for mode in off on; do
      part "2 ranks on one GPU, tcp, --prefetch $mode" "$BIN/fsdp-app" launch --nproc-per-node 2 -- finetune --model "$bench/llama-1b" \
        --data "$bench/data.jsonl" --output-dir "$bench/overlap-$mode" --device cuda:0 --backend tcp --param-dtype bf16 \
        --activation-checkpointing --seq-len 2048 --batch-size 1 --max-steps 8 --no-shuffle --prefetch "$mode"
    done
    median_rows "--prefetch off=$bench/overlap-off" "--prefetch on=$bench/overlap-on"
    ;;
  bench)
    part "tests/bench/gpu.rs" "$BIN/gpu-bench"
    ;;
  quick)
    # For the end of a lease (a few minutes left): the GPU tests named in QUICK_TESTS (a
    # substring each, default the flash-attention kernels and the gated MLP op against the CPU
    # and the models' gradients and loss curves), then our training rows of the bench (batch 1
    # and 8, the same model and flags) without PyTorch's: median tokens/s of steps 3 on, to set
    # beside the last bench's.
    for f in ${QUICK_TESTS:-flash_attention_matches_cpu_attention gated_mlp_op_on_cuda_matches_cpu residual_sublayer_op_on_cuda_matches_cpu self_attention_flash_op_on_cuda_matches_cpu gradients_on_cuda_match_cpu finetuning_on_cuda_follows_the_cpu_loss_curve}; do
      part "tests/cuda/ $f" timeout -k 5 90 "$BIN/cuda-tests" --test-threads 1 "$f"
    done
    bench_model "$bench" 48
    for batch in 1 8; do
      rm -rf "$bench/quick-$batch"
      part "ours, batch $batch" train_1b "$bench" "$bench/quick-$batch" "$batch" "${FSDP_BENCH_STEPS:-6}" --lr 1e-5 --lr-scheduler constant
    done
    median_rows "batch 1=$bench/quick-1" "batch 8=$bench/quick-8"
    ;;
  ab)
    # What each change not yet measured on a GPU gives, in one call: our training rows at batch
    # AB_BATCH (default 8; the bench's model and flags, no PyTorch) with each switch that takes
    # one back (or picks a variant kernel), median tokens/s of steps 3 on. The flash variants at
    # head dim 64 (the one-group forward, 32-key dq, 32-query dk/dv) first pass the flash test,
    # and give the same losses as the defaults (each row's arithmetic is the same), as does the
    # block op by op (the sublayer ops run the same ops). AB_ROWS (labels, comma-separated) runs
    # only those rows beside the default, where a lease has not the minutes for all of them.
    part "tests/cuda/ flash, the head-dim-64 variants" \
      env FSDP_FLASH_FORWARD_GROUPS=1 FSDP_FLASH_DQ_KEYS=32 FSDP_FLASH_DKV_QUERIES=32 \
      timeout -k 5 90 "$BIN/cuda-tests" --test-threads 1 flash_attention_matches_cpu_attention
    batch=${AB_BATCH:-8}
    steps=${FSDP_BENCH_STEPS:-6}
    bench_model "$bench" $((steps * batch))
    ab_rows=()
    rm -rf "$bench"/ab-*
    for variant in "default=" "one forward group=FSDP_FLASH_FORWARD_GROUPS=1" "32-key dq=FSDP_FLASH_DQ_KEYS=32" \
      "32-query dkv=FSDP_FLASH_DKV_QUERIES=32" "block op by op=FSDP_SUBLAYER_OPS=0" \
      "six attention ops=FSDP_FLASH_SELF_ATTENTION=0"; do
      label=${variant%%=*}
      if [ -n "${AB_ROWS:-}" ] && [ "$label" != default ] && [[ ",$AB_ROWS," != *",$label,"* ]]; then continue; fi
      out="$bench/ab-${label// /-}"
      rm -rf "$out"
      part "ours, batch $batch, $label" with_env "${variant#*=}" train_1b "$bench" "$out" "$batch" "$steps" --lr 1e-5 --lr-scheduler constant
      ab_rows+=("$label=$out")
    done
    # Each row that should give the default's bits, where it ran.
    for label in "one forward group" "32-key dq" "32-query dkv" "block op by op"; do
      if [ -d "$bench/ab-${label// /-}" ]; then
        part "$label: the default's losses" same_losses "$bench/ab-default" "$bench/ab-${label// /-}" 1e-6
      fi
    done
    median_rows "${ab_rows[@]}"
    ;;
  kernels)
    # The flash-attention kernels alone (tests/bench/gpu_flash.rs): forward and backward at the
    # bench's shapes, each variant of ours in a process of its own and PyTorch's sdpa, each under
    # the kernel profiler, whose files (${OUT:-.}/flash-<label>.txt) split the backward into dq,
    # dk/dv and the group sum; the flash kernels' lines (and PyTorch's top ones) printed here.
    prefix=${OUT:-.}/flash
    CUDA_INJECTION64_PATH=$BIN/libkernel_profile.so KERNEL_PROFILE_OUT=$prefix \
      part "flash kernels beside sdpa" timeout -k 5 "${KERNELS_LIMIT_S:-240}" "$BIN/gpu-bench" flash
    for f in "$prefix"-*.txt; do
      [ -f "$f" ] || continue
      echo "== $f"
      # By name and launch size: a process runs every shape, and the sizes tell them apart.
      case "$f" in
        *pytorch*) sed -n '/Kernels by name and launch size/,/^$/p' "$f" | head -n 14 ;;
        *) sed -n '/Kernels by name and launch size/,/^$/p' "$f" | grep -E 'flash_' ;;
      esac
    done
    ;;
  profile)
    # The bench's training run (a 1.1B Llama, bf16, seq 2048, activation checkpointing, one rank
    # under the launcher with NCCL, as the bench runs it) for PROFILE_STEPS steps under the
    # CUPTI profiler (tests/gpu/kernel_profile.c; the launcher starts no CUDA, so only the rank
    # writes it): GPU busy time, kernels, copies and driver calls, into $PROFILE_OUT (default
    # profile.txt). PROFILE_BATCH rows a step (default 1; the bench's other row is 8).
    bench_model "$bench" $((16 * ${PROFILE_BATCH:-1}))
    rm -rf "$bench/profile-out"
    CUDA_INJECTION64_PATH=$BIN/libkernel_profile.so KERNEL_PROFILE_OUT=${PROFILE_OUT:-profile.txt} \
      part "finetune under the profiler" train_1b "$bench" "$bench/profile-out" "${PROFILE_BATCH:-1}" "${PROFILE_STEPS:-4}"
    ;;
  all)
    # Each part in its own process, so that one failing still lets the others run. Each part's
    # output also goes to ${OUT:-.}/<part>.log as it runs: a call cut off at its time limit
    # still brings back what the parts printed (the device tool returns $OUT's files).
    rows=()
    # Each part has a time limit (seconds; ALL_LIMITS_S="check bench profile"), so that one that
    # hangs leaves the others their share of the call.
    read -r -a limits <<< "${ALL_LIMITS_S:-200 270 100}"
    i=0
    for p in check bench profile; do
      start=$SECONDS
      if FSDP_BENCH_STEPS=${FSDP_BENCH_STEPS:-6} PROFILE_OUT=${PROFILE_OUT:-${OUT:-.}/profile.txt} PROFILE_BATCH=${PROFILE_BATCH:-8} \
        timeout -k 5 "${limits[$i]}" bash tests/gpu/run.sh "$p" 2>&1 | tee "${OUT:-.}/$p.log"; then
        r=ok
      else
        r=FAILED
        failed+=("$p")
      fi
      rows+=("| $p | $r | $((SECONDS - start)) s |")
      i=$((i + 1))
      # Speed of kernels that fail their checks says nothing: give the rest of the call back
      # for a fix, unless told to go on (ALL_KEEP_GOING=1).
      if [ "$p" = check ] && [ "$r" = FAILED ] && [ "${ALL_KEEP_GOING:-0}" != 1 ]; then
        rows+=("| bench, profile | skipped: check failed (ALL_KEEP_GOING=1 runs them) | |")
        break
      fi
    done
    echo "== the profile's head (${PROFILE_OUT:-${OUT:-.}/profile.txt})"
    head -n 60 "${PROFILE_OUT:-${OUT:-.}/profile.txt}" || true
    echo
    echo "| part | result | time |"
    echo "|---|---|---|"
    printf '%s\n' "${rows[@]}"
    ;;
  *) echo "usage: $0 check|bench|profile|overlap|quick|ab|kernels|all" >&2; exit 2 ;;
esac
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
echo "all parts passed"
