#!/usr/bin/env python3
"""Cohere's Python client (v1 and v2) reranking against a running `fsdp-app serve` of an
embedding model (tests/serve_embeddings.rs starts it), as vLLM's docs show for its rerank API:
the documents come back best first, the query's own text at the top with a score of 1.

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY= MODEL=tiny QUERY=... DOCUMENTS='[...]' python3 tests/rerank_client.py

Exits non-zero, naming the check, when the client fails or the order is wrong.
"""
import json
import os
import sys

import cohere

base, key, model = os.environ["BASE_URL"], os.environ["API_KEY"] or "none", os.environ["MODEL"]
query = os.environ["QUERY"]
documents = [d if isinstance(d, str) else d["text"] for d in json.loads(os.environ["DOCUMENTS"])]
root = base.removesuffix("/v1")


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


for name, client in (("v1", cohere.Client(api_key=key, base_url=root)), ("v2", cohere.ClientV2(api_key=key, base_url=root))):
    r = client.rerank(model=model, query=query, documents=documents, top_n=3)
    scores = [x.relevance_score for x in r.results]
    check(len(r.results) == 3 and scores == sorted(scores, reverse=True), f"{name}: best first: {r}")
    best = r.results[0]
    check(documents[best.index] == query and abs(best.relevance_score - 1.0) < 1e-4, f"{name}: the query's own text first: {r}")

print("all checks passed")
