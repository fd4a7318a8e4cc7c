#!/bin/bash
# One row of the fit behind src/train/estimate.rs constants: a 1-rank full fine-tune of a
# generated Llama of the given shape (2 steps, batch 2), its measured peak RSS next to the
# estimate as JSON, appended to results.txt. fit.py fits the constants on the rows.
# usage: run.sh name hidden inter layers vocab heads kvheads seq
B=${FSDP_APP:-target/debug/fsdp-app}; B=$(realpath "$B")
mkdir -p "${FIT_DIR:-/tmp/estimate-fit}"; cd "${FIT_DIR:-/tmp/estimate-fit}"
n=$1; shift
[ -d m_$n ] || $B fixture --name llama --out m_$n --set hidden_size=$1 --set intermediate_size=$2 --set num_hidden_layers=$3 --set vocab_size=$4 --set num_attention_heads=$5 --set num_key_value_heads=$6 --set head_dim=64 >/dev/null
seq=$7
python3 -c "
import json
rows=[json.dumps({'input_ids':[(i*7+j*13)%384 for j in range($seq)],'labels':[(i*7+j*13)%384 for j in range($seq)]}) for i in range(16)]
open('rows_$seq.jsonl','w').write('\n'.join(rows))"
rm -rf "o_${n}_$seq"
$B finetune --model m_$n --output-dir o_${n}_$seq --data rows_$seq.jsonl --max-steps 2 --lr 1e-4 --batch-size 2 --seq-len $seq >/dev/null 2>&1 || echo FAIL
meas=$(tail -1 o_${n}_$seq/metrics.jsonl | python3 -c "import json,sys; print(json.load(sys.stdin)['peak_rss_bytes_per_rank'][0])")
est=$($B estimate --model m_$n --batch-size 2 --seq-len $seq --json)
echo "$n $* $meas $est" >> results.txt
