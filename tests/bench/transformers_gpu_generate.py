#!/usr/bin/env python3
"""The transformers side of the GPU generation benchmark (tests/bench/gpu.rs): greedy
generation of N new tokens after a fixed prompt, bf16 on GPU 0, batch B copies of the prompt;
decode tokens/s of all sequences together (time to first token subtracted), one JSON line.

usage: transformers_gpu_generate.py MODEL_DIR BATCH PROMPT_LEN NEW_TOKENS
"""
import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

model_dir, batch, prompt_len, new_tokens = sys.argv[1], *map(int, sys.argv[2:5])
vocab = 32000
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
prompt = torch.tensor([[(j * 104729 + 17) % vocab for j in range(prompt_len)]] * batch, device="cuda")
mask = torch.ones_like(prompt)


def run(n):
    with torch.inference_mode():
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out.shape[1] - prompt.shape[1]


run(4)  # warm-up
ttft = sorted(run(1)[0] for _ in range(3))[1]
totals = sorted(run(new_tokens)[0] for _ in range(3))
total = totals[1]
print(json.dumps({"decode_tokens_per_s": batch * (new_tokens - 1) / max(total - ttft, 1e-9), "total_s": total,
                  "ttft_s": ttft, "torch": torch.__version__, "transformers": transformers.__version__}))
