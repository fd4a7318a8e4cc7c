#!/usr/bin/env python3
"""The peers' side of `cargo bench --bench matmul`: a training linear layer's three products
(y = x W^T forward; dx = dy W and dW = dy^T x backward) on the given shapes, timed with
PyTorch's CPU matmul (MKL / oneDNN in the PyPI wheel) through autograd, exactly as a training
step runs them, and with numpy's (OpenBLAS in the PyPI wheel). Prints one JSON line: for each
library and shape the best forward and backward seconds over the rounds.

    python matmul_peers.py THREADS ROUNDS '[[tokens, in, out], ...]'
"""
import json
import os
import sys
import time

threads, rounds, shapes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
# OpenBLAS reads its thread count when numpy loads it.
os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
os.environ["OMP_NUM_THREADS"] = str(threads)
import numpy as np  # noqa: E402

out = {"numpy": np.__version__, "shapes": []}
try:
    import torch

    torch.set_num_threads(threads)
    out["torch"] = torch.__version__
except ImportError as e:
    torch = None
    out["torch_error"] = str(e)
try:
    cfg = np.show_config(mode="dicts")
    out["numpy_blas"] = cfg["Build Dependencies"]["blas"]["name"]
except Exception:  # older numpy: no dict mode
    out["numpy_blas"] = "?"


def best(f):
    for _ in range(3):
        f()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


rng = np.random.default_rng(0)
if torch is not None:
    # Thread pools and kernels' first-call setup, before any timing.
    a = torch.randn(512, 512)
    for _ in range(20):
        a @ a
for m, k, n in shapes:
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    dy = rng.standard_normal((m, n), dtype=np.float32)
    row = {"shape": [m, k, n]}
    row["openblas_fwd"] = best(lambda: x @ w.T)
    row["openblas_bwd"] = best(lambda: (dy @ w, dy.T @ x))
    if torch is not None:
        tx = torch.from_numpy(x).requires_grad_(True)
        tw = torch.from_numpy(w).requires_grad_(True)
        tdy = torch.from_numpy(dy)

        def fwd():
            with torch.no_grad():
                torch.nn.functional.linear(tx, tw)

        y = torch.nn.functional.linear(tx, tw)

        def bwd():
            # The backward alone (the graph kept): dx = dy W and dW = dy^T x.
            y.backward(tdy, retain_graph=True)
            tx.grad = None
            tw.grad = None

        row["torch_fwd"] = best(fwd)
        row["torch_bwd"] = best(bwd)
    out["shapes"].append(row)
print(json.dumps(out))
