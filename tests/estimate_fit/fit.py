"""Fits the measured constants of src/train/estimate.rs (RESIDENT_PER_COUNTED,
WEIGHT_GRAD_TEMPORARIES, LOSS_TENSORS) on rows made by run-shape.sh (1-rank full fine-tunes).

Each row: shape, measured peak RSS, and `fsdp-app estimate --json`. The exact parts of the
estimate (parameters, gradients, optimizer, gathered units, unit backward, process) are taken as
they are, and what remains of the measured peak is fitted as a * (counted layer tensors) +
b * (largest weights one backward works on) + c * ((batch, seq, vocab) tensors of the loss).
Needs numpy and scipy:  python fit.py [results.txt]
"""
import json, sys
import numpy as np
from scipy.optimize import nnls

path = sys.argv[1] if len(sys.argv) > 1 else "results.txt"
rows, A, W = [], [], []
for line in open(path):
    p = line.split(" ", 9)
    name, (h, i, L, V, nh, nkv, seq, meas) = p[0], map(int, p[1:9])
    e = json.loads(p[9])
    T, q, kv = 2 * seq, nh * 64, nkv * 64
    per_token = 6 * h + 3 * i + 3 * q + 3 * kv
    layer_w = 4 * (2 * h * q + 2 * h * kv + 3 * h * i)
    w = max(layer_w, 4 * V * h)
    backward = e["unit_backward"]
    base = e["parameters"] + e["gradients"] + e["optimizer"] + e["gathered_units"] + backward + e["process"]
    rows.append((name, seq, meas, base))
    A.append([(L + 1) * 4 * T * per_token, w, 4 * T * V])
A = np.array(A, float)
y = np.array([m - b for _, _, m, b in rows])
x, _ = nnls(A, y)
print(f"RESIDENT_PER_COUNTED {x[0]:.3f}  WEIGHT_GRAD_TEMPORARIES {x[1]:.3f}  (batch, seq, vocab) tensors {x[2]:.3f}")
for (name, seq, meas, base), pred in zip(rows, A @ x):
    print(f"  {name:4} seq {seq:4}: measured {meas / 2**20:7.1f} MiB, fitted {(base + pred) / 2**20:7.1f} MiB ({(base + pred) / meas * 100 - 100:+.1f}%)")
