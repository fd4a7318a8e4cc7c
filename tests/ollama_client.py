#!/usr/bin/env python3
"""The official `ollama` package against a running `fsdp-app serve` (tests/serve_ollama.rs starts
it): chat, streamed chat, generate (templated and raw), a JSON-schema `format`, a tool-call round
trip in the history, embeddings, the model list, show, ps, and errors as `ResponseError`.

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY=k MODEL=tiny python3 tests/ollama_client.py

Exits non-zero, naming the check, when the server answers differently from Ollama's API.
"""
import json
import math
import os
import sys

import ollama

base, key, model = os.environ["BASE_URL"].removesuffix("/v1"), os.environ["API_KEY"], os.environ["MODEL"]
client = ollama.Client(host=base, headers={"Authorization": f"Bearer {key}"})


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


hello = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
GREEDY = {"temperature": 0, "num_predict": 12}

# A whole answer, then the same streamed: the pieces add up to it, the last one says why it ended.
whole = client.chat(model=model, messages=hello, options=GREEDY, stream=False)
check(whole.done and whole.done_reason in ("stop", "length") and whole.model == model, f"chat: {whole}")
check(whole.message.role == "assistant" and whole.message.content, f"message {whole.message}")
check(whole.eval_count and 0 < whole.eval_count <= 12 and whole.prompt_eval_count > 0, f"counts {whole}")
check(whole.total_duration >= whole.eval_duration > 0, f"durations {whole}")
parts = list(client.chat(model=model, messages=hello, options=GREEDY, stream=True))
check(all(not p.done for p in parts[:-1]) and parts[-1].done, f"stream done flags {parts}")
streamed = "".join(p.message.content or "" for p in parts)
check(streamed == whole.message.content, f"streamed {streamed!r} vs {whole.message.content!r}")
check(parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason, f"last part {parts[-1]}")
# `model:latest` is the served model.
check(client.chat(model=f"{model}:latest", messages=hello, options=GREEDY).message.content == whole.message.content, "name:latest")

# generate wraps the prompt in the chat template: the same answer as chat with those messages.
gen = client.generate(model=model, system="Be brief.", prompt="Say hello", options=GREEDY)
check(gen.response == whole.message.content and gen.done, f"generate {gen.response!r} vs chat {whole.message.content!r}")
raw = client.generate(model=model, prompt="Once upon a time", raw=True, options=GREEDY)
check(raw.response and raw.eval_count == 12 and raw.done_reason == "length", f"raw {raw}")
raw_streamed = "".join(p.response for p in client.generate(model=model, prompt="Once upon a time", raw=True, options=GREEDY, stream=True))
check(raw_streamed == raw.response, f"raw streamed {raw_streamed!r} vs {raw.response!r}")

# Stop strings and a schema-constrained answer.
stopped = client.generate(model=model, prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 12, "stop": [","]})
check("," not in stopped.response and stopped.done_reason == "stop", f"stop: {stopped}")
schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"]}
formatted = client.chat(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}], format=schema, options={"temperature": 0, "num_predict": 40})
check(json.loads(formatted.message.content)["answer"] in ("yes", "no"), f"format: {formatted.message.content!r}")

# A tool-call round trip in the history (arguments as objects, the result named by tool_name).
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
history = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
           {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"}]
after = client.chat(model=model, messages=history, tools=tools, options=GREEDY)
check(after.done and after.message.role == "assistant", f"after the call: {after}")

# Embeddings: unit vectors, one per input; the older route's vector points the same way.
emb = client.embed(model=model, input=["hello", "good morning"])
check(len(emb.embeddings) == 2 and all(abs(math.hypot(*v) - 1) < 1e-4 for v in emb.embeddings), "embed: unit vectors")
old = client.embeddings(model=model, prompt="hello").embedding
norm = math.hypot(*old)
check(all(abs(a / norm - b) < 1e-4 for a, b in zip(old, emb.embeddings[0])), "embeddings vs embed")

# The model list, show and ps.
names = [m.model for m in client.list().models]
check(model in names, f"list {names}")
shown = client.show(model)
check(shown.details.family == "llama" and "completion" in shown.capabilities, f"show {shown}")
check(shown.modelinfo["llama.block_count"] == 30 and "{%" in shown.template, f"show model_info / template {shown.modelinfo}")
check(model in [m.model for m in client.ps().models], "ps")

# Errors: ResponseError with the status and the message naming the field.
for call, status, names in [
    (lambda: client.chat(model="nope", messages=hello), 404, "nope"),
    (lambda: client.chat(model=model, messages=hello, options={"mirostat": 2}), 400, "mirostat"),
    (lambda: client.generate(model=model, prompt="x", suffix="y"), 400, "suffix"),
]:
    try:
        call()
        check(False, f"expected an error naming {names}")
    except ollama.ResponseError as e:
        check(e.status_code == status and names in e.error, f"error {e.status_code} {e.error!r}, expected {status} naming {names}")

print("all checks passed")
