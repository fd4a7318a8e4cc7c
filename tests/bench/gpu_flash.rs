//! `gpu-bench flash`: the flash-attention kernels alone, forward and backward, causal, bf16,
//! token-major as training runs them, beside PyTorch's `scaled_dot_product_attention` at the
//! same shapes (tests/bench/torch_gpu_attention.py): its own choice of kernel and each backend
//! forced. Each variant of ours that a switch picks (flash_attention_cuda's `variants`, read
//! once a process) runs in a process of its own, this binary again with `flash-variant`, so that
//! one call measures them all; seconds where `run.sh ab` takes a training run a row.
//!
//! With CUDA_INJECTION64_PATH naming tests/gpu/kernel_profile.c's library and
//! KERNEL_PROFILE_OUT a path, each process (ours per variant, and PyTorch's) writes its kernel
//! profile to that path with `-<label>.txt` added: dq's, dk/dv's and the group sum's times apart.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use ops::visibility::Visibility;
use serde_json::{json, Value};

/// The shapes: the GPU bench's 1.1B Llama's attention at its two batches, and 128-value heads.
const SHAPES: [Shape; 3] = [
    Shape { batch: 8, t: 2048, heads: 32, kv_heads: 8, head_dim: 64 },
    Shape { batch: 1, t: 2048, heads: 32, kv_heads: 8, head_dim: 64 },
    Shape { batch: 4, t: 2048, heads: 16, kv_heads: 4, head_dim: 128 },
];
const REPS: usize = 10;

/// Our variants: a label and the switches that pick it (their meaning: docs/gpu.md).
const VARIANTS: [(&str, &[(&str, &str)]); 4] = [
    ("default", &[]),
    ("one forward group", &[("FSDP_FLASH_FORWARD_GROUPS", "1")]),
    ("32-key dq", &[("FSDP_FLASH_DQ_KEYS", "32")]),
    ("32-query dkv", &[("FSDP_FLASH_DKV_QUERIES", "32")]),
];

#[derive(Clone, Copy)]
struct Shape {
    batch: usize,
    t: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Shape {
    fn label(&self) -> String {
        format!("{} x {}, {}/{} heads of {}", self.batch, self.t, self.heads, self.kv_heads, self.head_dim)
    }

    /// The forward's FLOPs under a causal mask (FlashAttention's count: two products, half the
    /// scores); the backward's are 2.5 times as many.
    fn forward_flops(&self) -> f64 {
        2.0 * (self.batch * self.heads * self.t * self.t * self.head_dim) as f64
    }
}

/// The child's part: each shape's median forward and backward milliseconds, one JSON line each.
pub fn variant() -> anyhow::Result<()> {
    let dev = Device::new_cuda(0)?;
    for shape in SHAPES {
        let Shape { batch, t, heads, kv_heads, head_dim } = shape;
        let random = |h: usize| Tensor::randn(0f32, 1.0, (batch, t, h, head_dim), &dev)?.to_dtype(DType::BF16);
        let (q, k, v) = (random(heads)?, random(kv_heads)?, random(kv_heads)?);
        // In the output's shape, (batch, T, heads · d).
        let dout = random(heads)?.reshape((batch, t, heads * head_dim))?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let (mut forward, mut backward) = (vec![], vec![]);
        for rep in 0..2 + REPS {
            dev.synchronize()?;
            let start = Instant::now();
            let (_, kept) = ops::flash_attention::attention_token_major_kept(&q, &k, &v, Visibility::causal(0, None), scale)?;
            dev.synchronize()?;
            let mid = Instant::now();
            kept.backward(&dout)?;
            dev.synchronize()?;
            if rep >= 2 {
                forward.push((mid - start).as_secs_f64() * 1e3);
                backward.push(mid.elapsed().as_secs_f64() * 1e3);
            }
        }
        println!("{}", json!({"shape": shape.label(), "forward_ms": super::median(forward), "backward_ms": super::median(backward)}));
    }
    Ok(())
}

/// The table: a row per shape and implementation. Returns how many of them failed.
pub fn run(python: &str, scripts: &Path) -> anyhow::Result<usize> {
    let exe = std::env::current_exe()?;
    let profile = std::env::var("KERNEL_PROFILE_OUT").ok();
    let profile_to = |cmd: &mut Command, label: &str| {
        if let Some(base) = &profile {
            cmd.env("KERNEL_PROFILE_OUT", format!("{base}-{}.txt", label.replace(' ', "-")));
        }
    };
    let mut failures = 0;
    // Per variant, the shapes' lines, or why the process failed.
    let ours: Vec<(&str, Result<Vec<Value>, String>)> = VARIANTS
        .iter()
        .map(|(label, switches)| {
            let mut cmd = Command::new(&exe);
            cmd.arg("flash-variant").envs(switches.iter().copied());
            profile_to(&mut cmd, label);
            let lines = match cmd.output() {
                Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| l.starts_with('{'))
                    .map(serde_json::from_str)
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string()),
                Ok(o) => Err(String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed").to_string()),
                Err(e) => Err(e.to_string()),
            };
            (*label, lines)
        })
        .collect();

    println!("\n(c) Flash attention alone: causal, bf16, token-major q, k, v; median of {REPS} passes after 2 (PyTorch: sdpa as transformers calls it)\n");
    println!("| shape | implementation | forward ms | TFLOP/s | backward ms | TFLOP/s | forward + backward vs PyTorch's default |");
    println!("|---|---|---|---|---|---|---|");
    for shape in SHAPES {
        let label = shape.label();
        let mut cmd = Command::new(python);
        cmd.arg(scripts.join("torch_gpu_attention.py"));
        cmd.args([shape.batch, shape.t, shape.heads, shape.kv_heads, shape.head_dim, REPS].map(|n| n.to_string()));
        profile_to(&mut cmd, &format!("pytorch b{} d{}", shape.batch, shape.head_dim));
        let theirs = super::python_json_from(cmd);
        let total = |row: &Value| Some(row["forward_ms"].as_f64()? + row["backward_ms"].as_f64()?);
        let baseline = theirs.as_ref().ok().and_then(|t| total(&t["rows"][0]));
        let row = |name: &str, r: &Value| {
            let (f, b) = (r["forward_ms"].as_f64().unwrap_or(f64::NAN), r["backward_ms"].as_f64().unwrap_or(f64::NAN));
            let rate = |flops: f64, ms: f64| flops / (ms * 1e-3) / 1e12;
            let ratio = baseline.zip(total(r)).map(|(p, o)| format!("{:.2}x", p / o)).unwrap_or_default();
            let fl = shape.forward_flops();
            println!("| {label} | {name} | {f:.3} | {:.0} | {b:.3} | {:.0} | {ratio} |", rate(fl, f), rate(2.5 * fl, b));
        };
        for (variant, lines) in &ours {
            match lines {
                Ok(lines) => match lines.iter().find(|l| l["shape"] == label) {
                    Some(r) => row(&format!("fsdp-app, {variant}"), r),
                    None => {
                        failures += 1;
                        println!("| {label} | fsdp-app, {variant} | failed: no line for this shape | | | | |");
                    }
                },
                Err(why) => {
                    failures += 1;
                    println!("| {label} | fsdp-app, {variant} | failed: {why} | | | | |");
                }
            }
        }
        match &theirs {
            Ok(t) => {
                for r in t["rows"].as_array().into_iter().flatten() {
                    let name = format!("PyTorch {}, {}", t["torch"].as_str().unwrap_or("?"), r["backend"].as_str().unwrap_or("?"));
                    match r["error"].as_str() {
                        Some(why) => println!("| {label} | {name} | n/a: {why} | | | | |"),
                        None => row(&name, r),
                    }
                }
            }
            Err(why) => println!("| {label} | PyTorch | n/a: {why} | | | | |"),
        }
    }
    println!("\nTFLOP/s: FlashAttention's count (causal: half of 4 x batch x heads x T^2 x d forward, 2.5 times that backward).");
    Ok(failures)
}
