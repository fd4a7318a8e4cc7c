//! Every CUDA source of ours compiles to PTX for the GPUs we run on (sm_90: H100 and H200), on
//! this machine without a GPU: NVRTC from NVIDIA's PyPI wheel (`tests/cuda_ptx.py`) with the
//! options the run time uses (`kernels::cuda::RuntimeSource::ptx`). A GPU machine is lent to a
//! session rarely and for minutes; a kernel that does not compile must fail here, not there.
//! Likewise the scripts a lent machine runs (`tests/gpu/*.sh`) must at least parse.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

/// The NVRTC of the CUDA 13.0 set the GPU machine's PyTorch carries (tests/gpu/build-cuda.sh).
const NVRTC: &str = "nvidia-cuda-nvrtc==13.0.88:nvidia.cu13";

/// H100 / H200.
const ARCH: &str = "compute_90";

#[test]
fn every_cuda_source_compiles_to_ptx_for_sm_90() {
    let test = "every_cuda_source_compiles_to_ptx_for_sm_90";
    // Every `.cu` in the sources' directory is one the table compiles (a new one left out of
    // `kernels::cuda::ALL` would never be loaded, or checked).
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/kernels/src/cuda");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".cu"))
        .map(|name| format!("models/kernels/src/cuda/{name}"))
        .collect();
    let mut listed: Vec<String> = kernels::cuda::ALL.iter().map(|s| s.path().to_string()).collect();
    on_disk.sort();
    listed.sort();
    assert_eq!(on_disk, listed, "the .cu files in {} and kernels::cuda::ALL differ", dir.display());

    let Some(python) = common::python_or_skip(test, &[NVRTC]) else { return };
    let sources: Vec<_> = kernels::cuda::ALL
        .iter()
        .map(|s| serde_json::json!({"path": s.path(), "source": s.source(), "fmad": s.fmad(), "arch": s.arch()}))
        .collect();
    let mut child = Command::new(&python)
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_ptx.py"))
        .arg(ARCH)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(serde_json::to_string(&sources).unwrap().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "cuda_ptx.py failed: {}", String::from_utf8_lossy(&out.stderr));
    let results: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(results.len(), sources.len());
    let mut failures = vec![];
    for (r, source) in results.iter().zip(kernels::cuda::ALL) {
        let path = r["path"].as_str().unwrap();
        // PTX for an older architecture (a source's own, for the instructions it needs) loads on
        // the newer GPUs too.
        let target = source.arch().unwrap_or(ARCH).replace("compute_", "sm_");
        let entries: Vec<&str> = r["entries"].as_array().unwrap().iter().filter_map(|e| e.as_str()).collect();
        if r["ok"] != true {
            failures.push(format!("{path}:\n{}", r["log"].as_str().unwrap_or("")));
        } else if r["target"] != target.as_str() || entries.is_empty() {
            failures.push(format!("{path}: PTX for {} with kernels {entries:?}", r["target"]));
        } else {
            println!("{path}: {target}, kernels {entries:?}");
        }
    }
    assert!(failures.is_empty(), "NVRTC ({ARCH}) refused:\n{}", failures.join("\n"));
}

/// `bash -n` over every script of tests/gpu/: a quote or a `fi` missing would otherwise show only
/// on a lent machine, after its start has taken minutes of its time.
#[test]
fn the_gpu_machine_scripts_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gpu");
    let scripts: Vec<_> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "sh")).collect();
    assert!(scripts.iter().any(|p| p.ends_with("run.sh")), "no run.sh in {}", dir.display());
    for script in &scripts {
        let out = Command::new("bash").arg("-n").arg(script).output().expect("bash");
        assert!(out.status.success(), "{}: {}", script.display(), String::from_utf8_lossy(&out.stderr));
    }
}
