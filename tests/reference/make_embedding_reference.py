#!/usr/bin/env python3
"""Regenerates embeddings-qwen3.json: sentence-transformers' embeddings of a few texts by the
`qwen3-embedding` fixture (a bare Qwen3Model with last-token pooling, laid out as Qwen3-Embedding
is), and transformers' mean-pooled ones, which tests/serve_embeddings.rs compares the server's
against.

    cargo build --release
    python3 -m pip install torch transformers sentence-transformers
    python3 tests/reference/make_embedding_reference.py [--bin target/release/fsdp-app]

sentence-transformers reads the fixture's modules.json and 1_Pooling/config.json itself, so the
reference checks the layout as well as the numbers. The fixture is not committed: `fsdp-app
fixture` rebuilds it bit-identically.
"""
import argparse
import json
import os
import subprocess
import tempfile

import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Sharded data parallel training splits parameters across ranks.",
]

parser = argparse.ArgumentParser()
parser.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "fsdp-app"))
args = parser.parse_args()
with tempfile.TemporaryDirectory() as tmp:
    model_dir = os.path.join(tmp, "emb")
    subprocess.run([args.bin, "fixture", "--name", "qwen3-embedding", "--out", model_dir], check=True)
    model = SentenceTransformer(model_dir, device="cpu")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        vectors = model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=False, batch_size=1)
        # `serve --pooling mean` over the same states: transformers' hidden states, averaged.
        bare = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
        means = [torch.nn.functional.normalize(bare(torch.tensor([tokenizer(t)["input_ids"]])).last_hidden_state[0].mean(0), dim=0)
                 for t in TEXTS]
    out = {
        "model": "qwen3-embedding fixture",
        "pooling": "lasttoken (from 1_Pooling/config.json), normalised (2_Normalize)",
        "texts": [{"text": t, "ids": tokenizer(t)["input_ids"], "embedding": [round(float(x), 7) for x in v],
                   "mean_pooled": [round(float(x), 7) for x in m]}
                  for t, v, m in zip(TEXTS, vectors, means)],
    }
with open(os.path.join(HERE, "embeddings-qwen3.json"), "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print("wrote", os.path.join(HERE, "embeddings-qwen3.json"))
