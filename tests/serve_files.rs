//! `POST /v1/files` against a real server: an upload streams to disk (the server's resident
//! memory does not grow with the file), one past `--max-upload-bytes` is a 413 naming the limit
//! and leaves nothing behind, and rows are checked by line (token ids inside the vocabulary).

mod common;

use std::io::{Cursor, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::server::*;
use common::*;
use serde_json::Value;

const BOUNDARY: &str = "----fsdpappstreamedupload";

/// Sends a multipart upload whose file part is `file` (read as it is sent, chunked), returning
/// the status and the JSON answer.
fn upload_stream(server: &Server, file: impl Read + Send + 'static) -> (u16, Value) {
    let head = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; \
         name=\"file\"; filename=\"big.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n"
    );
    let tail = format!("\r\n--{BOUNDARY}--\r\n");
    let body = Cursor::new(head.into_bytes()).chain(file).chain(Cursor::new(tail.into_bytes()));
    let resp = ureq::post(&server.url("/v1/files")).set("Content-Type", &format!("multipart/form-data; boundary={BOUNDARY}")).send(body);
    let (status, r) = match resp {
        Ok(r) => (r.status(), r),
        Err(ureq::Error::Status(s, r)) => (s, r),
        Err(e) => panic!("upload: {e}"),
    };
    (status, serde_json::from_str(&r.into_string().unwrap()).unwrap())
}

/// `rows` copies of one valid JSONL row, made as they are read.
fn repeated_rows(row: &'static [u8], rows: usize) -> impl Read + Send + 'static {
    std::iter::repeat_n(row, rows).fold(Box::new(std::io::empty()) as Box<dyn Read + Send>, |acc, r| Box::new(acc.chain(r)))
}

#[test]
fn a_200_mb_upload_streams_to_disk_and_the_servers_memory_stays_flat() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let data = tmp.path().join("data");
    let server = Server::start(&model, &["--data-dir", data.to_str().unwrap(), "--max-upload-bytes", &(256u64 << 20).to_string()]);
    // One row of ~1 KiB, 200,000 times: 200 MB.
    let row: &'static [u8] = Box::leak(format!("{{\"text\": \"{}\"}}\n", "lorem ipsum ".repeat(85)).into_bytes().into_boxed_slice());
    let rows = 200_000;
    let size = (row.len() * rows) as u64;
    assert!(size > 200_000_000, "{size}");
    let pid = server.child.id();
    let before = rss_of(pid);
    let (peak, done) = (Arc::new(AtomicU64::new(before)), Arc::new(AtomicBool::new(false)));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                peak.fetch_max(rss_of(pid), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    // The rows chained one by one would nest 200,000 readers: send them in blocks instead.
    let block = row.repeat(1000).leak();
    let (status, file) = upload_stream(&server, repeated_rows(block, rows / 1000));
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    assert_eq!(status, 200, "{file}");
    assert_eq!(file["bytes"].as_u64(), Some(size), "{file}");
    let grew = peak.load(Ordering::SeqCst).saturating_sub(before);
    eprintln!("server RSS before {} MiB, growth during a {} MB upload: {} MiB", before >> 20, size / 1_000_000, grew >> 20);
    assert!(grew < 64 << 20, "the server's RSS grew by {} MiB during a {} MB upload", grew >> 20, size / 1_000_000);
    let stored = data.join("files").join(format!("{}.jsonl", file["id"].as_str().unwrap()));
    assert_eq!(std::fs::metadata(&stored).unwrap().len(), size);
}

#[test]
fn an_upload_past_the_limit_is_a_413_naming_it_and_bad_rows_are_named_by_line_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let data = tmp.path().join("data");
    let server = Server::start(&model, &["--data-dir", data.to_str().unwrap(), "--max-upload-bytes", "4000"]);
    let (status, err) = upload_stream(&server, repeated_rows(b"{\"text\": \"hello there, a row of text\"}\n", 200));
    assert_eq!(status, 413, "{err}");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("4000 bytes") && message.contains("--max-upload-bytes"), "{err}");
    // Token ids outside the model's vocabulary are refused at upload, the line and id named.
    let (status, err) = upload(&server, "ids.jsonl", b"{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [1, 99999]}\n");
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["code"], "token_out_of_vocabulary", "{err}");
    assert!(err["error"]["message"].as_str().unwrap().starts_with("Line 2: token id 99999"), "{err}");
    // Nothing half-received or refused stays in the files directory.
    let left: Vec<_> = std::fs::read_dir(data.join("files")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // OpenAI's function-calling rows are taken; a call whose arguments are not JSON is named.
    let call = |arguments: &str| {
        serde_json::json!({"messages": [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"}, {"role": "assistant", "content": "18C.", "weight": 1}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
    };
    let (status, file) = upload(&server, "calls.jsonl", format!("{}\n", call("{\"city\": \"Oslo\"}")).as_bytes());
    assert_eq!(status, 200, "{file}");
    let (status, err) = upload(&server, "calls.jsonl", format!("{}\n{}\n", call("{}"), call("{oops")).as_bytes());
    assert_eq!(status, 400, "{err}");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("Line 2: messages[1].tool_calls[0].function.arguments: `arguments` is not JSON"), "{err}");
}
