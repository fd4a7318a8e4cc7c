#!/usr/bin/env python3
"""DPO training references: an independent PyTorch DPO loop (transformers model, a frozen copy
as the reference), for `tests/dpo.rs`.

    cargo build --release
    pip install torch transformers peft safetensors
    python3 tests/reference/make_dpo_training_reference.py [--bin target/release/fsdp-app]

Writes, beside this script:
  dpo-train-pairs.jsonl   32 pre-tokenised pairs {"prompt_input_ids", "chosen_input_ids",
                          "rejected_input_ids"}, each sequence at most 16 tokens
  dpo-llama.json          for each run: per step the loss, the clipped gradient norm and TRL's
                          statistics (rewards/chosen, rewards/rejected, rewards/accuracies,
                          rewards/margins, logps/chosen, logps/rejected)

Runs (the `llama` fixture; 8 AdamW steps of 4 pairs in file order; lr 1e-3, weight decay 0.1
but not on 1-D parameters, gradient norm clipped to 1.0, linear schedule with 2 warmup steps;
beta 0.1): "sigmoid", "ipo" and "hinge", full fine-tuning, the reference a frozen copy of the
starting model; "lora_sigmoid": the PEFT adapter tests/reference/lora-llama (q_proj, v_proj,
down_proj; lora_B non-zero) trained, the reference the same model inside `disable_adapter()`.
They match `fsdp-app finetune --method dpo --dpo-loss KIND --dpo-beta 0.1 --no-shuffle
--seq-len 16 --batch-size 4 --max-steps 8 --lr 1e-3 --weight-decay 0.1 --max-grad-norm 1.0
--warmup-steps 2 --lr-scheduler linear` (LoRA: with --adapter tests/reference/lora-llama).

The objective, written out (Rafailov et al. 2023; TRL's dpo_loss): for each pair, the summed
log-probability of the completion tokens given the prompt under the policy (pi) and the
reference (ref); h = (pi(c) - pi(r)) - (ref(c) - ref(r));
  sigmoid: -log sigmoid(beta h);   hinge: max(0, 1 - beta h);
  ipo: (h' - 1 / (2 beta))^2 with each log-probability divided by its completion's tokens;
the loss is the mean over the step's pairs. Rewards are beta (pi - ref) of the unnormalised sums.
"""
import argparse
import copy
import json
import os
import subprocess
import tempfile

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, get_scheduler

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SEQ, PAIRS, STEPS, BETA = 16, 4, 8, 0.1
LR, WD, CLIP, WARMUP = 1e-3, 0.1, 1.0, 2


def make_pairs():
    pairs = []
    for i in range(PAIRS * STEPS):
        p = [(i * 7 + j * 3 + 5) % 384 for j in range(3 + i % 4)]
        c = [(i * 11 + j * 5 + 1) % 384 for j in range(2 + i % 5)]
        r = [(i * 13 + j * 2 + 9) % 384 for j in range(1 + (i * 3) % 6)]
        assert len(p) + max(len(c), len(r)) <= SEQ
        pairs.append({"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r})
    return pairs


def batch_tensors(pairs, pad_id):
    """Rows chosen0, rejected0, chosen1, ...: ids right-padded to SEQ, and a mask of the
    positions whose next token is a completion token."""
    ids, mask = [], []
    for pr in pairs:
        for comp in (pr["chosen_input_ids"], pr["rejected_input_ids"]):
            seq = pr["prompt_input_ids"] + comp
            m = [0] * len(pr["prompt_input_ids"]) + [1] * len(comp)
            ids.append(seq + [pad_id] * (SEQ - len(seq)))
            mask.append(m + [0] * (SEQ - len(seq)))
    return torch.tensor(ids), torch.tensor(mask, dtype=torch.float32)


def row_logps(model, ids, mask):
    """Summed log-probability of each row's completion tokens, and their counts."""
    logits = model(ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
    m = mask[:, 1:]
    return (logp * m).sum(1), m.sum(1)


def dpo(kind, pol, ref, counts):
    if kind == "ipo":
        pol, ref = pol / counts, ref / counts
    ratio = (pol - ref).view(-1, 2)
    h = ratio[:, 0] - ratio[:, 1]
    if kind == "sigmoid":
        return -F.logsigmoid(BETA * h).mean()
    if kind == "hinge":
        return torch.relu(1 - BETA * h).mean()
    if kind == "ipo":
        return ((h - 1 / (2 * BETA)) ** 2).mean()
    raise ValueError(kind)


def train(model, params, ref_logps, pairs, pad_id, kind):
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.999), eps=1e-8
    )
    sched = get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    out = {k: [] for k in ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                           "rewards/margins", "logps/chosen", "logps/rejected"]}
    model.train()
    for step in range(STEPS):
        chunk = pairs[step * PAIRS:(step + 1) * PAIRS]
        ids, mask = batch_tensors(chunk, pad_id)
        pol, counts = row_logps(model, ids, mask)
        ref = ref_logps(ids, mask)
        loss = dpo(kind, pol, ref, counts)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP).item()
        opt.step()
        sched.step()
        rewards = (BETA * (pol - ref)).detach().view(-1, 2)
        logps = pol.detach().view(-1, 2)
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm)
        out["rewards/chosen"].append(rewards[:, 0].mean().item())
        out["rewards/rejected"].append(rewards[:, 1].mean().item())
        out["rewards/accuracies"].append((rewards[:, 0] > rewards[:, 1]).float().mean().item())
        out["rewards/margins"].append((rewards[:, 0] - rewards[:, 1]).mean().item())
        out["logps/chosen"].append(logps[:, 0].mean().item())
        out["logps/rejected"].append(logps[:, 1].mean().item())
    print(kind, "losses", [round(x, 5) for x in out["loss"]])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "fsdp-app"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    pairs = make_pairs()
    with open(os.path.join(HERE, "dpo-train-pairs.jsonl"), "w") as f:
        for p in pairs:
            f.write(json.dumps(p) + "\n")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        d = os.path.join(work, "llama")
        subprocess.run([args.bin, "fixture", "--name", "llama", "--out", d], check=True)
        load = lambda: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        for kind in ["sigmoid", "ipo", "hinge"]:
            model = load()
            pad_id = model.config.eos_token_id
            reference = copy.deepcopy(model).eval()
            for p in reference.parameters():
                p.requires_grad_(False)

            def ref_logps(ids, mask, reference=reference):
                with torch.no_grad():
                    return row_logps(reference, ids, mask)[0]

            results[kind] = train(model, list(model.parameters()), ref_logps, pairs, pad_id, kind)

        from peft import PeftModel

        model = PeftModel.from_pretrained(load(), os.path.join(HERE, "lora-llama"), is_trainable=True)
        pad_id = model.config.eos_token_id

        def base_logps(ids, mask):
            with torch.no_grad(), model.disable_adapter():
                return row_logps(model, ids, mask)[0]

        trainable = [p for p in model.parameters() if p.requires_grad]
        results["lora_sigmoid"] = train(model, trainable, base_logps, pairs, pad_id, "sigmoid")
    with open(os.path.join(HERE, "dpo-llama.json"), "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
