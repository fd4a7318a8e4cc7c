//! Ids, timestamps and seeds the server hands out (OpenAI's id prefixes, Unix seconds).

pub fn now_s() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// A random id with OpenAI's prefixes (`file-`, `ftjob-`, `ftevent-`, `ftckpt-`).
pub fn new_id(prefix: &str) -> String {
    let mut s = fresh_seed();
    let a = kernels::rng::splitmix64(&mut s);
    let b = kernels::rng::splitmix64(&mut s);
    format!("{prefix}-{a:016x}{:08x}", b as u32)
}

/// A fresh call id, OpenAI's spelling (`call_...`).
pub fn new_call_id() -> String {
    new_id("call").replace("call-", "call_")
}

/// A seed no other call in this process (or another process at the same instant) gets: time,
/// pid and a counter mixed. For ids and for requests that give no `seed`.
pub fn fresh_seed() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        ^ ((std::process::id() as u64) << 32)
        ^ COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    kernels::rng::splitmix64(&mut s)
}
