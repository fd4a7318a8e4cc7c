#!/usr/bin/env python3
"""lm-evaluation-harness against `serve`, checked against llama.cpp: each (context, continuation)
of an lm-eval samples file scored again by llama.cpp (llama-cpp-python) on the same GGUF from the
same token ids (the server's `/tokenize`, as lm-eval's remote tokenizer sends them), beside the
loglikelihood the server gave lm-eval. From the repository root:

    fsdp-app serve --model MODEL.gguf --served-model-name smol --port 8011 &
    lm_eval --model local-completions --model_args model=smol,base_url=http://127.0.0.1:8011/v1/completions \\
        --batch_size 4 --tasks tiny_mc --include_path tests/bench/lm_eval --log_samples --output_path /tmp/lm-eval
    python tests/bench/lm_eval/llama_cpp_loglikelihoods.py MODEL.gguf /tmp/lm-eval/smol/samples_tiny_mc_*.jsonl http://127.0.0.1:8011

Prints each choice's two loglikelihoods and the largest difference.
"""
import json
import sys
import urllib.request

import numpy as np
from llama_cpp import Llama

gguf, samples, base = sys.argv[1], sys.argv[2], sys.argv[3]


def tokenize(text):
    body = json.dumps({"prompt": text, "add_special_tokens": False}).encode()
    req = urllib.request.Request(base + "/tokenize", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["tokens"]


llm = Llama(model_path=gguf, logits_all=True, n_ctx=512, n_threads=2, verbose=False)
worst = 0.0
for line in open(samples):
    sample = json.loads(line)
    for k, (args, resp) in enumerate(zip(sample["arguments"].values(), sample["filtered_resps"])):
        context, continuation = tokenize(args["arg_0"]), tokenize(args["arg_1"])
        llm.reset()
        llm.eval(context + continuation)
        logits = np.array(llm.scores[: len(context) + len(continuation)], dtype=np.float64)
        top = logits.max(1, keepdims=True)
        log_sum = np.log(np.exp(logits - top).sum(1)) + top[:, 0]
        # Token i of the continuation is predicted at the position before it.
        ref = sum(logits[len(context) + i - 1, t] - log_sum[len(context) + i - 1] for i, t in enumerate(continuation))
        ours = float(resp[0])
        worst = max(worst, abs(ours - ref))
        print(f"doc {sample['doc_id']} choice {k}: fsdp-app {ours:9.4f}  llama.cpp {ref:9.4f}  diff {ours - ref:+.4f}")
print(f"largest difference {worst:.4f}")
