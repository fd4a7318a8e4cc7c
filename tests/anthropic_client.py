#!/usr/bin/env python3
"""The official `anthropic` package against a running `fsdp-app serve` (tests/serve_anthropic.rs
starts it): the Messages API as Claude's SDK speaks it.

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY=k MODEL=tiny python3 tests/anthropic_client.py

Exits non-zero, naming the check, when the server answers differently from Anthropic's API.
"""
import json
import os
import sys

import anthropic

base, key, model = os.environ["BASE_URL"].removesuffix("/v1"), os.environ["API_KEY"], os.environ["MODEL"]
# The SDK sends the key as `x-api-key` and appends /v1/messages to the base URL.
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


hello = [{"role": "user", "content": "Say hello"}]
# The SDK's create() no longer takes sampling arguments (its newest models choose their own); the
# API still reads them, and clients send them in the body.
GREEDY = {"temperature": 0}

# A plain message.
msg = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=hello)
check(msg.type == "message" and msg.role == "assistant" and msg.model == model, f"message: {msg}")
check(msg.id.startswith("msg_"), f"id {msg.id}")
check([b.type for b in msg.content] == ["text"], f"content {msg.content}")
check(msg.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {msg.stop_reason}")
check(msg.usage.output_tokens > 0 and msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0, f"usage {msg.usage}")
text = msg.content[0].text

# count_tokens: the prompt's tokens as usage counts them (uncached + read from the cache).
count = client.messages.count_tokens(model=model, system="Be brief.", messages=hello)
check(count.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0), f"count_tokens {count} vs {msg.usage}")

# Streamed: the text deltas add up to the whole message; the final message matches.
with client.messages.stream(model=model, max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=hello) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
check(streamed == text, f"streamed {streamed!r} vs {text!r}")
check(final.content[0].text == text and final.stop_reason == msg.stop_reason, f"final {final}")
check(final.usage.output_tokens == msg.usage.output_tokens, f"stream usage {final.usage} vs {msg.usage}")
kinds = [e.type for e in client.messages.create(model=model, max_tokens=4, extra_body=GREEDY, messages=hello, stream=True)]
check(kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], f"events {kinds}")
check({"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds), f"events {kinds}")

# stop_sequences: the answer ends before the first one it writes, which stop_sequence names.
stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2]), None)
check(stop is not None, f"no stop sequence to try in {text!r}")
print(f"stop {stop!r} in {text!r}")
if stop is not None:
    cut = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=hello, stop_sequences=[stop])
    check(cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, f"stop: {cut}")
    check(cut.content[0].text == text[:text.index(stop)], f"stopped text {cut.content} for {stop!r} in {text!r}")

# A tool-use round trip: the call (its input held to the schema), then the result as a user turn.
tools = [{"name": "get_weather", "description": "Current weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                           "required": ["city"], "additionalProperties": False}}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
call = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY, messages=ask, tools=tools,
                              tool_choice={"type": "tool", "name": "get_weather"})
uses = [b for b in call.content if b.type == "tool_use"]
check(call.stop_reason == "tool_use" and len(uses) == 1, f"tool call: {call}")
check(uses[0].name == "get_weather" and uses[0].input.get("city") in ("Paris", "Oslo") and uses[0].id.startswith("toolu_"), f"tool_use {uses}")
with client.messages.stream(model=model, max_tokens=40, extra_body=GREEDY, messages=ask, tools=tools,
                            tool_choice={"type": "tool", "name": "get_weather"}) as stream:
    streamed_call = stream.get_final_message()
streamed_uses = [b for b in streamed_call.content if b.type == "tool_use"]
check([(b.name, b.input) for b in streamed_uses] == [(uses[0].name, uses[0].input)], f"streamed tool_use {streamed_call}")
anyone = client.messages.create(model=model, max_tokens=60, extra_body=GREEDY, messages=ask, tools=tools, tool_choice={"type": "any"})
check(anyone.stop_reason == "tool_use" and anyone.content[-1].type == "tool_use", f"tool_choice any: {anyone}")
history = ask + [{"role": "assistant", "content": call.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]}]
after = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=history, tools=tools)
check(after.type == "message" and after.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"after the tool result: {after}")
check(client.messages.count_tokens(model=model, messages=history, tools=tools).input_tokens
      > client.messages.count_tokens(model=model, messages=ask, tools=tools).input_tokens, "count_tokens with the tool turns")

# Errors in Anthropic's shape, as the SDK's exception classes.
try:
    client.messages.create(model=model, max_tokens=8, messages=ask + [{"role": "assistant", "content": "x"},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "?"}]}])
    check(False, "a tool_result that answers no tool_use was accepted")
except anthropic.BadRequestError as e:
    check(e.body["error"]["type"] == "invalid_request_error" and "tool_use_id" in e.body["error"]["message"], f"400 body {e.body}")
try:
    client.messages.create(model="no-such-model", max_tokens=8, messages=hello)
    check(False, "an unknown model was accepted")
except anthropic.NotFoundError as e:
    check(e.body["error"]["type"] == "not_found_error", f"404 body {e.body}")
try:
    anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(model=model, max_tokens=8, messages=hello)
    check(False, "a wrong key was accepted")
except anthropic.AuthenticationError as e:
    check(e.body["error"]["type"] == "authentication_error", f"401 body {e.body}")
try:
    client.messages.create(model=model, max_tokens=8, messages=hello, thinking={"type": "enabled", "budget_tokens": 4})
    check(False, "a thinking budget was accepted for a model that does not think")
except anthropic.BadRequestError as e:
    check("thinking" in e.body["error"]["message"], f"thinking 400 {e.body}")

# Adaptive thinking: this model decides not to think (no thinking block); output_config's format
# holds the answer to its schema.
plain = client.messages.create(model=model, max_tokens=12, messages=hello, thinking={"type": "adaptive"}, extra_body=GREEDY)
check([b.type for b in plain.content] == ["text"], f"adaptive thinking on a model that does not think: {plain}")
schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": False}
shaped = client.messages.create(model=model, max_tokens=40, messages=ask, extra_body=GREEDY,
                                output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
check(json.loads(shaped.content[0].text)["city"] in ("Paris", "Oslo"), f"output_config.format: {shaped}")

print("all checks passed")
