#!/usr/bin/env python3
"""Parquet copies of test data, written by pyarrow as `datasets` writes them.

    pip install pyarrow
    python3 tests/data/make_parquet.py

zephyrix-codename.parquet       the chat rows of zephyrix-codename.jsonl (messages: list of
                                {role, content} structs), snappy (pyarrow's default)
alpaca-zstd.parquet             Alpaca rows (instruction/input/output), zstd, 2 row groups
"""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))

with open(os.path.join(HERE, "zephyrix-codename.jsonl")) as f:
    rows = [json.loads(l) for l in f if l.strip()]
pq.write_table(pa.Table.from_pylist(rows), os.path.join(HERE, "zephyrix-codename.parquet"), compression="snappy")

alpaca = [
    {"instruction": f"Add {i} and {i + 1}.", "input": "" if i % 2 else f"numbers {i}, {i + 1}", "output": str(2 * i + 1)}
    for i in range(10)
]
pq.write_table(pa.Table.from_pylist(alpaca), os.path.join(HERE, "alpaca-zstd.parquet"), compression="zstd", row_group_size=6)
with open(os.path.join(HERE, "alpaca.jsonl"), "w") as f:
    for r in alpaca:
        f.write(json.dumps(r) + "\n")
