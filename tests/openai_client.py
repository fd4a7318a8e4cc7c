#!/usr/bin/env python3
"""The official `openai` package against a running `fsdp-app serve` (tests/serve.rs starts it).

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY=k MODEL=tiny python3 tests/openai_client.py

Exits non-zero, naming the check, when the server answers differently from OpenAI's API.
"""
import os
import sys
import time

import openai

base, key, model = os.environ["BASE_URL"], os.environ["API_KEY"], os.environ["MODEL"]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


models = client.models.list()
check([m.id for m in models.data] == [model], f"models.list: {models}")

msgs = [{"role": "user", "content": "Say hello"}]
chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
check(chat.object == "chat.completion" and chat.choices[0].message.role == "assistant", f"chat: {chat}")
check(chat.choices[0].finish_reason in ("stop", "length"), "finish_reason")
check(chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens, "usage")

stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
pieces, usage, finish = [], None, None
for chunk in stream:
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        finish = c.finish_reason or finish
check("".join(pieces) == chat.choices[0].message.content, f"streamed {''.join(pieces)!r} vs {chat.choices[0].message.content!r}")
check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, f"stream usage {usage}")
check(finish == chat.choices[0].finish_reason, "stream finish_reason")

comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
check(comp.object == "text_completion" and len(comp.choices) == 1, f"completions: {comp}")
check(len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens or comp.choices[0].finish_reason == "stop", "logprobs")
pieces = [c.choices[0].text for c in client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True)]
check("".join(pieces) == comp.choices[0].text, "streamed completion")

# vLLM's extensions through the client's extra_body (as vLLM's docs show): ignore_eos runs to
# max_tokens (best_of: tests/serve_vllm_params.rs; this server admits one sequence at a time).
long = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0, extra_body={"ignore_eos": True, "min_tokens": 4})
check(long.usage.completion_tokens == 24 and long.choices[0].finish_reason == "length", f"ignore_eos: {long}")

for exc, call in [
    (openai.BadRequestError, lambda: client.chat.completions.create(model=model, messages=msgs, temperature=5)),
    (openai.BadRequestError, lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=100000)),
    (openai.NotFoundError, lambda: client.chat.completions.create(model="no-such-model", messages=msgs)),
    (openai.AuthenticationError, lambda: openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()),
]:
    try:
        call()
        check(False, f"expected {exc.__name__}")
    except exc as e:
        check(e.body is not None and "message" in e.body, f"{exc.__name__} body {e.body}")

# Structured output: every answer to a strict JSON schema parses and validates, at any
# temperature, streamed or not (the schema bounds each value, so the random test model finishes).
import json
import urllib.error
import urllib.request

import jsonschema

person = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}, "ok": {"type": "boolean"}}}
rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
for prompt in ["Describe a person as JSON.", "hi", "Name, age, tags?"]:
    for temperature in [0, 0.8, 1.6]:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=120,
                                             temperature=temperature, seed=7, response_format=rf)
        text = out.choices[0].message.content
        check(out.choices[0].finish_reason == "stop", f"json_schema answer did not finish: {text!r}")
        try:
            jsonschema.validate(json.loads(text), person)
        except Exception as e:
            check(False, f"json_schema answer {text!r} (temperature {temperature}): {e}")
stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=120, temperature=0, response_format=rf, stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=120, temperature=0, response_format=rf).choices[0].message.content
check(streamed == whole, f"streamed json_schema {streamed!r} vs {whole!r}")
jsonschema.validate(json.loads(streamed), person)
# json_object: any object. "}" gets +100, yet the answer cannot start with it; then it closes.
req = urllib.request.Request(base.removesuffix("/v1") + "/tokenize", json.dumps({"prompt": "}", "add_special_tokens": False}).encode(),
                             {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
close = json.load(urllib.request.urlopen(req))["tokens"]
check(len(close) == 1, f"'}}' is one token: {close}")
obj = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=1, response_format={"type": "json_object"},
                                     logit_bias={str(close[0]): 100}).choices[0].message.content
check(isinstance(json.loads(obj), dict), f"json_object answer {obj!r}")

# logit_bias -100 on the greedy answer's first token (every id with its text) moves the answer;
# echo + logprobs scores the prompt too, its first token null.
def server_json(path, body):
    req = urllib.request.Request(base.removesuffix("/v1") + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    return json.load(urllib.request.urlopen(req))
greedy = client.completions.create(model=model, prompt="Once upon a time", max_tokens=1, temperature=0, logprobs=0)
first = greedy.choices[0].logprobs.tokens[0]
same, i = [], 0
while True:  # every token id, until /detokenize says the id is past the vocabulary (400)
    try:
        text = server_json("/detokenize", {"tokens": [i]})["prompt"]
    except urllib.error.HTTPError as e:
        check(e.code == 400 and i > 0, f"/detokenize {i}: {e}")
        break
    if text == first:
        same.append(i)
    i += 1
check(same, f"the greedy token {first!r} has an id")
banned = client.completions.create(model=model, prompt="Once upon a time", max_tokens=1, temperature=0, logprobs=0,
                                   logit_bias={str(i): -100 for i in same})
check(banned.choices[0].logprobs.tokens[0] != first, f"logit_bias -100 left {first!r} first")
echoed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, temperature=0, echo=True, logprobs=1)
lp = echoed.choices[0].logprobs
prompt_len = len(server_json("/tokenize", {"prompt": "Once upon a time"})["tokens"])
check(echoed.choices[0].text.startswith("Once upon a time"), f"echo: {echoed.choices[0].text!r}")
check(len(lp.tokens) == prompt_len + echoed.usage.completion_tokens and lp.token_logprobs[0] is None
      and all(x is not None for x in lp.token_logprobs[1:]) and len(lp.text_offset) == len(lp.tokens), f"echo logprobs: {lp}")

# Function calling. A named function and `required` are constrained to the parameter schema:
# the arguments parse and validate, whatever the (random) model would have said.
weather = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}
time_of = {"type": "object", "additionalProperties": False, "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": weather}},
         {"type": "function", "function": {"name": "get_time", "parameters": time_of}}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
named = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=60, temperature=1,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
msg = named.choices[0].message
check(named.choices[0].finish_reason == "tool_calls" and msg.tool_calls and len(msg.tool_calls) == 1, f"named tool call: {named}")
call = msg.tool_calls[0]
check(call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather", f"named call {call}")
jsonschema.validate(json.loads(call.function.arguments), weather)
for parallel in [True, False]:
    req = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required", parallel_tool_calls=parallel,
                                         max_tokens=100, temperature=0.9, seed=11)
    calls, finish = req.choices[0].message.tool_calls, req.choices[0].finish_reason
    # One call ends the answer; a list of them ends when the (random) model closes it, or is cut
    # by max_tokens keeping its complete calls.
    ended = finish == "tool_calls" or (parallel and finish == "length")
    check(ended and calls and (parallel or len(calls) == 1), f"required (parallel {parallel}): {req}")
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), weather if c.function.name == "get_weather" else time_of)
# Streamed: delta.tool_calls chunks whose argument fragments concatenate to the JSON.
stream = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=60, temperature=1, stream=True,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
name, args, finish = None, "", None
for chunk in stream:
    for c in chunk.choices:
        for tc in c.delta.tool_calls or []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
        finish = c.finish_reason or finish
check(name == "get_weather" and finish == "tool_calls", f"streamed tool call {name} {finish}")
jsonschema.validate(json.loads(args), weather)
# `required`, parallel, streamed as OpenAI streams calls: each call's first chunk carries index,
# id, type and name; its arguments come in several fragments that concatenate to exactly the
# arguments of the same answer not streamed (same seed).
kwargs = dict(model=model, messages=ask, tools=tools, tool_choice="required", max_tokens=100, temperature=0.9, seed=11)
whole_answer = client.chat.completions.create(**kwargs).choices[0]
whole = whole_answer.message.tool_calls
calls, fragments = {}, 0
for chunk in client.chat.completions.create(stream=True, **kwargs):
    for c in chunk.choices:
        for tc in c.delta.tool_calls or []:
            if tc.index not in calls:
                check(tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name, f"a call's first chunk: {tc}")
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                check(tc.function.name is None, f"the name comes once: {tc}")
            if tc.function.arguments:
                calls[tc.index]["arguments"] += tc.function.arguments
                fragments += 1
        finish = c.finish_reason or finish
streamed = [calls[i] for i in sorted(calls)]
check([(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in whole],
      f"streamed calls {streamed} vs {whole}")
check(fragments > len(streamed) and finish == whole_answer.finish_reason, f"{fragments} fragments, finish {finish} vs {whole_answer.finish_reason}")
# A conversation with a call and its result goes on; `auto` may answer in text.
history = ask + [{"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
follow = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=8, temperature=0)
check(follow.choices[0].finish_reason in ("stop", "length", "tool_calls"), f"after a tool result: {follow}")
check(follow.choices[0].message.content is not None or follow.choices[0].message.tool_calls, f"after a tool result: {follow}")

# Schemas as clients write them (LangChain's bind_tools sends none of `additionalProperties`):
# the server closes what the schema leaves open, so the arguments hold the declared keys only,
# each once, and an integer fits 64 bits; checked with the schema closed by hand.
def closed(schema):
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        if out.get("type") == "integer":
            out.setdefault("minimum", -2**63)
            out.setdefault("maximum", 2**63 - 1)
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


silent = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}}}
silent_tools = [{"type": "function", "function": {"name": "forecast", "parameters": silent}}]
for temperature in [0, 0.8, 1.5]:
    r = client.chat.completions.create(model=model, messages=ask, tools=silent_tools, max_tokens=80, temperature=temperature, seed=5,
                                       tool_choice={"type": "function", "function": {"name": "forecast"}})
    calls = r.choices[0].message.tool_calls
    check(r.choices[0].finish_reason == "tool_calls" and calls, f"silent schema, named, t={temperature}: {r}")
    jsonschema.validate(json.loads(calls[0].function.arguments), closed(silent))
    r = client.chat.completions.create(model=model, messages=ask, max_tokens=80, temperature=temperature, seed=5,
                                       response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": silent}})
    check(r.choices[0].finish_reason == "stop", f"silent schema, response_format, t={temperature}: {r}")
    jsonschema.validate(json.loads(r.choices[0].message.content), closed(silent))
r = client.chat.completions.create(model=model, messages=ask, tools=silent_tools, tool_choice="required", parallel_tool_calls=False,
                                   max_tokens=80, temperature=0.8, seed=5)
check(r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls, f"silent schema, required: {r}")
jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), closed(silent))

# $defs and $ref (pydantic writes one for every nested model) resolve against the function's own
# parameters under every choice, and in response_format.
nested = {"$defs": {"Unit": {"enum": ["C", "F"]},
                    "Place": {"type": "object", "required": ["city", "unit"],
                              "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"$ref": "#/$defs/Unit"}}}},
          "type": "object", "required": ["where"], "properties": {"where": {"$ref": "#/$defs/Place"}}}
nested_tools = [{"type": "function", "function": {"name": "lookup", "parameters": nested}}, tools[1]]
for choice, parallel in [({"type": "function", "function": {"name": "lookup"}}, True), ("required", False), ("required", True)]:
    r = client.chat.completions.create(model=model, messages=ask, tools=nested_tools, tool_choice=choice, parallel_tool_calls=parallel,
                                       max_tokens=150, temperature=0.7, seed=2)
    calls = r.choices[0].message.tool_calls
    check(r.choices[0].finish_reason == "tool_calls" and calls, f"$defs under {choice} (parallel {parallel}): {r}")
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), nested if c.function.name == "lookup" else time_of)
r = client.chat.completions.create(model=model, messages=ask, max_tokens=150, temperature=0.7, seed=2,
                                   response_format={"type": "json_schema", "json_schema": {"name": "lookup", "schema": nested}})
jsonschema.validate(json.loads(r.choices[0].message.content), nested)
# `$ref: "#"` (a recursive schema) compiles under `required` too: the wrapper keeps the root.
tree = {"type": "object", "required": ["label"], "properties": {"label": {"type": "string", "maxLength": 6},
                                                                "child": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}}
r = client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0, tool_choice="required",
                                   tools=[{"type": "function", "function": {"name": "tree", "parameters": tree}}])
check(r.choices[0].finish_reason in ("tool_calls", "length"), f"$ref '#' under required: {r}")

# `tools` and a `response_format` together (the Agents SDK sends both for an agent with tools and
# an output_type): a forced call decides the answer; under `auto` the answer is one call or the
# format's JSON, each valid against its own schema ($defs on both sides; that the grammar takes
# both is a unit test in src/serve/tools.rs, that SmolLM2 writes both tests/agent_libraries.py).
r = client.chat.completions.create(model=model, messages=ask, tools=nested_tools, tool_choice={"type": "function", "function": {"name": "lookup"}},
                                   max_tokens=150, temperature=0.7, seed=2,
                                   response_format={"type": "json_schema", "json_schema": {"name": "lookup", "schema": nested}})
check(r.choices[0].message.tool_calls and r.choices[0].message.content is None, f"forced call with response_format: {r}")
for seed in range(4):
    r = client.chat.completions.create(model=model, messages=ask, tools=nested_tools, tool_choice="auto", max_tokens=150,
                                       temperature=1, seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": tree}})
    m = r.choices[0].message
    check(r.choices[0].finish_reason in ("tool_calls", "stop"), f"auto with response_format (seed {seed}): {r}")
    if m.tool_calls:
        check(len(m.tool_calls) == 1 and m.content is None, f"auto with response_format (seed {seed}): {m}")
        c = m.tool_calls[0]
        jsonschema.validate(json.loads(c.function.arguments), nested if c.function.name == "lookup" else time_of)
    else:
        jsonschema.validate(json.loads(m.content), tree)

# Fields clients send that change nothing here are accepted; a message's name too.
named_msgs = [{"role": "user", "name": "alice", "content": "Say hello"}]
r = client.chat.completions.create(model=model, messages=named_msgs, max_tokens=4, temperature=0, store=False, metadata={"run": "t"},
                                   service_tier="auto", user="u1", modalities=["text"], reasoning_effort="low",
                                   extra_body={"prompt_cache_key": "k", "safety_identifier": "s"})
check(r.choices[0].finish_reason in ("stop", "length"), f"no-op fields: {r}")
for param, kwargs in [("modalities", {"modalities": ["text", "audio"]}), ("reasoning_effort", {"reasoning_effort": "extreme"})]:
    try:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=2, **kwargs)
        check(False, f"expected BadRequestError for {param}")
    except openai.BadRequestError as e:
        check(e.body.get("param") == param, f"{param}: {e.body}")

# The Responses API: the same engine behind items in, items out, and a typed event stream.
resp = client.responses.create(model=model, input="Say hello", max_output_tokens=8, temperature=0)
check(resp.object == "response" and resp.status in ("completed", "incomplete") and resp.output[0].type == "message", f"responses: {resp}")
check(resp.output_text == resp.output[0].content[0].text and resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens,
      f"responses text/usage: {resp}")
events = list(client.responses.create(model=model, input="Say hello", max_output_tokens=8, temperature=0, stream=True))
kinds = [e.type for e in events]
check(kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete"), f"events {kinds}")
check([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
check("".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text, f"streamed text {kinds}")
check(events[-1].response.output_text == resp.output_text, "the final response of the stream")
rtools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": weather}]
r = client.responses.create(model=model, input="What is the weather in Paris?", tools=rtools, tool_choice="required", max_output_tokens=80, temperature=0.7)
calls = [o for o in r.output if o.type == "function_call"]
check(calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_"), f"responses call: {r}")
jsonschema.validate(json.loads(calls[0].arguments), weather)
items = [{"role": "user", "content": "What is the weather in Paris?"},
         {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
         {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}]
follow = client.responses.create(model=model, input=items, instructions="Answer briefly.", tools=rtools, max_output_tokens=8, temperature=0)
check(follow.status in ("completed", "incomplete") and follow.output, f"after a function call's output: {follow}")
events = list(client.responses.create(model=model, input="Weather in Rome?", tools=rtools, tool_choice={"type": "function", "name": "get_weather"},
                                      max_output_tokens=80, temperature=0.7, stream=True))
added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
done = [e for e in events if e.type == "response.function_call_arguments.done"]
check(added and added[0].item.name == "get_weather" and done and "".join(pieces) == done[0].arguments and len(pieces) > 1,
      f"streamed function call events: {[e.type for e in events]}")
jsonschema.validate(json.loads(done[0].arguments), weather)
check(events[-1].response.output[0].arguments == done[0].arguments, "the stream's final response holds the call")
r = client.responses.create(model=model, input="A person", max_output_tokens=200, temperature=0.8,
                            text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}})
jsonschema.validate(json.loads(r.output_text), person)
for param, call in [
    ("previous_response_id", lambda: client.responses.create(model=model, input="x", previous_response_id="resp_1")),
    ("store", lambda: client.responses.create(model=model, input="x", store=True)),
    ("foo_bar", lambda: client.responses.create(model=model, input="x", extra_body={"foo_bar": 1})),
    ("input[0].type", lambda: client.responses.create(model=model, input=[{"type": "computer_call_output", "call_id": "c1", "output": {}}])),
]:
    try:
        call()
        check(False, f"expected BadRequestError for {param}")
    except openai.BadRequestError as e:
        check(e.body.get("param") == param, f"{param}: {e.body}")

# What the server does not implement is a BadRequestError naming it, never a silent 200.
for param, call in [
    ("foo_bar", lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=2, extra_body={"foo_bar": 1})),
    ("store", lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=2, store=True)),
    ("suffix", lambda: client.completions.create(model=model, prompt="x", max_tokens=2, suffix="y")),
]:
    try:
        call()
        check(False, f"expected BadRequestError for {param}")
    except openai.BadRequestError as e:
        check(e.body.get("param") == param and param in e.body.get("message", ""), f"{param}: {e.body}")

# Fine-tuning: upload, create, wait, events, list, chat with the result, cancel another.
uploaded = client.files.create(file=open(os.environ["TRAIN_FILE"], "rb"), purpose="fine-tune")
check(uploaded.id.startswith("file-") and uploaded.purpose == "fine-tune", f"files.create: {uploaded}")
small = {"fsdp_app": {"seq_len": 128, "max_steps": 2}}
job = client.fine_tuning.jobs.create(model=model, training_file=uploaded.id, suffix="py",
                                     hyperparameters={"n_epochs": 1, "batch_size": 1}, extra_body=small)
check(job.object == "fine_tuning.job" and job.status in ("queued", "running"), f"jobs.create: {job}")
deadline = time.time() + 300
while True:
    got = client.fine_tuning.jobs.retrieve(job.id)
    if got.status in ("succeeded", "failed", "cancelled"):
        break
    check(time.time() < deadline, f"the job did not finish: {got}")
    time.sleep(0.5)
check(got.status == "succeeded" and got.fine_tuned_model == f"ft:{model}:py:{job.id}", f"jobs.retrieve: {got}")
events = client.fine_tuning.jobs.list_events(job.id, limit=50)
check(any("training loss" in e.message for e in events.data), f"list_events: {[e.message for e in events.data]}")
check(any(j.id == job.id for j in client.fine_tuning.jobs.list(limit=10).data), "jobs.list")
check(any(m.id == got.fine_tuned_model for m in client.models.list().data), "the fine-tuned model is listed")
answer = client.chat.completions.create(model=got.fine_tuned_model, messages=msgs, max_tokens=3)
check(answer.model == got.fine_tuned_model, f"chat with the fine-tuned model: {answer}")
for param, extra in [("method.reinforcement.grader", {"method": {"type": "reinforcement"}}), ("training_file", {"method": {"type": "dpo"}}),
                     ("integrations", {"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}),
                     ("fsdp_app.foo", {"fsdp_app": {"foo": 1}})]:
    try:
        client.fine_tuning.jobs.create(model=model, training_file=uploaded.id, extra_body=extra)
        check(False, f"expected BadRequestError for {param}")
    except openai.BadRequestError as e:
        check(e.body.get("param") == param, f"{param}: {e.body}")
# DPO through the client's own `method` argument, on an uploaded file of OpenAI's DPO rows.
pair_rows = "".join(json.dumps({"input": {"messages": [{"role": "user", "content": f"Say {w}"}]},
                                "preferred_output": [{"role": "assistant", "content": w}],
                                "non_preferred_output": [{"role": "assistant", "content": "No."}]}) + "\n"
                    for w in ["red", "green", "blue", "white"])
pairs = client.files.create(file=("pairs.jsonl", pair_rows.encode()), purpose="fine-tune")
dpo_job = client.fine_tuning.jobs.create(model=model, training_file=pairs.id, suffix="pydpo", extra_body=small,
                                         method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1, "batch_size": 2}}})
check(dpo_job.method.type == "dpo" and dpo_job.method.dpo.hyperparameters.beta == 0.2, f"a DPO job: {dpo_job.method}")
deadline = time.time() + 300
while (dpo_done := client.fine_tuning.jobs.retrieve(dpo_job.id)).status not in ("succeeded", "failed", "cancelled"):
    check(time.time() < deadline, f"the DPO job did not finish: {dpo_done}")
    time.sleep(0.5)
check(dpo_done.status == "succeeded", f"the DPO job: {dpo_done}")
answer = client.chat.completions.create(model=dpo_done.fine_tuned_model, messages=msgs, max_tokens=3)
check(answer.model == dpo_done.fine_tuned_model, f"chat with the DPO model: {answer}")
# Reinforcement fine-tuning through the client's own `method` argument: OpenAI's RFT rows and a grader.
rft_rows = "".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}"}], "answer": w}) + "\n"
                   for w in ["red", "green", "blue", "white"])
prompts = client.files.create(file=("rft.jsonl", rft_rows.encode()), purpose="fine-tune")
grader = {"type": "string_check", "name": "said", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "ilike"}
rft_job = client.fine_tuning.jobs.create(
    model=model, training_file=prompts.id, suffix="pyrft",
    extra_body={"fsdp_app": {"seq_len": 128, "max_steps": 1, "max_completion_length": 8}},
    method={"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": {"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.25}}})
check(rft_job.method.type == "reinforcement" and rft_job.method.reinforcement.grader.type == "string_check"
      and rft_job.method.reinforcement.grader.operation == "ilike", f"a reinforcement job: {rft_job.method}")
deadline = time.time() + 300
while (rft_done := client.fine_tuning.jobs.retrieve(rft_job.id)).status not in ("succeeded", "failed", "cancelled"):
    check(time.time() < deadline, f"the reinforcement job did not finish: {rft_done}")
    time.sleep(0.5)
check(rft_done.status == "succeeded", f"the reinforcement job: {rft_done}")
rft_events = client.fine_tuning.jobs.list_events(rft_job.id, limit=50)
check(any("mean reward=" in e.message for e in rft_events.data), f"reinforcement events: {[e.message for e in rft_events.data]}")
longer = client.fine_tuning.jobs.create(model=model, training_file=uploaded.id, hyperparameters={"n_epochs": 50},
                                        extra_body={"fsdp_app": {"seq_len": 128, "max_steps": 100000}})
check(client.fine_tuning.jobs.cancel(longer.id).status == "cancelled", "jobs.cancel")
try:
    client.fine_tuning.jobs.retrieve("ftjob-nope")
    check(False, "expected NotFoundError")
except openai.NotFoundError:
    pass

# The queue (one slot, no waiting room) is held by a stream we do not read to the end.
held = client.completions.create(model=model, prompt="x", max_tokens=int(os.environ.get("LONG_TOKENS", "200")), temperature=0, stream=True)
next(iter(held))
try:
    client.completions.create(model=model, prompt="y", max_tokens=2)
    check(False, "expected RateLimitError while the only slot is busy")
except openai.RateLimitError as e:
    check(e.response.headers.get("retry-after") is not None, "Retry-After")
held.close()
print("openai client: all checks passed")
