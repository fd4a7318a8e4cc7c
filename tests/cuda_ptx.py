#!/usr/bin/env python3
"""Compiles CUDA sources to PTX with NVRTC from NVIDIA's PyPI wheel (nvidia-cuda-nvrtc), on a
machine without a GPU: the check behind tests/cuda_sources.rs, so that a kernel that does not
compile fails CI before a GPU machine is ever lent.

stdin: a JSON list of {"path", "source", "fmad", "arch"}; argv[1]: the virtual architecture
(compute_90) for sources whose "arch" is null. stdout: a JSON list of {"path", "ok", "log", "target", "entries"}, one per source.
The options are the run time's (`kernels::cuda::RuntimeSource::ptx`: only `--fmad`) plus the
architecture.
"""
import ctypes
import importlib.metadata
import json
import re
import sys


def nvrtc_library():
    dist = importlib.metadata.distribution("nvidia-cuda-nvrtc")
    files = {f.name: dist.locate_file(f) for f in dist.files or []}
    lib = next((n for n in files if re.fullmatch(r"libnvrtc\.so(\.\d+)*", n)), None)
    builtins = next((n for n in files if re.fullmatch(r"libnvrtc-builtins\.so(\.\d+)*", n)), None)
    if lib is None or builtins is None:
        sys.exit(f"nvidia-cuda-nvrtc {dist.version} installs no libnvrtc.so / libnvrtc-builtins.so")
    # NVRTC opens its builtins by soname at compile time; the wheel's directory is on no search
    # path, so they are loaded first (a loaded soname is found without a search).
    ctypes.CDLL(str(files[builtins]), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(files[lib]))


def compile_one(nvrtc, arch, path, source, fmad):
    prog = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), path.encode(), 0, None, None)
    if status != 0:
        return {"path": path, "ok": False, "log": f"nvrtcCreateProgram: status {status}", "target": "", "entries": []}
    opts = [f"--gpu-architecture={arch}".encode(), f"--fmad={'true' if fmad else 'false'}".encode()]
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    ptx = ""
    if status == 0:
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, buf)
        ptx = buf.value.decode()
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    return {
        "path": path,
        "ok": status == 0,
        "log": log.value.decode(errors="replace").strip() or (f"status {status}" if status else ""),
        "target": target.group(1) if target else "",
        "entries": re.findall(r"\.entry\s+(\w+)", ptx),
    }


def main():
    arch = sys.argv[1]
    nvrtc = nvrtc_library()
    sources = json.load(sys.stdin)
    print(json.dumps([compile_one(nvrtc, s["arch"] or arch, s["path"], s["source"], s["fmad"]) for s in sources]))


if __name__ == "__main__":
    main()
