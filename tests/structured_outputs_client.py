#!/usr/bin/env python3
"""vLLM's structured outputs sent as vLLM's docs send them, through the `openai` client's
`extra_body`, against a running `fsdp-app serve` of SmolLM2 (tests/serve_structured_outputs.rs
starts it): each answer follows its choice, regex, grammar or schema, sampled at temperature 1,
whole and streamed, on chat and completions; bad ones are a 400 naming the field.

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY= MODEL=tiny python3 tests/structured_outputs_client.py

Exits non-zero, naming the check, when an answer breaks its constraint.
"""
import json
import os
import re
import sys

import openai

base, key, model = os.environ["BASE_URL"], os.environ["API_KEY"] or "none", os.environ["MODEL"]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def chat(content, extra, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=60,
                                          temperature=1.0, seed=3, extra_body=extra, **kw)


# Choice (vLLM's docs' first example), under both spellings, several samples at temperature 1.
labels = ["positive", "negative"]
for extra in ({"structured_outputs": {"choice": labels}}, {"guided_choice": labels}):
    r = chat("Classify this sentiment: vLLM is wonderful!", extra, n=4)
    answers = [c.message.content for c in r.choices]
    check(all(a in labels for a in answers) and all(c.finish_reason == "stop" for c in r.choices), f"choice {extra}: {r}")

# Regex, on the completions endpoint (vLLM's docs' e-mail example, shortened).
email = r"[a-z0-9.]{1,20}@\w{6,10}\.com\n"
r = client.completions.create(model=model, prompt="Generate an example email address for Alan Turing, who works in Enigma. End in .com and new line. Example result: alan.turing@enigma.com\n",
                              max_tokens=40, temperature=1.0, seed=5, extra_body={"structured_outputs": {"regex": email}})
check(re.fullmatch(email, r.choices[0].text) is not None and r.choices[0].finish_reason == "stop", f"regex: {r}")
# The same regex over a batch of prompts (a list, as OpenAI's and vLLM's `prompt` takes one), two
# samples each: every answer follows it, numbered prompt by prompt, usage summed.
people = [f"Generate an example email address for {who}. End in .com and new line.\n" for who in ("Ada Lovelace", "Grace Hopper")]
r = client.completions.create(model=model, prompt=people, n=2, max_tokens=40, temperature=1.0, seed=5,
                              extra_body={"structured_outputs": {"regex": email}})
check([c.index for c in r.choices] == [0, 1, 2, 3], f"batch indices: {r}")
check(all(re.fullmatch(email, c.text) is not None for c in r.choices), f"batch regex: {r}")
alone = [client.completions.create(model=model, prompt=p, max_tokens=1, temperature=0).usage.prompt_tokens for p in people]
check(r.usage.prompt_tokens == sum(alone), f"batch usage {r.usage} vs prompts of {alone} tokens")

# A JSON schema as vLLM's docs send it (pydantic's schema under `json`).
schema = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 20}, "model": {"type": "string", "maxLength": 20},
                                           "car_type": {"type": "string", "enum": ["sedan", "SUV", "Truck", "Coupe"]}},
          "required": ["brand", "model", "car_type"]}
r = chat("Generate a JSON with the brand, model and car_type of the most iconic car from the 90's", {"structured_outputs": {"json": schema}})
car = json.loads(r.choices[0].message.content)
check(set(car) == {"brand", "model", "car_type"} and car["car_type"] in schema["properties"]["car_type"]["enum"], f"json: {r}")

# vLLM's docs' grammar example (GBNF), streamed: the deltas add up to a sentence of the grammar.
sql = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
stream = chat("Generate an SQL query to show the 'username' and 'email' from the 'users' table.", {"structured_outputs": {"grammar": sql}}, stream=True)
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
check(re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", text) is not None, f"gbnf grammar, streamed: {text!r}")

# The same kind of grammar in Lark (vLLM's guidance backend's syntax), and the old spelling.
lark = 'start: NUMBER " apples"\nNUMBER: /[1-9][0-9]?/'
r = chat("How many apples fit in a bag?", {"guided_grammar": lark})
check(re.fullmatch(r"[1-9][0-9]? apples", r.choices[0].message.content) is not None, f"lark grammar: {r}")

# Refused, naming the field: a regex that does not compile, two constraints at once.
for extra, param in (({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
                     ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
                     ({"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}, "guided_choice")):
    try:
        chat("Hi", extra)
        check(False, f"{extra} was accepted")
    except openai.BadRequestError as e:
        check(e.body.get("param") == param, f"{extra}: {e.body}")
try:
    chat("Hi", {"structured_outputs": {"choice": ["a"]}}, response_format={"type": "json_object"})
    check(False, "structured_outputs with response_format was accepted")
except openai.BadRequestError as e:
    check(e.body.get("param") == "structured_outputs.choice", f"structured_outputs with response_format: {e.body}")

print("all checks passed")
