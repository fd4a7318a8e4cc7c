"""Fits the measured constants of src/train/estimate.rs (RESIDENT_PER_COUNTED,
WEIGHT_GRAD_TEMPORARIES) on rows made by run-shape.sh (1-rank full fine-tunes).

Each row: shape, measured peak RSS, and `fsdp-app estimate --json`. The exact parts of the
estimate (parameters, gradients, optimizer, gathered units, process, unit backward without the
weight-gradient temporaries) are taken as they are; what remains of the measured peak is fitted
as a * (counted layer tensors) + b * (largest weights one backward works on), with the loss stage
at LOSS_TENSORS = 6. The committed results.txt was made before the temporaries term existed, so
its unit_backward has none; for newer rows pass --new to subtract it.
Needs numpy and scipy:  python fit.py [--new] [results.txt]
"""
import json, sys
import numpy as np
from scipy.optimize import nnls

new = "--new" in sys.argv
path = next((a for a in sys.argv[1:] if not a.startswith("--")), "results.txt")
rows, A, W = [], [], []
for line in open(path):
    p = line.split(" ", 9)
    name, (h, i, L, V, nh, nkv, seq, meas) = p[0], map(int, p[1:9])
    e = json.loads(p[9])
    T, q, kv = 2 * seq, nh * 64, nkv * 64
    per_token = 6 * h + 3 * i + 5 * q + 5 * kv + 2 * nh * seq + (2 * q if nkv < nh else 0)
    layer_w = 4 * (2 * h * q + 2 * h * kv + 3 * h * i)
    w = max(layer_w, 4 * V * h)
    backward = e["unit_backward"] - (3.5 * w if new else 0)
    base = e["parameters"] + e["gradients"] + e["optimizer"] + e["gathered_units"] + backward + e["process"] + 6 * 4 * T * V
    rows.append((name, seq, meas, base))
    A.append([(L + 1) * 4 * T * per_token, w])
A = np.array(A, float)
y = np.array([m - b for _, _, m, b in rows])
x, _ = nnls(A, y)
print(f"RESIDENT_PER_COUNTED {x[0]:.3f}  WEIGHT_GRAD_TEMPORARIES {x[1]:.3f}")
for (name, seq, meas, base), pred in zip(rows, A @ x):
    print(f"  {name:4} seq {seq:4}: measured {meas / 2**20:7.1f} MiB, fitted {(base + pred) / 2**20:7.1f} MiB ({(base + pred) / meas * 100 - 100:+.1f}%)")
