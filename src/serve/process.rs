//! The operating-system side of fine-tuning jobs: their process groups (stopped as a whole on
//! cancel, shutdown or a restart) and a free port for their ranks' rendezvous.

/// SIGKILL to the process group `pgid` (a job's launcher and its ranks). Refuses the groups a
/// slip could turn into "everything" (0, 1) and the server's own group.
pub fn kill_group(pgid: u32) {
    // SAFETY: reads this process's group id.
    let own = unsafe { libc::getpgrp() } as u32;
    if pgid > 1 && pgid != own && pgid <= i32::MAX as u32 {
        // SAFETY: plain syscall on a positive process-group id.
        unsafe {
            libc::kill(-(pgid as i32), libc::SIGKILL);
        }
    }
}

/// Stops the group `pgid` left by a server that died, if one of our training processes leads it
/// (pids get reused: a stranger's group is left alone).
pub fn kill_stale_job_group(pgid: u32) {
    let cmdline = String::from_utf8_lossy(&std::fs::read(format!("/proc/{pgid}/cmdline")).unwrap_or_default()).to_string();
    if cmdline.contains("fsdp-app") || cmdline.contains("finetune") {
        kill_group(pgid);
    }
}

/// A TCP port free on this host now, for a job's rendezvous (29500, torchrun's default, if the
/// system will not say).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500)
}
