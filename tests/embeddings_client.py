#!/usr/bin/env python3
"""The `openai` package and LangChain's `OpenAIEmbeddings` against a running `fsdp-app serve`
of an embedding model (tests/serve_embeddings.rs starts it).

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY=k MODEL=tiny python3 tests/embeddings_client.py

Exits non-zero, naming the check, when the server answers differently from OpenAI's API.
"""
import math
import os
import sys

import openai
from langchain_openai import OpenAIEmbeddings

base, key, model = os.environ["BASE_URL"], os.environ["API_KEY"], os.environ["MODEL"]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def close(a, b):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-6


texts = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?", "Paris."]
# The client asks for base64 unless told otherwise and decodes it itself (with numpy).
b64 = client.embeddings.create(model=model, input=texts)
floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
check(b64.object == "list" and [d.index for d in b64.data] == [0, 1, 2], f"list: {b64}")
check(all(close(a.embedding, b.embedding) for a, b in zip(b64.data, floats.data)), "base64 and float decode to the same vectors")
one_by_one = [client.embeddings.create(model=model, input=t, encoding_format="float").data[0].embedding for t in texts]
check(all(close(a, b.embedding) for a, b in zip(one_by_one, floats.data)), "a batch embeds as its texts one by one")
v = floats.data[0].embedding
check(abs(sum(x * x for x in v) - 1) < 1e-5, "vectors have unit length")
check(abs(sum(x * y for x, y in zip(v, v)) - 1) < 1e-5, "a text's cosine with itself is 1")
check(floats.usage.prompt_tokens > 0 and floats.usage.total_tokens == floats.usage.prompt_tokens, f"usage {floats.usage}")
try:
    client.embeddings.create(model=model, input="hi", dimensions=8)
    check(False, "dimensions was accepted by a model without Matryoshka sizes")
except openai.BadRequestError as e:
    check(e.body["param"] == "dimensions", f"dimensions 400: {e.body}")

# LangChain as RAG code uses it; a server that is not OpenAI's is given its texts as text
# (`check_embedding_ctx_length=False`: no tiktoken, which knows only OpenAI's models).
lc = OpenAIEmbeddings(model=model, base_url=base, api_key=key, check_embedding_ctx_length=False)
docs = lc.embed_documents(texts)
check(all(close(a, b.embedding) for a, b in zip(docs, floats.data)), "LangChain's embed_documents")
query = lc.embed_query(texts[1])
check(close(query, floats.data[1].embedding), "LangChain's embed_query")
cos = sum(x * y for x, y in zip(docs[1], docs[2])) / math.sqrt(sum(x * x for x in docs[1]) * sum(x * x for x in docs[2]))
check(-1.0 <= cos <= 1.0, f"cosine {cos}")

print("all checks passed")
