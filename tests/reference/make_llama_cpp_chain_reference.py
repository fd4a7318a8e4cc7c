#!/usr/bin/env python3
"""llama.cpp's sampler chain on given logits, for `src/generate/chain.rs`' test: which tokens its
top-k, top-p, min-p and temperature samplers leave, in a chain's order, and their probabilities
(the softmax of what is left, as its `dist` sampler draws from). With llama.cpp itself
(llama-cpp-python 0.3.36, built from source; the generation bench builds one into
target/llama-cpp-venv):

    target/llama-cpp-venv/bin/python tests/reference/make_llama_cpp_chain_reference.py

Writes llama-cpp-chain.json next to itself: for each case the logits (seeded normal values over a
vocabulary of 64), the chain as (name, value), the temperature, and the tokens left with their
probabilities, most likely first.
"""
import ctypes
import json
import math
import os

import llama_cpp as L
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 64

# (chain, temperature): llama.cpp's default order and others, the temperature first among them.
CASES = [
    ([("top_k", 40), ("top_p", 0.95), ("min_p", 0.05), ("temperature", None)], 0.8),
    ([("top_k", 40), ("top_p", 0.95), ("min_p", 0.05), ("temperature", None)], 1.7),
    ([("top_p", 0.5), ("temperature", None)], 2.0),
    ([("temperature", None), ("top_p", 0.5)], 2.0),
    ([("min_p", 0.2), ("top_k", 5), ("temperature", None)], 1.3),
    ([("temperature", None), ("min_p", 0.2)], 0.6),
    ([("top_k", 10), ("min_p", 0.1), ("top_p", 0.7), ("temperature", None)], 0.7),
    ([("top_p", 0.9), ("top_k", 3), ("temperature", None)], 1.0),
    ([("temperature", None)], 1.5),
]


def sampler(name, value, temperature):
    if name == "top_k":
        return L.llama_sampler_init_top_k(value)
    if name == "top_p":
        return L.llama_sampler_init_top_p(value, 1)
    if name == "min_p":
        return L.llama_sampler_init_min_p(value, 1)
    return L.llama_sampler_init_temp(temperature)


def left(logits, chain, temperature):
    data = (L.llama_token_data * len(logits))()
    for i, l in enumerate(logits):
        data[i].id, data[i].logit, data[i].p = i, float(l), 0.0
    cur = L.llama_token_data_array(data=data, size=len(logits), selected=-1, sorted=False)
    smpl = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    for name, value in chain:
        L.llama_sampler_chain_add(smpl, sampler(name, value, temperature))
    L.llama_sampler_apply(smpl, ctypes.byref(cur))
    kept = [(cur.data[i].id, cur.data[i].logit) for i in range(cur.size)]
    L.llama_sampler_free(smpl)
    top = max(l for _, l in kept)
    weights = [math.exp(l - top) for _, l in kept]
    total = sum(weights)
    out = sorted(((t, w / total) for (t, _), w in zip(kept, weights)), key=lambda x: -x[1])
    return [[int(t), p] for t, p in out]


def main():
    rng = np.random.default_rng(7)
    cases = []
    for chain, temperature in CASES:
        logits = (rng.standard_normal(VOCAB) * 2.0).astype(np.float32)
        cases.append({"logits": [float(x) for x in logits], "chain": chain, "temperature": temperature,
                      "left": left(logits, chain, temperature)})
    with open(os.path.join(HERE, "llama-cpp-chain.json"), "w") as f:
        json.dump({"llama_cpp_python": L.__version__, "cases": cases}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
