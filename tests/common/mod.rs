//! Helpers shared by the integration tests: fixture directories, the CLI binary, reference files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{Device, Tensor};

pub const FIXTURES: &[&str] = fsdp_app::fixtures::FIXTURE_NAMES;

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fsdp-app"))
}

/// Writes fixture `name` into a fresh subdirectory of `root` and returns its path.
pub fn fixture(name: &str, root: &Path) -> PathBuf {
    let dir = root.join(name);
    fsdp_app::fixtures::write_fixture(name, &dir).expect("writing fixture");
    dir
}

pub fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("reference")
}

pub fn reference_tensors(name: &str) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(reference_dir().join(name), &Device::Cpu).expect("reference file")
}

pub fn reference_json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(reference_dir().join(name)).expect("reference file");
    serde_json::from_str(&text).unwrap()
}

pub fn ids_u32(t: &Tensor) -> Vec<u32> {
    t.to_dtype(candle_core::DType::I64).unwrap().flatten_all().unwrap().to_vec1::<i64>().unwrap().iter().map(|&x| x as u32).collect()
}

pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Runs the CLI with `args` and extra environment variables.
pub fn run_cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.env_remove("RUST_BACKTRACE");
    cmd.output().expect("running fsdp-app")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}
