#!/usr/bin/env python3
"""llama.cpp's infill sampler (`llama_sampler_init_infill`) on given candidates, for
`src/generate/infill_sampler.rs`' test: which candidates it leaves, with their logits. The
vocabulary is SmolLM2's with FIM tokens (make_llama_cpp_infill_reference.py's RENAMES), read by
llama-cpp-python 0.3.36 (target/llama-cpp-venv):

    LLAMA_CPP_SRC=llama_cpp_python-0.3.36/vendor/llama.cpp \\
        target/llama-cpp-venv/bin/python tests/reference/make_llama_cpp_infill_sampler_reference.py SmolLM2-135M-Instruct.Q4_1.gguf

Writes llama-cpp-infill-sampler.json next to itself: for each case the candidates (token, logit),
each candidate's text as llama.cpp's `token_to_piece` gives it (no special tokens) and whether it
ends an answer (`llama_vocab_is_eog`), the token an answer without text ends with (its EOT, else
EOS), and what the sampler left.
"""
import ctypes
import importlib.util
import json
import os
import random
import sys
import tempfile

import llama_cpp as L

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("layout", os.path.join(HERE, "make_llama_cpp_infill_reference.py"))
layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layout)


def piece(vocab, token):
    buf = ctypes.create_string_buffer(256)
    n = L.llama_token_to_piece(vocab, token, buf, 256, 0, False)
    return buf.raw[:n]


def left(vocab, candidates):
    data = (L.llama_token_data * len(candidates))()
    for i, (t, logit) in enumerate(candidates):
        data[i].id, data[i].logit, data[i].p = t, logit, 0.0
    cur = L.llama_token_data_array(data=data, size=len(candidates), selected=-1, sorted=False)
    smpl = L.llama_sampler_init_infill(vocab)
    L.llama_sampler_apply(smpl, ctypes.byref(cur))
    kept = sorted((int(cur.data[i].id), float(cur.data[i].logit)) for i in range(cur.size))
    L.llama_sampler_free(smpl)
    return kept


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "smollm2-fim.gguf")
        layout.renamed_copy(sys.argv[1], path)
        params = L.llama_model_default_params()
        params.vocab_only = True
        model = L.llama_model_load_from_file(path.encode(), params)
        vocab = L.llama_model_get_vocab(model)
        n = L.llama_vocab_n_tokens(vocab)
        by_piece = {}
        for t in range(n):
            by_piece.setdefault(piece(vocab, t), t)
        ids = lambda *texts: [by_piece[x.encode()] for x in texts]  # noqa: E731
        im_end, endoftext = 2, 0
        rng = random.Random(11)
        cases = [
            # Prefixes of one another merge into the likeliest; the end stays.
            list(zip(ids(" return", " re", " ret", " x") + [endoftext], [2.0, 1.5, 1.0, 1.8, -2.0])),
            list(zip(ids(" re", " return", " ret", " x") + [endoftext], [1.1, 0.9, 0.7, 0.88, -3.5])),
            # The ends are likely: only they are left.
            list(zip([im_end] + ids(" x", " y"), [2.0, 1.0, 0.5])),
            # No text is likely enough: the answer ends.
            list(zip(ids(" a", " b", " c", " d", " e", " f", " g", " h"), [0.0] * 8)),
            # One text stands out.
            list(zip(ids(" fib", " fi", " print") + [im_end], [3.0, 2.5, 0.5, -1.0])),
        ]
        for _ in range(6):
            tokens = rng.sample(range(17, n), 30)
            cases.append([(t, rng.gauss(0.0, 2.0)) for t in tokens])
        # Families of tokens that begin one another, at random logits.
        family = [t for p, t in by_piece.items() if p.startswith(b" ret") or p.startswith(b" fib")][:25]
        cases.append([(t, rng.gauss(0.0, 1.5)) for t in family] + [(endoftext, -1.0)])
        eot = L.llama_vocab_eot(vocab)
        end = eot if eot != -1 else L.llama_vocab_eos(vocab)
        out = []
        for candidates in cases:
            tokens = [t for t, _ in candidates]
            out.append({
                "candidates": [[t, float(logit)] for t, logit in candidates],
                "pieces": {str(t): list(piece(vocab, t)) for t in tokens},
                "ends": [t for t in tokens if L.llama_vocab_is_eog(vocab, t)],
                "left": [[t, logit] for t, logit in left(vocab, [(t, float(logit)) for t, logit in candidates])],
            })
        L.llama_model_free(model)
    with open(os.path.join(HERE, "llama-cpp-infill-sampler.json"), "w") as f:
        json.dump({"llama_cpp_python": L.__version__, "end": int(end), "cases": out}, f)
        f.write("\n")


if __name__ == "__main__":
    main()
