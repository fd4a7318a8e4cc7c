#!/usr/bin/env python3
"""The transformers side of `cargo bench --bench generation`: greedy generation of N new tokens
(batch 1, f32, CPU, a fixed thread count) on a model directory, printed as one JSON line."""
import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, prompt_json, new_tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
prompt = torch.tensor([json.loads(prompt_json)])
mask = torch.ones_like(prompt)


def run(n):
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t, out.shape[1] - prompt.shape[1]


run(4)  # warm-up
ttft, _ = run(1)
total, generated = run(new_tokens)
print(json.dumps({"ttft_s": ttft, "total_s": total, "generated": generated,
                  "decode_tokens_per_s": (generated - 1) / max(total - ttft, 1e-9),
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "threads": torch.get_num_threads()}))
