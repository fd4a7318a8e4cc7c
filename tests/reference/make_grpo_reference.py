#!/usr/bin/env python3
"""GRPO training references: TRL's GRPO loss (trl 1.16, GRPOTrainer._compute_loss) written out
in PyTorch and trained on fixed (teacher-forced) completions with fixed rewards, for
`tests/grpo.rs`. Sampling never enters: both sides train on the same completions.

    cargo build --release
    pip install torch transformers peft safetensors
    python3 tests/reference/make_grpo_reference.py [--bin target/release/fsdp-app]

Writes, beside this script:
  grpo-rows.jsonl   8 prompt rows {"prompt_input_ids", "completions" (4 per prompt, token ids,
                    some ending with eos), "rewards" (4 per prompt; one group all equal)}
  grpo-llama.json   for each run: per step the loss, the clipped gradient norm and TRL's
                    statistics (entropy, kl, clip_ratio/low_mean, high_mean, region_mean, reward,
                    reward_std, frac_reward_zero_std)

Every run: the `llama` fixture; 2 prompts (8 completions) per step in file order, one
micro-batch; AdamW lr 1e-3, weight decay 0.1 but not on 1-D parameters, gradient norm clipped
to 1.0, linear schedule with 2 warmup steps; temperature 0.7 (log-probabilities and entropies
of logits / 0.7, as TRL computes them); advantages (r - group mean) / (group std + 1e-4).
Per token, with r = exp(logp - old_logp) (old_logp = logp.detach() when num_iterations is 1,
else the log-probability when the rollouts were made, before the first of their steps):
  l = -min(r A, clamp(r, 1 - epsilon, 1 + epsilon_high) A) + beta (exp(ref - logp) - (ref - logp) - 1)
aggregated by loss_type: grpo: mean over completions of each one's token mean; bnpo: the token
mean of each rank's batch, averaged over ranks ("bnpo_world2": the two halves, one prompt
each, as two ranks hold them); dr_grpo: token sum / (completions x max_completion_length 6);
dapo: token sum / the global batch's tokens. Runs: every loss type with beta 0 and 0.04 and
num_iterations 1 and 2 (epsilon 0.2; with 2, 0.01 / 0.015 so that the second steps clip), named
"<type>[_kl][_mu2]", and "lora_dapo_kl_mu2" (tests/reference/lora-llama trained, the reference the
same model inside `disable_adapter()`).
"""
import argparse
import copy
import json
import os
import subprocess
import tempfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, get_scheduler

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROMPTS, G, PER_STEP, MAX_LEN, TEMPERATURE = 8, 4, 2, 6, 0.7
LR, WD, CLIP, WARMUP = 1e-3, 0.1, 1.0, 2
EOS = 2

# name: (loss_type, beta, num_iterations, epsilon, epsilon_high, lora). Every loss type with and
# without the KL term and with num_iterations 1 and 2 ("<type>[_kl][_mu2]"; μ = 2 with tighter bounds so
# that its second steps clip); bnpo also as two ranks split it ("bnpo_world2..."); LoRA once.
RUNS = {}
for kind in ["grpo", "bnpo", "bnpo_world2", "dr_grpo", "dapo"]:
    for beta in [0.0, 0.04]:
        for mu in [1, 2]:
            name = kind + ("_kl" if beta else "") + ("_mu2" if mu == 2 else "")
            eps = (0.2, 0.2) if mu == 1 else (0.01, 0.015)
            RUNS[name] = (kind, beta, mu, *eps, False)
RUNS["lora_dapo_kl_mu2"] = ("dapo", 0.04, 2, 0.01, 0.015, True)


def make_rows(eos):
    rows = []
    for i in range(PROMPTS):
        prompt = [(i * 7 + j * 3 + 5) % 384 for j in range(3 + i % 4)]
        completions, rewards = [], []
        for k in range(G):
            n = 1 + (i * 3 + k * 5) % MAX_LEN
            c = [(i * 11 + k * 13 + j * 5 + 1) % 384 for j in range(n)]
            if (i + k) % 3 == 0:
                c[-1] = eos
            completions.append(c)
            rewards.append(1.0 if i == 5 else ((i * 7 + k * 3) % 5) / 4)
        rows.append({"prompt_input_ids": prompt, "completions": completions, "rewards": rewards})
    return rows


def batch(rows, pad):
    """Rows prompt + completion, right-padded; the mask of completion tokens at their positions."""
    seqs = [(r["prompt_input_ids"], c) for r in rows for c in r["completions"]]
    width = max(len(p) + len(c) for p, c in seqs)
    ids, mask = [], []
    for p, c in seqs:
        s = p + c
        ids.append(s + [pad] * (width - len(s)))
        mask.append([0] * len(p) + [1] * len(c) + [0] * (width - len(s)))
    return torch.tensor(ids), torch.tensor(mask, dtype=torch.float32)


def token_logps(model, ids, mask):
    """Per position t >= 1: log p(ids[t]) under logits[t - 1] / T (masked to completions), and
    the entropies of those distributions."""
    logits = model(ids).logits[:, :-1].float() / TEMPERATURE
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach(), mask[:, 1:]


def advantages(rewards):
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, G)
    a = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    return a.view(-1).float(), r


def loss_of(kind, ptl, m):
    if kind == "grpo":
        return ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if kind == "bnpo":
        return (ptl * m).sum() / m.sum().clamp(min=1.0)
    if kind == "bnpo_world2":
        halves = [slice(0, G), slice(G, 2 * G)]
        return sum((ptl[h] * m[h]).sum() / m[h].sum().clamp(min=1.0) for h in halves) / 2
    if kind == "dr_grpo":
        return (ptl * m).sum() / (ptl.size(0) * MAX_LEN)
    if kind == "dapo":
        return (ptl * m).sum() / m.sum().clamp(min=1.0)
    raise ValueError(kind)


def masked_mean(x, m):
    return ((x * m).sum() / m.sum().clamp(min=1.0)).item()


def train(model, params, ref_model, rows, pad, run):
    kind, beta, mu, eps, eps_high, _ = run
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.999), eps=1e-8
    )
    steps = PROMPTS // PER_STEP * mu
    sched = get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=steps)
    keys = ["loss", "grad_norm", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
            "reward", "reward_std", "frac_reward_zero_std"]
    out = {k: [] for k in keys}
    model.train()
    old = None
    for step in range(steps):
        chunk = rows[(step // mu) * PER_STEP:(step // mu + 1) * PER_STEP]
        ids, mask = batch(chunk, pad)
        adv, grouped = advantages([x for r in chunk for x in r["rewards"]])
        if step % mu == 0:
            with torch.no_grad():
                old = token_logps(model, ids, mask)[0] if mu > 1 else None
                ref = ref_model(ids, mask) if beta else None
        logp, entropy, m = token_logps(model, ids, mask)
        old_logp = logp.detach() if old is None else old
        coef_1 = torch.exp(logp - old_logp)
        coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
        a = adv.unsqueeze(1)
        ptl = -torch.min(coef_1 * a, coef_2 * a)
        if beta:
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            ptl = ptl + beta * kl
        loss = loss_of(kind, ptl, m)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP).item()
        opt.step()
        sched.step()
        low = ((coef_1 < 1 - eps) & (a < 0)).float()
        high = ((coef_1 > 1 + eps_high) & (a > 0)).float()
        flat = grouped.view(-1)
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm)
        out["entropy"].append(masked_mean(entropy, m))
        out["kl"].append(masked_mean(kl.detach(), m) if beta else 0.0)
        out["clip_ratio/low_mean"].append(masked_mean(low, m))
        out["clip_ratio/high_mean"].append(masked_mean(high, m))
        out["clip_ratio/region_mean"].append(masked_mean(torch.maximum(low, high), m))
        out["reward"].append(flat.mean().item())
        out["reward_std"].append(flat.std().item())
        out["frac_reward_zero_std"].append((grouped.std(1) < 1e-8).double().mean().item())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "fsdp-app"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        d = os.path.join(work, "llama")
        subprocess.run([args.bin, "fixture", "--name", "llama", "--out", d], check=True)
        load = lambda: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        pad = load().config.eos_token_id
        assert pad == EOS
        rows = make_rows(EOS)
        with open(os.path.join(HERE, "grpo-rows.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        for name, run in RUNS.items():
            model = load()
            if run[5]:
                model = PeftModel.from_pretrained(model, os.path.join(HERE, "lora-llama"), is_trainable=True)
                params = [p for n, p in model.named_parameters() if "lora_" in n]

                def ref_model(ids, mask, model=model):
                    with model.disable_adapter():
                        return token_logps(model, ids, mask)[0]
            else:
                params = list(model.parameters())
                frozen = copy.deepcopy(model).eval()

                def ref_model(ids, mask, frozen=frozen):
                    return token_logps(frozen, ids, mask)[0]
            results[name] = train(model, params, ref_model, rows, pad, run)
            print(name, "losses", [round(x, 6) for x in results[name]["loss"]])
    with open(os.path.join(HERE, "grpo-llama.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
