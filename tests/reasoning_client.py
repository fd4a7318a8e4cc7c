#!/usr/bin/env python3
"""A reasoning model's answers sent back as the `openai` and `anthropic` clients send them, against a
running `fsdp-app serve` of a thinking model (tests/serve_reasoning.rs starts it): the next turn
is answered and the past thinking is in its prompt.

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY= MODEL=tiny THINKING=... python3 tests/reasoning_client.py

Exits non-zero, naming the check, when the server refuses or drops what the client sends.
"""
import os
import sys

import anthropic
import openai

base, key, model, thinking = os.environ["BASE_URL"], os.environ["API_KEY"] or "none", os.environ["MODEL"], os.environ["THINKING"]


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


# OpenAI's client: the answer's message object appended to the conversation, as its docs show
# for multi-turn chat. The object carries the server's `reasoning_content` and `reasoning` (and
# `refusal`), and the client sends them back.
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
hi = {"role": "user", "content": "Hi"}
first = client.chat.completions.create(model=model, messages=[hi], max_tokens=40, temperature=0)
message = first.choices[0].message
extra = message.model_extra or {}
check(extra.get("reasoning_content") == thinking == extra.get("reasoning"), f"the first answer's thinking, under both names: {message}")
second = client.chat.completions.create(model=model, messages=[hi, message, hi], max_tokens=40, temperature=0)
check(second.choices[0].message.content is not None, f"the second answer: {second}")
without = {"role": "assistant", "content": message.content}
bare = client.chat.completions.create(model=model, messages=[hi, without, hi], max_tokens=1, temperature=0)
check(second.usage.prompt_tokens > bare.usage.prompt_tokens, f"the thinking is in the prompt: {second.usage} vs {bare.usage}")

# Anthropic's client: the answer's content blocks (thinking, then text) sent back as the
# assistant's turn, as its docs show for multi-turn with thinking.
claude = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=key, max_retries=0)
on = {"type": "enabled", "budget_tokens": 30}
answer = claude.messages.create(model=model, max_tokens=40, thinking=on, messages=[hi], extra_body={"temperature": 0})
check([b.type for b in answer.content] == ["thinking", "text"], f"the first answer's blocks: {answer.content}")
turns = [hi, {"role": "assistant", "content": answer.content}, hi]
nxt = claude.messages.create(model=model, max_tokens=40, thinking=on, messages=turns, extra_body={"temperature": 0})
check(nxt.content[-1].type == "text", f"the second answer: {nxt.content}")
text_only = [hi, {"role": "assistant", "content": [b for b in answer.content if b.type == "text"]}, hi]
counted = claude.messages.count_tokens(model=model, messages=turns).input_tokens
check(counted > claude.messages.count_tokens(model=model, messages=text_only).input_tokens, "the thinking block is in the prompt")
print("all checks passed")
