//! `serve` under SIGTERM, as a process manager stops it: a stream running when the signal comes
//! ends properly (its answer, or an error event, then `data: [DONE]`), new requests are refused,
//! a running fine-tuning job is cancelled with the reason and leaves no process behind, and the
//! server exits 0 within its grace period.

mod common;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use common::server::*;
use serde_json::{json, Value};

fn sigterm(pid: u32) {
    // SAFETY: a plain syscall on our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
}

/// Waits up to `secs` for the server to exit; its exit code.
fn exit_code(server: &mut Server, secs: u64) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        assert!(Instant::now() < deadline, "the server did not exit within {secs} s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether a process of group `pgid` still runs (zombies, dead and waiting for a parent to
/// reap them, do not count).
fn group_alive(pgid: i32) -> bool {
    std::fs::read_dir("/proc").unwrap().filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()).any(|pid| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // After the parenthesised command: state, ppid, pgrp.
        let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
        fields.len() > 2 && fields[0] != "Z" && fields[2].parse::<i32>().ok() == Some(pgid)
    })
}

#[test]
fn sigterm_ends_streams_properly_cancels_jobs_and_exits_0() {
    let tmp = tempfile::tempdir().unwrap();
    let model = slow_model(tmp.path());
    let data = tmp.path().join("data");
    let mut server = Server::start(&model, &["--shutdown-grace", "1", "--data-dir", data.to_str().unwrap()]);

    // A job that trains for a long time.
    let rows: String = (0..64).map(|i| format!("{{\"text\": \"row {i} of a long training file about lighthouses\"}}\n")).collect();
    let (status, uploaded) = upload(&server, "rows.jsonl", rows.as_bytes());
    assert_eq!(status, 200, "{uploaded}");
    let uploaded = uploaded["id"].as_str().unwrap().to_string();
    let job = post_json(
        &server.url("/v1/fine_tuning/jobs"),
        &json!({"model": "tiny", "training_file": uploaded, "fsdp_app": {"seq_len": 64, "max_steps": 100000}}),
    );
    let job_id = job["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(120);
    while get_json(&server.url(&format!("/v1/fine_tuning/jobs/{job_id}")))["status"] != "running" {
        assert!(Instant::now() < deadline, "the job never started");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Its process group: the launcher the server spawned leads one of its own.
    std::thread::sleep(Duration::from_secs(1));
    let server_pid = server.child.id() as i32;
    let pgid = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // Field 4 (after the parenthesised command) is the parent pid.
            let ppid = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(1)).and_then(|p| p.parse::<i32>().ok());
            ppid == Some(server_pid)
        })
        .map(|pid| unsafe { libc::getpgid(pid) })
        .expect("the job's launcher, a child of the server");
    assert_ne!(pgid, unsafe { libc::getpgid(server_pid) }, "the job runs in its own process group");
    assert!(group_alive(pgid));

    // A stream that outlives the grace period.
    let r = ureq::post(&server.url("/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(&json!({"model": "tiny", "prompt": "x", "max_tokens": 900, "temperature": 0, "stream": true}).to_string())
        .unwrap();
    let mut lines =
        BufReader::new(r.into_reader()).lines().map(Result::unwrap).filter_map(|l| l.strip_prefix("data: ").map(str::to_string));
    lines.next().expect("a first chunk");
    let signalled = Instant::now();
    sigterm(server.child.id());
    std::thread::sleep(Duration::from_millis(200));
    // No new work: the listener is closed (a new connection is refused).
    match ureq::get(&server.url("/v1/models")).call() {
        Err(ureq::Error::Status(503, _)) | Err(ureq::Error::Transport(_)) => {}
        other => panic!("a request after SIGTERM got {other:?}"),
    }

    let rest: Vec<String> = lines.collect();
    assert_eq!(
        rest.last().map(String::as_str),
        Some("[DONE]"),
        "the stream ends with [DONE]: {:?}",
        rest.iter().rev().take(3).collect::<Vec<_>>()
    );
    let before_done: Value = serde_json::from_str(&rest[rest.len() - 2]).unwrap();
    assert!(
        before_done["error"]["code"] == "server_shutting_down" || before_done["choices"][0]["finish_reason"].is_string(),
        "an error event or the answer's end before [DONE]: {before_done}"
    );
    assert!(signalled.elapsed() < Duration::from_secs(10), "the stream was ended {:?} after SIGTERM (grace 1 s)", signalled.elapsed());
    assert_eq!(exit_code(&mut server, 15), 0, "exit code after SIGTERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while group_alive(pgid) {
        assert!(Instant::now() < deadline, "the job's processes outlived the server");
        std::thread::sleep(Duration::from_millis(100));
    }

    // The job was cancelled with the reason, as the next start shows.
    let server = Server::start(&model, &["--data-dir", data.to_str().unwrap()]);
    let job = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{job_id}")));
    assert_eq!(job["status"], "cancelled", "{job}");
    assert_eq!(job["error"]["code"], "server_shutdown", "{job}");
    assert!(job["error"]["message"].as_str().unwrap().contains("SIGTERM"), "{job}");
}
