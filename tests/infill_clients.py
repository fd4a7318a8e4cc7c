#!/usr/bin/env python3
"""Filling in the middle through the client libraries code-completion tools use, against a
running `fsdp-app serve` of a model with FIM tokens (tests/serve_infill.rs starts it): the
`openai` package's `completions.create(suffix=...)`, whole and streamed, and the `ollama`
package's `generate(suffix=...)` and `show().capabilities`. Both must give the answer the plain
completion of the prompt laid out by hand (FIM_PROMPT_IDS, from the test) gives.

    BASE_URL=http://127.0.0.1:8000/v1 API_KEY=k MODEL=tiny PREFIX=... SUFFIX=... FIM_PROMPT_IDS=1,2,3 python3 tests/infill_clients.py

Exits non-zero, naming the check, when an answer differs.
"""
import os
import sys

import ollama
import openai

base, key, model = os.environ["BASE_URL"], os.environ["API_KEY"], os.environ["MODEL"]
prefix, suffix = os.environ["PREFIX"], os.environ["SUFFIX"]
by_hand_ids = [int(t) for t in os.environ["FIM_PROMPT_IDS"].split(",")]


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


client = openai.OpenAI(base_url=base, api_key=key)
by_hand = client.completions.create(model=model, prompt=by_hand_ids, max_tokens=8, temperature=0, logprobs=2)
filled = client.completions.create(model=model, prompt=prefix, suffix=suffix, max_tokens=8, temperature=0, logprobs=2)
check(filled.choices[0].text == by_hand.choices[0].text, f"openai: {filled.choices[0].text!r} vs {by_hand.choices[0].text!r}")
check(filled.choices[0].logprobs.token_logprobs == by_hand.choices[0].logprobs.token_logprobs, "openai: the tokens' logprobs")
check(filled.usage.prompt_tokens == len(by_hand_ids), f"openai: prompt tokens {filled.usage.prompt_tokens}")
stream = client.completions.create(model=model, prompt=prefix, suffix=suffix, max_tokens=8, temperature=0, stream=True)
streamed = "".join(c.choices[0].text for c in stream if c.choices)
check(streamed == filled.choices[0].text, f"openai stream: {streamed!r}")

ollama_client = ollama.Client(host=base.removesuffix("/v1"), headers={"Authorization": f"Bearer {key}"})
answer = ollama_client.generate(model=model, prompt=prefix, suffix=suffix, options={"temperature": 0, "num_predict": 8})
check(answer.response == filled.choices[0].text, f"ollama: {answer.response!r}")
check(answer.prompt_eval_count == len(by_hand_ids), f"ollama: prompt_eval_count {answer.prompt_eval_count}")
check("insert" in ollama_client.show(model).capabilities, "ollama: show's capabilities name insert")

print("all checks passed")
