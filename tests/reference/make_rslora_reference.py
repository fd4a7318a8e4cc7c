#!/usr/bin/env python3
"""rsLoRA reference, computed with PyTorch + transformers + PEFT on CPU.

    cargo build
    python3 tests/reference/make_rslora_reference.py [--bin target/debug/fsdp-app]

On the `llama` fixture, a PEFT adapter with `use_rslora=True` (r=4, alpha=8: scaling
alpha / sqrt(r) = 4, where plain LoRA's alpha / r is 2), lora_B made non-zero:
  lora-llama-rslora/                 the adapter as PEFT's save_pretrained writes it
  lora-llama-rslora.safetensors      "logits": all-position logits of the adapted model on "ids";
                                     "plain_logits": the same weights with use_rslora off
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def adapted(d, rslora, seed):
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                     use_rslora=rslora, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    return model.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "debug", "fsdp-app"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        d = os.path.join(work, "llama")
        subprocess.run([args.bin, "fixture", "--name", "llama", "--out", d], check=True)
        model = adapted(d, True, 0)
        plain = adapted(d, False, 0)
        out_dir = os.path.join(HERE, "lora-llama-rslora")
        shutil.rmtree(out_dir, ignore_errors=True)
        model.save_pretrained(out_dir)
        for extra in os.listdir(out_dir):
            if extra not in ("adapter_config.json", "adapter_model.safetensors"):
                os.remove(os.path.join(out_dir, extra))
        with open(os.path.join(out_dir, "adapter_config.json")) as f:
            ac = json.load(f)
        assert ac["use_rslora"] is True
        ac["base_model_name_or_path"] = "fixture:llama"
        with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
            json.dump(ac, f, indent=2, sort_keys=True)
        ids = torch.tensor([[(i * 37 + 11) % 384 for i in range(12)]])
        with torch.no_grad():
            out = {"logits": model(ids).logits[0].float().contiguous(), "plain_logits": plain(ids).logits[0].float().contiguous()}
        out["ids"] = ids[0].to(torch.int64)
        save_file(out, os.path.join(HERE, "lora-llama-rslora.safetensors"))


if __name__ == "__main__":
    main()
