#!/usr/bin/env python3
"""LangChain's `bind_tools` under `tool_choice: auto` against a running `fsdp-app serve` of a
model that writes its own call format (tests/serve_tool_calls.rs starts it): the call comes back
as the AIMessage's `tool_calls`, whole and streamed; a greeting as text. `CLIENT=ollama` runs
the same through `ChatOllama` (langchain-ollama, Ollama's `/api/chat`) instead of `ChatOpenAI`.

    BASE_URL=... API_KEY=... MODEL=tiny TOOLS='[...]' QUESTION=... REPLY=... [CLIENT=ollama] python3 tests/langchain_tools.py
"""
import json
import os
import sys

base, key, model = os.environ["BASE_URL"], os.environ["API_KEY"], os.environ["MODEL"]
tools, question, reply = json.loads(os.environ["TOOLS"]), os.environ["QUESTION"], os.environ["REPLY"]


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


if os.environ.get("CLIENT") == "ollama":
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=model, base_url=base.removesuffix("/v1"), temperature=0, num_predict=120,
                     client_kwargs={"headers": {"Authorization": f"Bearer {key}"}})
else:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=base, api_key=key, temperature=0, max_tokens=120, max_retries=0)
bound = llm.bind_tools(tools)
msg = bound.invoke(question)
check([(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Paris"})], f"invoke: {msg}")
streamed = None
for chunk in bound.stream(question):
    streamed = chunk if streamed is None else streamed + chunk
check([(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "Paris"})], f"stream: {streamed}")
text = bound.invoke("Hi")
check(text.content == reply and not text.tool_calls, f"text answer: {text}")
print("all checks passed")
