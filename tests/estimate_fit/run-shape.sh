#!/bin/bash
# One row of the fit behind src/train/estimate.rs's constants: a generated Llama of the given
# shape trained 2 steps (batch 2 per rank), its measured peak RSS per rank next to
# `fsdp-app estimate --json` for the same run, appended to MODE-rank.txt.
#   one: 1 rank, full fine-tuning, every layer's graph kept
#   lora: 1 rank, LoRA r=8 on every projection, every layer's graph kept
#   two: 2 ranks under `fsdp-app launch` (tcp), LoRA r=8 on every projection, activation
#        checkpointing (tests/estimate.rs's two-rank runs)
# usage: run-shape.sh one|lora|two name hidden inter layers vocab heads kvheads seq
# The release binary by default (what users run; the debug build's peaks are within noise of it).
set -e
B=${FSDP_APP:-target/release/fsdp-app}; B=$(realpath "$B")
FIT=$(realpath "$(dirname "$0")")
mode=$1 n=$2; shift 2
mkdir -p "${FIT_DIR:-/tmp/estimate-fit}"; cd "${FIT_DIR:-/tmp/estimate-fit}"
[ -d m_$n ] || $B fixture --name llama --out m_$n --set hidden_size=$1 --set intermediate_size=$2 --set num_hidden_layers=$3 \
  --set vocab_size=$4 --set num_attention_heads=$5 --set num_key_value_heads=$6 --set head_dim=64 --set max_position_embeddings=1024 >/dev/null
seq=$7
[ -f rows_$seq.jsonl ] || python3 -c "
import json
rows=[json.dumps({'input_ids':[(i*7+j*13)%384 for j in range($seq)],'labels':[(i*7+j*13)%384 for j in range($seq)]}) for i in range(16)]
open('rows_$seq.jsonl','w').write('\n'.join(rows))"
out=o_${mode}_${n}_$seq; rm -rf $out
common=(--model m_$n --max-steps 2 --lr 1e-4 --batch-size 2 --seq-len $seq)
lora=(--lora-r 8 --lora-targets all-linear)
if [ "$mode" = one ] || [ "$mode" = lora ]; then
  extra=(); [ "$mode" = lora ] && extra=("${lora[@]}")
  $B finetune "${common[@]}" "${extra[@]}" --output-dir $out --data rows_$seq.jsonl >/dev/null 2>&1
  est=$($B estimate --model m_$n --batch-size 2 --seq-len $seq "${extra[@]}" --json)
else
  two=(--activation-checkpointing "${lora[@]}")
  $B launch --nproc-per-node 2 --master-port $((20000 + RANDOM % 20000)) -- finetune "${common[@]}" "${two[@]}" --output-dir $out --data rows_$seq.jsonl >/dev/null 2>&1
  est=$($B estimate --model m_$n --world-size 2 --batch-size 2 --seq-len $seq "${two[@]}" --json)
fi
meas=$(tail -1 $out/metrics.jsonl | python3 -c "import json,sys; print(*json.load(sys.stdin)['peak_rss_bytes_per_rank'])")
echo "$n $* $meas $est" >> "$FIT/$mode-rank.txt"
