#!/usr/bin/env python3
"""Agent libraries, unchanged, against a running `fsdp-app serve` of SmolLM2-135M-Instruct
(tests/agent_libraries.rs converts the PyPI GGUF and starts the server):

- LangChain's ChatOpenAI: `bind_tools` (a named function, `any` = `required` with parallel calls
  on and off, streamed and not) and `with_structured_output` (function_calling, json_schema and
  json_mode);
- the OpenAI Agents SDK: an agent with a function tool and an `output_type`, on its Chat
  Completions and its Responses model classes, streamed and not (a Responses conversation with a
  function call and its output);
- the official `openai` client for what those libraries do not send on their own: `$defs` /
  `$ref` schemas under every tool choice and in `response_format`, and json_schema integers at
  high temperature.

Every answer must come back parsed and valid against its schema, over several prompts and
temperatures.

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY=k MODEL=smol python3 tests/agent_libraries.py

Exits non-zero, naming the check, on the first failure; prints "all checks passed" at the end.
"""
import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jsonschema
import openai
from pydantic import BaseModel, Field

base, key, model = os.environ["BASE_URL"], os.environ["API_KEY"], os.environ["MODEL"]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
I64 = 2**63 - 1
CITIES = ["Paris", "Tokyo", "Lima"]
TEMPERATURES = [0.0, 0.6, 1.0]
checks = 0
started = time.time()


def section(name):
    print(f"{time.time() - started:6.1f}s {name}", flush=True)


def check(cond, what):
    global checks
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    checks += 1


def at_once(jobs):
    """Runs the jobs (functions of no argument) concurrently, as a service's many clients would
    (the server batches them); a failed check in one fails the script."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        for f in [pool.submit(job) for job in jobs]:
            f.result()


def closed(schema):
    """`schema` with additionalProperties false on every object that declares properties and
    says nothing: what the server promises to enforce where the schema is silent."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def valid(instance, schema, what):
    try:
        jsonschema.validate(instance, closed(schema))
    except jsonschema.ValidationError as e:
        check(False, f"{what}: {instance!r} is not valid: {e.message}")
    check(True, what)


def integers_fit(v, what):
    if isinstance(v, dict):
        for x in v.values():
            integers_fit(x, what)
    elif isinstance(v, list):
        for x in v:
            integers_fit(x, what)
    elif isinstance(v, int) and not isinstance(v, bool):
        check(-I64 - 1 <= v <= I64, f"{what}: integer {v} does not fit 64 bits")


# ---------------------------------------------------------------- LangChain's ChatOpenAI
from langchain_core.tools import tool  # noqa: E402
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402


def chat(temperature, seed=0, max_tokens=120, **kw):
    return ChatOpenAI(base_url=base, api_key=key, model=model, temperature=temperature, seed=seed, max_tokens=max_tokens,
                      max_retries=0, **kw)


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


@tool
def get_time(city: str) -> str:
    """Get the local time in a city."""
    return f"noon in {city}"


weather_params = convert_to_openai_tool(get_weather)["function"]["parameters"]
check("additionalProperties" not in weather_params, f"LangChain now closes its schemas: {weather_params}")


def tool_calls_valid(message, schemas, what):
    check(not message.invalid_tool_calls, f"{what}: unparseable calls {message.invalid_tool_calls}")
    check(message.tool_calls, f"{what}: no tool call in {message!r}")
    for c in message.tool_calls:
        check(c["name"] in schemas, f"{what}: call of unknown {c['name']}")
        valid(c["args"], schemas[c["name"]], f"{what}: arguments of {c['name']}")
    seen = [(c["name"], json.dumps(c["args"], sort_keys=True)) for c in message.tool_calls]
    check(len(seen) == len(set(seen)), f"{what}: a call repeated: {seen}")


section("LangChain bind_tools")
both = {"get_weather": weather_params, "get_time": convert_to_openai_tool(get_time)["function"]["parameters"]}
for city in CITIES[:2]:
    question = f"What is the weather in {city}?"
    for t in TEMPERATURES:
        what = f"LangChain bind_tools named ({city}, temperature {t})"
        r = chat(t).bind_tools([get_weather], tool_choice="get_weather").invoke(question)
        tool_calls_valid(r, both, what)
        check(r.response_metadata.get("finish_reason") == "tool_calls", f"{what}: finish {r.response_metadata}")
        for parallel in [True, False]:
            if t == TEMPERATURES[1]:
                continue  # the middle temperature for the named choice only: the test's time
            what = f"LangChain bind_tools any, parallel {parallel} ({city}, temperature {t})"
            bound = chat(t, max_tokens=80).bind_tools([get_weather, get_time], tool_choice="any", parallel_tool_calls=parallel)
            r = bound.invoke(f"What are the weather and the time in {city}?")
            tool_calls_valid(r, both, what)
            check(parallel or len(r.tool_calls) == 1, f"{what}: {len(r.tool_calls)} calls without parallel_tool_calls")
            check(r.response_metadata.get("finish_reason") in ("tool_calls", "length"), f"{what}: {r.response_metadata}")
            check(not r.content, f"{what}: the grammar's text came back as content: {r.content!r}")
            if not parallel:
                continue
            # Streamed: the chunks add up to the same calls (same seed, so the same tokens). Cut by
            # max_tokens, the stream has already sent the unfinished call's name and first
            # fragments (as OpenAI's does), which the whole answer drops.
            full = None
            for chunk in bound.stream(f"What are the weather and the time in {city}?"):
                full = chunk if full is None else full + chunk
            streamed = [(c["name"], c["args"]) for c in full.tool_calls]
            whole = [(c["name"], c["args"]) for c in r.tool_calls]
            check(full.response_metadata.get("finish_reason") == r.response_metadata.get("finish_reason"), f"{what}: streamed finish")
            if r.response_metadata.get("finish_reason") == "tool_calls":
                tool_calls_valid(full, both, f"{what}, streamed")
                check(streamed == whole, f"{what}: streamed {streamed} vs whole {whole}")
            else:
                check(streamed[:len(whole)] == whole and len(streamed) <= len(whole) + 1, f"{what}: streamed {streamed} vs whole {whole}")


class Person(BaseModel):
    """A person mentioned in the text."""
    name: str = Field(description="the person's name")
    age: int = Field(description="age in years")


section("LangChain with_structured_output")


def structured(text, method, t):
    what = f"LangChain with_structured_output {method} ({text!r}, temperature {t})"
    out = chat(t).with_structured_output(Person, method=method).invoke(f"{text} Give the person as JSON with the keys name and age.")
    check(isinstance(out, Person), f"{what}: {out!r}")
    integers_fit(out.model_dump(), what)


# json_mode sends no schema (only {"type": "json_object"}), so only the schema methods can hold the
# types at every temperature.
PEOPLE = ["Alice is 30 years old.", "My grandfather Tom turned 87 last week."]
at_once([partial(structured, text, method, t) for text in PEOPLE
         for method, temperatures in [("function_calling", TEMPERATURES), ("json_schema", TEMPERATURES), ("json_mode", [0.0])]
         for t in temperatures])


# ---------------------------------------------------------------- $defs / $ref everywhere
class Stop(BaseModel):
    city: str
    nights: int


class Trip(BaseModel):
    """A trip to one place."""
    traveller: str
    destination: Stop


section("$defs under every choice")
trip_schema = Trip.model_json_schema()
check("$defs" in trip_schema and "$ref" in json.dumps(trip_schema["properties"]), f"pydantic writes $defs: {trip_schema}")
trip_tool = {"type": "function", "function": {"name": "plan_trip", "description": "Plan a trip.", "parameters": trip_schema}}
ask = [{"role": "user", "content": "Plan a trip for Ana: two nights in Rome. Give the traveller, and the destination's city and nights."}]
choices = [("named", {"type": "function", "function": {"name": "plan_trip"}}, True), ("required", "required", True),
           ("required, not parallel", "required", False)]


def defs_tool(label, choice, parallel, t):
    what = f"$defs tool, tool_choice {label} (temperature {t})"
    r = client.chat.completions.create(model=model, messages=ask, tools=[trip_tool], tool_choice=choice,
                                       parallel_tool_calls=parallel, temperature=t, seed=1, max_tokens=160)
    calls = r.choices[0].message.tool_calls or []
    check(calls and r.choices[0].message.content is None, f"{what}: {r.choices[0].message}")
    for c in calls:
        valid(json.loads(c.function.arguments), trip_schema, what)
        integers_fit(json.loads(c.function.arguments), what)


# `auto` with a response_format: the answer is either a call or the format's JSON (what the Agents
# SDK sends on each turn of an agent with tools and an output_type).
summary_schema = {"type": "object", "properties": {"trip": {"$ref": "#/$defs/Trip"}, "total_nights": {"type": "integer"}},
                  "required": ["trip", "total_nights"], "$defs": {"Trip": {k: v for k, v in trip_schema.items() if k != "$defs"}}}
summary_schema["$defs"].update(trip_schema["$defs"])


def defs_auto_with_format(t):
    what = f"$defs tool, tool_choice auto with a $defs response_format (temperature {t})"
    r = client.chat.completions.create(model=model, messages=ask, tools=[trip_tool], tool_choice="auto", temperature=t, seed=2,
                                       max_tokens=200, response_format={"type": "json_schema",
                                                                        "json_schema": {"name": "summary", "schema": summary_schema}})
    m = r.choices[0].message
    if m.tool_calls:
        check(r.choices[0].finish_reason == "tool_calls", f"{what}: {r}")
        for c in m.tool_calls:
            valid(json.loads(c.function.arguments), trip_schema, what)
    else:
        check(r.choices[0].finish_reason == "stop", f"{what}: {r}")
        valid(json.loads(m.content), summary_schema, what)


def defs_format(t):
    what = f"$defs response_format (temperature {t})"
    r = client.chat.completions.create(model=model, messages=ask, temperature=t, seed=3, max_tokens=200,
                                       response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": trip_schema}})
    check(r.choices[0].finish_reason == "stop", f"{what}: {r}")
    valid(json.loads(r.choices[0].message.content), trip_schema, what)


at_once([partial(defs_tool, label, choice, parallel, t) for label, choice, parallel in choices for t in [0.0, 0.6]]
        + [partial(defs_auto_with_format, t) for t in [0.0, 1.0]] + [partial(defs_format, t) for t in [0.0, 1.0]])

# json_schema integers: a silent `integer` stays within 64 bits at any temperature.
section("json_schema integers")
# The schema (a 135M model wrote `"age": 1000000000000000000000000...` until max_tokens)
# and, at high temperature, an integer alone: a silent `integer` stays within 64 bits and ends.
age_schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
count_schema = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}
runs = [(age_schema, f"Describe {who} as JSON.", t, 0) for who, t in [("a person", 0.0), ("a famous old scientist", 0.7)]]
runs += [(count_schema, "How many stars are in the sky? Answer as JSON.", 1.5, seed) for seed in range(3)]


def integer_answer(schema, question, t, seed):
    what = f"json_schema with an integer ({question!r}, temperature {t}, seed {seed})"
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}], temperature=t, seed=seed,
                                       max_tokens=80, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    check(r.choices[0].finish_reason == "stop", f"{what}: {r}")
    out = json.loads(r.choices[0].message.content)
    valid(out, schema, what)
    integers_fit(out, what)


at_once([partial(integer_answer, *run) for run in runs])


# ---------------------------------------------------------------- the OpenAI Agents SDK
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,  # noqa: E402
                    RunContextWrapper, function_tool, set_tracing_disabled)

set_tracing_disabled(True)
async_client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)


class Calls(BaseModel):
    """One run's context: what its tools were called with."""
    seen: list = []


def not_called_yet(ctx: RunContextWrapper[Calls], agent) -> bool:
    """The weather tool runs once per run. Offered again, a 135M model asks again for what it was
    just told (it rates another call above the answer); without tools the last turn must give the
    output_type. The grammar of a turn with both leaves the choice open (a unit test in
    src/serve/tools.rs; the `auto` with a response_format check above)."""
    return not ctx.context.seen


@function_tool(is_enabled=not_called_yet)
def weather(ctx: RunContextWrapper[Calls], city: str) -> str:
    """Get the current weather in a city."""
    ctx.context.seen.append(city)
    return f"It is sunny and 21 degrees Celsius in {city}."


@function_tool
def plan_trip(ctx: RunContextWrapper[Calls], trip: Trip) -> str:
    """Plan a trip."""
    ctx.context.seen.append(trip)
    return f"Booked {trip.destination.nights} nights in {trip.destination.city} for {trip.traveller}."


class Weather(BaseModel):
    city: str
    temperature_celsius: int


async def run(agent, question, stream, calls):
    if stream:
        result = Runner.run_streamed(agent, question, max_turns=4, context=calls)
        kinds = set()
        async for ev in result.stream_events():
            kinds.add(ev.type)
        check("raw_response_event" in kinds, f"no raw events streamed: {kinds}")
        return result
    return await Runner.run(agent, question, max_turns=4, context=calls)


async def weather_agent(cls, stream, city, t):
    """The first turn must call the tool; the last is `auto` (reset_tool_choice) and gives the
    output_type's JSON."""
    what = f"Agents SDK {cls.__name__}, stream {stream}, {city}, temperature {t}"
    agent = Agent(name="weather", instructions="Answer questions about the weather. Use the weather tool.",
                  model=cls(model=model, openai_client=async_client), tools=[weather], output_type=Weather,
                  model_settings=ModelSettings(temperature=t, max_tokens=120, tool_choice="weather", extra_body={"seed": 4}))
    calls = Calls()
    result = await run(agent, f"What is the weather in {city}?", stream, calls)
    check(isinstance(result.final_output, Weather), f"{what}: {result.final_output!r}")
    integers_fit(result.final_output.model_dump(), what)
    check(calls.seen and all(isinstance(c, str) and c for c in calls.seen), f"{what}: tool calls {calls.seen}")
    outputs = [i for i in result.to_input_list() if isinstance(i, dict) and i.get("type") == "function_call_output"]
    check(outputs, f"{what}: no function_call_output went back to the model")


async def trip_agent(cls, stream):
    what = f"Agents SDK {cls.__name__}, stream {stream}: a tool whose argument has $defs"
    agent = Agent(name="planner", instructions="Plan trips with the plan_trip tool.", model=cls(model=model, openai_client=async_client),
                  tools=[plan_trip], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0, max_tokens=200, tool_choice="required", extra_body={"seed": 4}))
    calls = Calls()
    result = await run(agent, ask[0]["content"], stream, calls)
    check(calls.seen and isinstance(calls.seen[0], Trip), f"{what}: {calls.seen}")
    check(isinstance(result.final_output, str) and result.final_output.startswith("Booked"), f"{what}: {result.final_output!r}")


async def agents_sdk():
    """All runs at once, as an agent service would send them (the server batches them)."""
    runs = []
    for cls in [OpenAIChatCompletionsModel, OpenAIResponsesModel]:
        for stream in [False, True]:
            runs += [weather_agent(cls, stream, city, t) for city, t in [(CITIES[0], TEMPERATURES[0]), (CITIES[2], TEMPERATURES[2])]]
            runs.append(trip_agent(cls, stream))
    await asyncio.gather(*runs)


section("Agents SDK")
asyncio.run(agents_sdk())
section("done")
print(f"all checks passed ({checks})")
