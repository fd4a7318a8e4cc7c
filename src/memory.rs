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

/// The most memory in use at once from `device`'s CUDA memory pool (the stream-ordered
/// allocator candle's tensors come from) since [`reset_gpu_pool_peak`]; `None` on CPU.
pub fn gpu_pool_peak(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        let mut bytes = 0u64;
        gpu_pool_attribute(d, PoolAttribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut bytes, false)?;
        return Some(bytes);
    }
    let _ = device;
    None
}

/// (in use, reserved) bytes of `device`'s CUDA memory pool once the device has finished its
/// queued work; `None` on CPU. For FSDP_DEBUG_GPU_POOL's reports.
pub fn gpu_pool_now(device: &candle_core::Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        device.synchronize().ok()?;
        let (mut used, mut reserved) = (0u64, 0u64);
        gpu_pool_attribute(d, PoolAttribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &mut used, false)?;
        gpu_pool_attribute(d, PoolAttribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &mut reserved, false)?;
        return Some((used, reserved));
    }
    let _ = device;
    None
}

/// With FSDP_DEBUG_GPU_POOL set, `what()` and the pool's bytes in use and reserved on stderr
/// (the variable read once; the label made only when it is set: the loop calls this each
/// micro-batch).
pub fn debug_gpu_pool(device: &candle_core::Device, what: impl FnOnce() -> String) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("FSDP_DEBUG_GPU_POOL").is_some()) {
        if let Some((used, reserved)) = gpu_pool_now(device) {
            eprintln!("gpu pool: {}: {} in use, {} reserved", what(), human_bytes(used), human_bytes(reserved));
        }
    }
}

/// Starts [`gpu_pool_peak`]'s count again from what is in use now.
pub fn reset_gpu_pool_peak(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        // The driver takes only zero here: the peak restarts from the current use.
        let _ = gpu_pool_attribute(d, PoolAttribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut 0u64, true);
    }
    let _ = device;
}

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as PoolAttribute;

/// Reads (`set` false) or sets an attribute of the device's default memory pool, the one
/// cudarc's stream-ordered allocations use.
#[cfg(feature = "cuda")]
fn gpu_pool_attribute(d: &candle_core::CudaDevice, attribute: PoolAttribute, value: &mut u64, set: bool) -> Option<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = d.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().ok()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: the context is bound, `pool` and `value` are live for the calls, and the
    // attribute takes a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().ok()?;
        let v = value as *mut u64 as *mut std::ffi::c_void;
        if set {
            sys::cuMemPoolSetAttribute(pool, attribute, v).result().ok()?;
        } else {
            sys::cuMemPoolGetAttribute(pool, attribute, v).result().ok()?;
        }
    }
    Some(())
}

extern "C" {
    // mimalloc's `void mi_collect(bool force)` and its options, in the library the global
    // allocator links.
    fn mi_collect(force: bool);
    pub(crate) fn mi_option_set(option: i32, value: std::ffi::c_long);
}

/// For a server: freed memory goes back to the OS `delay_ms` after it was freed unless reused
/// by then, and at once on [`return_free_memory`]. This process otherwise never purges
/// (`process::keep_freed_memory`, for training's buffers reused every step), and mimalloc schedules a purge when
/// memory is freed, so a server that wants its idle memory back must say so before it serves.
/// A user's own MIMALLOC_PURGE_DELAY wins.
pub fn purge_freed_memory_after(delay_ms: u32) {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets a plain integer option, which mimalloc reads when memory is freed.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, delay_ms.into()) };
    }
}

/// Hands the memory the allocator keeps for reuse back to the OS now (what was freed since
/// [`purge_freed_memory_after`]): a server calls it when it goes idle, so that a long
/// request's KV blocks and activations leave the resident set when the request ends instead of
/// staying until the next one reuses them.
pub fn return_free_memory() {
    // SAFETY: no arguments to get wrong; mimalloc allows it from any thread at any time.
    unsafe { mi_collect(true) }
}

/// `mi_option_purge_delay` in the mimalloc (v3) that libmimalloc-sys 0.1.49 builds (its
/// `mimalloc.h`); -1 = never purge. `MIMALLOC_VERBOSE=1` lists it as `option 'purge_delay': -1`.
pub(crate) const MI_OPTION_PURGE_DELAY: i32 = 15;

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
