//! Ctrl-C (SIGINT) or SIGTERM during `finetune`: the process exits at once with 128 + the
//! signal's number (130 for SIGINT, what a shell reports for Ctrl-C; 143 for SIGTERM), and rank
//! 0 first says which checkpoint the run can resume from, or that it has none.
//!
//! The signals are blocked in the calling thread before any rank starts, so every thread the run
//! starts inherits the block, and one thread of our own takes them with `sigwait`: no code runs in
//! a signal handler, and the message can read the output directory.

use std::path::PathBuf;

use crate::checkpoint::sharded;

/// Takes SIGINT and SIGTERM for the rest of the process's life (see the module's comment). Call
/// it before any other thread starts. `speaks`: this process is rank 0 (or all ranks).
pub fn exit_saying_how_to_resume(output_dir: PathBuf, speaks: bool) -> anyhow::Result<()> {
    // SAFETY: plain signal-mask calls on a set built here.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        anyhow::ensure!(rc == 0, "blocking SIGINT/SIGTERM failed ({rc})");
        set
    };
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        let mut signal = 0;
        // SAFETY: waits on the set blocked above.
        if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
            return;
        }
        let name = if signal == libc::SIGINT { "SIGINT" } else { "SIGTERM" };
        if speaks {
            eprintln!("\n{name}: stopped; {}", how_to_resume(&output_dir));
        }
        std::process::exit(128 + signal);
    })?;
    Ok(())
}

/// The newest checkpoint under `output_dir` and the flag that resumes from it. A checkpoint is
/// renamed into place only when complete; hashing its files here would keep the user waiting
/// (resuming verifies them).
fn how_to_resume(output_dir: &std::path::Path) -> String {
    match sharded::checkpoint_dirs(output_dir).into_iter().next() {
        Some((step, dir)) => format!(
            "the newest checkpoint is {} (step {step}): run the same command with --resume-from-checkpoint {} (or `latest`) to continue",
            dir.display(),
            dir.display()
        ),
        None => format!(
            "no checkpoint was saved under {} yet, so the run cannot be resumed (--save-steps N saves one every N steps)",
            output_dir.display()
        ),
    }
}
