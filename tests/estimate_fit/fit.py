"""Fits the fitted constants of src/train/estimate.rs (PROCESS_BYTES, RESIDENT_PER_COUNTED,
AC_HIDDEN_PER_LAYER, LOSS_TENSORS_AT_PEAK, RANK0_HOST_BYTES) on the rows run-shape.sh measured:
one-rank.txt (1 rank, full fine-tuning, every graph kept) and two-rank.txt (2 ranks, LoRA on
every projection, activation checkpointing). LORA_RESIDENT_SHARE is held (0.7, fitted on
lora-rank.txt, 1 rank, LoRA without checkpointing, with the others held; printed below too).

The exact parts of each row's estimate (parameters, gradients, optimizer, gathered units, unit
backward; weight-gradient temporaries and the loss chunk without checkpointing; rank 0's relayed
buffers)
are taken as they are, and what remains of the measured peak is fitted (non-negative least
squares) as
  P (process and allocator floor)
  + R * counted layer tensors: every layer's and one more without checkpointing, the one
    recomputed layer's with it (LoRA's adapter outputs counted as estimate.rs counts them)
  + a * layers * (tokens, hidden) f32 tensors   (checkpointing only)
  + b * (tokens, vocab) f32 tensors              (checkpointing only)
  + c                                            (rank 0 of the two-rank runs)
Prints the constants and each row's fitted and current estimate. Needs numpy and scipy:
  python fit.py
"""
import json
import os
import numpy as np
from scipy.optimize import nnls

HERE = os.path.dirname(os.path.abspath(__file__))


def rows_of(name, ranks):
    for line in open(os.path.join(HERE, name)):
        p = line.split(" ")
        shape, (h, i, L, V, nh, nkv, seq) = p[0], map(int, p[1:8])
        yield shape, h, i, L, V, nh, nkv, seq, [float(x) for x in p[8 : 8 + ranks]], json.loads(" ".join(p[8 + ranks :]))


def adapters(h, i, nh, nkv, tokens):
    """f32 bytes LoRA (r = 8, all seven projections) adds to a layer, as estimate.rs counts
    them: B(A x), its scaled copy and the sum, and A x."""
    q, kv = nh * 64, nkv * 64
    return 4 * tokens * sum(3 * out + 8 for out in [q, kv, kv, h, i, i, h])


def counted(h, i, nh, nkv, tokens, lora):
    """f32 bytes one layer's training forward keeps (estimate.rs's LAYER counts), with LoRA's
    at estimate.rs's LORA_RESIDENT_SHARE (fitted on lora-rank.txt below, held here)."""
    q, kv = nh * 64, nkv * 64
    return 4 * tokens * (6 * h + 3 * i + 3 * q + 3 * kv) + (0.7 * adapters(h, i, nh, nkv, tokens) if lora else 0)


NAMES = ["PROCESS_BYTES (MiB)", "RESIDENT_PER_COUNTED", "AC_HIDDEN_PER_LAYER", "LOSS_TENSORS_AT_PEAK", "RANK0_HOST_BYTES (MiB)"]
meta, A, y = [], [], []
for ac, name, ranks in ((False, "one-rank.txt", 1), (True, "two-rank.txt", 2)):
    for shape, h, i, L, V, nh, nkv, seq, measured, e in rows_of(name, ranks):
        T = 2 * seq
        exact = e["parameters"] + e["gradients"] + e["optimizer"] + e["gathered_units"] + e["unit_backward"]
        if ac:
            features = [2**20, counted(h, i, nh, nkv, T, True), L * 4 * T * h, 4 * T * V, 0]
        else:
            exact += e["gradient_temporaries"] + e["loss"]
            features = [2**20, (L + 1) * counted(h, i, nh, nkv, T, False), 0, 0, 0]
        for rank, m in enumerate(measured):
            relay = e["rank0_relay"] if rank == 0 else 0
            current = e["total"] + (relay + e.get("rank0_host", 0) if rank == 0 else 0)
            meta.append((f"{shape}{' two' if ac else ' one'} seq {seq} rank {rank}", m, exact + relay, current))
            A.append(features[:-1] + [2**20 if ac and rank == 0 else 0])
            y.append(m - exact - relay)
A, y = np.array(A, float), np.array(y)
x, _ = nnls(A, y)
print("  ".join(f"{k} {v:.3f}" for k, v in zip(NAMES, x)))
worst = 0.0
for (what, m, base, current), fitted in zip(meta, A @ x):
    f = base + fitted
    worst = max(worst, abs(f / m - 1))
    print(f"  {what:28}: measured {m / 2**20:7.1f} MiB, fitted {f / 2**20:7.1f} ({f / m * 100 - 100:+5.1f}%), estimate now {current / 2**20:7.1f} ({current / m * 100 - 100:+5.1f}%)")
print(f"worst fitted row: {worst * 100:.1f}%")

# LORA_RESIDENT_SHARE on lora-rank.txt, the constants above held: least squares of the adapter
# tensors' share in what remains of each measured peak.
P, R = x[0] * 2**20, x[1]
num = den = 0.0
lora_rows = []
for shape, h, i, L, V, nh, nkv, seq, measured, e in rows_of("lora-rank.txt", 1):
    T = 2 * seq
    exact = e["parameters"] + e["gradients"] + e["optimizer"] + e["gathered_units"] + e["unit_backward"]
    exact += e["gradient_temporaries"] + e["loss"] + P + R * (L + 1) * counted(h, i, nh, nkv, T, False)
    f = R * (L + 1) * adapters(h, i, nh, nkv, T)
    num, den = num + f * (measured[0] - exact), den + f * f
    lora_rows.append((shape, seq, measured[0], e["total"]))
print(f"LORA_RESIDENT_SHARE {num / den:.3f}")
for shape, seq, m, current in lora_rows:
    print(f"  {shape} lora seq {seq}: measured {m / 2**20:7.1f} MiB, estimate now {current / 2**20:7.1f} ({current / m * 100 - 100:+5.1f}%)")
