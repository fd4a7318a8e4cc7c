//! A stand-in for the Hugging Face Hub for the tests: a small HTTP server that serves files under
//! the Hub's URL scheme (`/{repo}/resolve/{revision}/{file}`, with the headers the hf-hub client
//! reads), so the real hf-hub client inside `fsdp-app` downloads from it through HF_ENDPOINT.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// One logged request: path and Authorization header.
pub type Log = Arc<Mutex<Vec<(String, Option<String>)>>>;

pub struct HubServer {
    port: u16,
    pub log: Log,
    stop: Arc<AtomicBool>,
}

impl HubServer {
    /// Serves `files` (name -> bytes) for `repo` at any revision.
    pub fn start(repo: &str, files: HashMap<String, Vec<u8>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let log: Log = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (log2, stop2, repo) = (log.clone(), stop.clone(), repo.to_string());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(conn) = conn {
                    handle(conn, &repo, &files, &log2);
                }
            }
        });
        Self { port, log, stop }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn requested_files(&self) -> Vec<String> {
        let mut v: Vec<String> = self.log.lock().unwrap().iter().map(|(p, _)| p.rsplit('/').next().unwrap().to_string()).collect();
        v.sort();
        v.dedup();
        v
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn handle(mut conn: TcpStream, repo: &str, files: &HashMap<String, Vec<u8>>, log: &Log) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.trim_end().split_once(':') {
            headers.insert(k.to_ascii_lowercase(), v.trim().to_string());
        }
    }
    log.lock().unwrap().push((path.clone(), headers.get("authorization").cloned()));
    let prefix = format!("/{repo}/resolve/");
    let file = path.strip_prefix(&prefix).and_then(|rest| rest.split_once('/')).map(|(_, f)| f.to_string());
    let body = file.as_ref().and_then(|f| files.get(f));
    let response = match body {
        None => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nX-Error-Code: EntryNotFound\r\nConnection: close\r\n\r\n".to_vec(),
        Some(data) => {
            // hf-hub asks for `bytes=0-0` to learn size, etag and commit, then `bytes=N-`.
            let start: usize = headers
                .get("range")
                .and_then(|r| r.strip_prefix("bytes="))
                .and_then(|r| r.split('-').next())
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let end = match headers.get("range").map(|r| r.ends_with("-0")) {
                Some(true) => 1.min(data.len()),
                _ => data.len(),
            };
            let chunk = &data[start.min(data.len())..end.max(start.min(data.len()))];
            let etag = format!("{:016x}", fnv(data));
            let mut r = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {}-{}/{}\r\nETag: \"{etag}\"\r\nX-Repo-Commit: {COMMIT}\r\nConnection: close\r\n\r\n",
                chunk.len(),
                start,
                (start + chunk.len()).saturating_sub(1),
                data.len()
            )
            .into_bytes();
            r.extend_from_slice(chunk);
            r
        }
    };
    let _ = conn.write_all(&response);
    let _ = conn.flush();
    // Drain anything left so the client sees a clean close.
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_millis(10)));
    let _ = reader.read(&mut [0u8; 16]);
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The files of a directory (not its subdirectories), by name.
pub fn dir_files(dir: &Path) -> HashMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().to_string(), std::fs::read(e.path()).unwrap())
        })
        .collect()
}
