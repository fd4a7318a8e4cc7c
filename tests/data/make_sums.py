"""The GRPO learning task of tests/grpo_smollm2.rs: 64 chat prompts asking for the sum of two
digits, each with its `answer`, graded by tests/data/sums-grader.json.

    python3 tests/data/make_sums.py > tests/data/sums.jsonl
"""
import json
import random

random.seed(0)
for _ in range(64):
    a, b = random.randint(1, 9), random.randint(1, 9)
    prompt = [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]
    print(json.dumps({"prompt": prompt, "answer": str(a + b)}))
