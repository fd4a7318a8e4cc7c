//! Process memory figures for the CLI's reports, and handing freed memory back to the OS.

/// Peak resident set size of this process in bytes (`VmHWM` from /proc), if the OS tells.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Memory in use on `device`'s GPU as the driver reports it (total minus free: this process's
/// allocations and the pools it keeps, plus any other process on that GPU); `None` on CPU.
pub fn gpu_memory_used(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        let (free, total) = d.cuda_stream().context().mem_get_info().ok()?;
        return Some((total - free) as u64);
    }
    let _ = device;
    None
}

/// Hands the memory the allocator keeps for reuse (mimalloc, `lib.rs`) back to the OS: a
/// server calls it when it goes idle, so that a long request's KV blocks and activations leave
/// the resident set when the request ends instead of staying until the next one reuses them.
pub fn return_free_memory() {
    extern "C" {
        // mimalloc's `void mi_collect(bool force)`, in the library the global allocator links.
        fn mi_collect(force: bool);
    }
    // SAFETY: no arguments to get wrong; mimalloc allows it from any thread at any time.
    unsafe { mi_collect(true) }
}

/// "123.4 MiB" style, for humans.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_rss_is_reported_on_linux() {
        let rss = super::peak_rss_bytes().expect("VmHWM in /proc/self/status");
        assert!(rss > 1024 * 1024, "{rss}");
        assert_eq!(super::human_bytes(1536), "1.5 KiB");
    }
}
