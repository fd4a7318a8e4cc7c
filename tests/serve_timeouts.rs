//! `serve` against clients that stall, with real sockets: a connection stalled in its headers,
//! one stalled in its body and an idle keep-alive connection are closed within their timeouts
//! while a normal client is served, and a slow upload that keeps sending is not cut; a client
//! address over `--max-connections-per-ip` gets 429.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::server::*;
use common::*;
use serde_json::json;

/// Reads until the server closes the connection (or `limit` passes); what it sent and when.
fn read_until_closed(mut s: TcpStream, limit: Duration) -> (String, Duration) {
    let start = Instant::now();
    s.set_read_timeout(Some(limit)).unwrap();
    let mut got = vec![];
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("the server kept the connection open for {:?}: {e}", start.elapsed()),
        }
    }
    (String::from_utf8_lossy(&got).to_string(), start.elapsed())
}

fn connect(server: &Server) -> TcpStream {
    TcpStream::connect(server.url("").trim_start_matches("http://")).unwrap()
}

#[test]
fn stalled_and_idle_connections_are_closed_and_slow_uploads_are_not() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &["--header-timeout", "1", "--body-timeout", "1"]);
    let limit = Duration::from_secs(5);

    // Stalled in its headers.
    let mut head = connect(&server);
    head.write_all(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: appl").unwrap();
    // Stalled in its body: 10 of 100 bytes.
    let mut body = connect(&server);
    body.write_all(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        .unwrap();
    // Idle: connected, sends nothing.
    let idle = connect(&server);
    // A keep-alive connection that answered one request, then idles.
    let mut kept = connect(&server);
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();

    // A normal client is served meanwhile.
    let answer = post_json(&server.url("/tokenize"), &json!({"prompt": "hello"}));
    assert!(answer["count"].as_u64().unwrap() > 0);

    let (text, took) = read_until_closed(head, limit);
    assert!(took < Duration::from_secs(4), "stalled head closed after {took:?}: {text}");
    let (text, took) = read_until_closed(body, limit);
    assert!(took < Duration::from_secs(4) && text.starts_with("HTTP/1.1 408"), "stalled body after {took:?}: {text}");
    assert!(text.contains("--body-timeout"), "{text}");
    let (_, took) = read_until_closed(idle, limit);
    assert!(took < Duration::from_secs(4), "idle connection closed after {took:?}");
    let (text, took) = read_until_closed(kept, limit);
    assert!(text.starts_with("HTTP/1.1 200") && took < Duration::from_secs(4), "keep-alive connection after {took:?}: {text}");

    // A body trickled a byte every 0.3 s (6 s in all, six times the body timeout) goes through.
    let payload = json!({"prompt": "slow but steady"}).to_string();
    let mut slow = connect(&server);
    write!(
        slow,
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        payload.len()
    )
    .unwrap();
    let started = Instant::now();
    for b in payload.bytes() {
        slow.write_all(&[b]).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    let (text, _) = read_until_closed(slow, limit);
    assert!(started.elapsed() > Duration::from_secs(3), "the upload was not slow");
    assert!(text.starts_with("HTTP/1.1 200") && text.contains("\"count\""), "slow upload: {text}");
}

/// `--max-connections-per-ip 2`: a third connection from the same address is answered 429 in
/// OpenAI's error shape and closed (counted in /metrics); once one closes, a new one is served.
#[test]
fn connections_over_the_per_address_limit_get_429_and_are_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &["--max-connections-per-ip", "2"]);
    let first = connect(&server);
    let second = connect(&server);
    // Both are counted once the server has accepted them: a request on each proves it.
    for mut s in [&first, &second] {
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
    }
    let mut third = connect(&server);
    third.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let (text, took) = read_until_closed(third, Duration::from_secs(5));
    assert!(
        text.starts_with("HTTP/1.1 429") && text.contains("too_many_connections") && text.contains("--max-connections-per-ip"),
        "{text}"
    );
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    drop(first);
    // The slot frees when the server sees the close: poll until a new connection is served.
    // A poll that races the close is itself refused with a 429, and counted: expect those too.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut refused = 1;
    let metrics = loop {
        match ureq::get(&server.url("/metrics")).call() {
            Ok(r) => break r.into_string().unwrap(),
            Err(ureq::Error::Status(429, _)) => refused += 1,
            Err(e) => panic!("polling /metrics: {e}"),
        }
        assert!(Instant::now() < deadline, "no slot freed after the close");
        std::thread::sleep(Duration::from_millis(100));
    };
    let line = format!("fsdp_requests_total{{status=\"429\"}} {refused}\n");
    assert!(metrics.contains(&line), "expected {line:?} in {metrics}");
    drop(second);
}
