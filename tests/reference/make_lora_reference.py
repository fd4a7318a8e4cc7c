#!/usr/bin/env python3
"""LoRA references, computed with PyTorch + transformers + PEFT on CPU.

    cargo build
    pip install torch transformers peft safetensors
    python3 tests/reference/make_lora_reference.py [--bin target/debug/fsdp-app]

On the `llama` fixture, a PEFT adapter (r=4, alpha=8, q_proj/v_proj/down_proj) whose lora_B is
made non-zero (PEFT initialises it to zero, which would hide a wrong layout or scale):
  lora-llama/                   the adapter as PEFT's save_pretrained writes it
  lora-llama.safetensors        "logits": all-position logits of the adapted model on "ids";
                                "merged.<name>": q_proj/down_proj of layer 0 after merge_and_unload of it;
                                "grad.<name>": the adapter gradients of step 1 (before clipping);
                                "losses", "grad_norms": 12 AdamW steps on train-data.jsonl
The training matches `fsdp-app finetune --adapter tests/reference/lora-llama --no-shuffle
--seq-len 16 --batch-size 4 --max-steps 12 --lr 1e-3 --weight-decay 0.1 --max-grad-norm 1.0
--warmup-steps 2 --lr-scheduler linear` (only the adapters train; all are 2-D, so all decay).
"""
import argparse
import copy
import json
import os
import shutil
import subprocess
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, get_scheduler

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SEQ, BATCH, STEPS = 16, 4, 12
LR, WD, CLIP, WARMUP = 1e-3, 0.1, 1.0, 2
TARGETS = ["q_proj", "v_proj", "down_proj"]


def rows():
    with open(os.path.join(HERE, "train-data.jsonl")) as f:
        return [json.loads(l) for l in f]


def pad(row, pad_id):
    ids = row["input_ids"][:SEQ] + [pad_id] * (SEQ - len(row["input_ids"]))
    labels = row["labels"][:SEQ] + [-100] * (SEQ - len(row["labels"]))
    return ids, labels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "debug", "fsdp-app"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        d = os.path.join(work, "llama")
        subprocess.run([args.bin, "fixture", "--name", "llama", "--out", d], check=True)
        base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        model = get_peft_model(base, cfg)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.05)
        out_dir = os.path.join(HERE, "lora-llama")
        shutil.rmtree(out_dir, ignore_errors=True)
        model.save_pretrained(out_dir)
        for extra in os.listdir(out_dir):
            if extra not in ("adapter_config.json", "adapter_model.safetensors"):
                os.remove(os.path.join(out_dir, extra))
        # The base path is a temporary directory: keep the file stable.
        with open(os.path.join(out_dir, "adapter_config.json")) as f:
            ac = json.load(f)
        ac["base_model_name_or_path"] = "fixture:llama"
        with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
            json.dump(ac, f, indent=2, sort_keys=True)

        out = {}
        ids = torch.tensor([[(i * 37 + 11) % 384 for i in range(12)]])
        model.eval()
        with torch.no_grad():
            out["logits"] = model(ids).logits[0].float().contiguous()
        out["ids"] = ids[0].to(torch.int64)

        # Merging the saved adapter: what merge_and_unload makes of it.
        merged = copy.deepcopy(model).merge_and_unload()
        for n in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]:
            out["merged." + n] = merged.state_dict()[n].contiguous()

        model.train()
        pad_id = base.config.eos_token_id
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW([{"params": trainable, "weight_decay": WD}], lr=LR, betas=(0.9, 0.999), eps=1e-8)
        sched = get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
        data = rows()
        losses, norms = [], []
        for step in range(STEPS):
            batch = [pad(r, pad_id) for r in data[step * BATCH:(step + 1) * BATCH]]
            x = torch.tensor([b[0] for b in batch])
            labels = torch.tensor([b[1] for b in batch])
            logits = model(x).logits.float()
            shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1)
            loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
            loss = loss / (shift_labels != -100).sum()
            opt.zero_grad()
            loss.backward()
            if step == 0:
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
                        name = n.replace("base_model.model.", "", 1).replace(".default.", ".")
                        out["grad." + name] = p.grad.detach().clone().contiguous()
            norms.append(torch.nn.utils.clip_grad_norm_(trainable, CLIP).item())
            opt.step()
            sched.step()
            losses.append(loss.item())
        out["losses"] = torch.tensor(losses, dtype=torch.float64)
        out["grad_norms"] = torch.tensor(norms, dtype=torch.float64)

        save_file(out, os.path.join(HERE, "lora-llama.safetensors"))
        print("losses", [round(x, 4) for x in losses])


if __name__ == "__main__":
    main()
