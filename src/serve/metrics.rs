//! Prometheus metrics: requests by status, queue size, running sequences, time to first token
//! and inter-token latency histograms, generated tokens.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    total: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len()];
        }
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.total += 1;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (i, b) in BUCKETS.iter().enumerate() {
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {}\n", self.counts.get(i).copied().unwrap_or(0)));
        }
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}\n", self.total, self.sum, self.total));
    }
}

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<u16, u64>>,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
    tokens: AtomicU64,
    cancelled: AtomicU64,
    stream_errors: AtomicU64,
    queue_timeouts: AtomicU64,
    prefix_cache_bytes: AtomicU64,
}

impl Metrics {
    pub fn request(&self, status: u16) {
        *self.requests.lock().unwrap().entry(status).or_default() += 1;
    }
    pub fn time_to_first_token(&self, s: f64) {
        self.ttft.lock().unwrap().observe(s);
    }
    pub fn inter_token_latency(&self, s: f64) {
        self.itl.lock().unwrap().observe(s);
    }
    pub fn generated_tokens(&self, n: u64) {
        self.tokens.fetch_add(n, Ordering::Relaxed);
    }
    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }
    /// Bytes of KV blocks the prefix cache holds now (the engine sets it after each step).
    pub fn prefix_cache_bytes(&self, bytes: usize) {
        self.prefix_cache_bytes.store(bytes as u64, Ordering::Relaxed);
    }
    /// A sequence waited past `--max-queue-wait` and was answered 429 without running.
    pub fn queue_timeout(&self) {
        self.queue_timeouts.fetch_add(1, Ordering::Relaxed);
    }
    /// A stream that had answered 200 ended with an error event (the engine failed, or the
    /// server shut down): the status counter cannot show it.
    pub fn stream_error(&self) {
        self.stream_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn render(&self, queued: usize, running: usize) -> String {
        let mut out = String::new();
        out.push_str("# HELP fsdp_requests_total HTTP requests by status code.\n# TYPE fsdp_requests_total counter\n");
        for (status, n) in self.requests.lock().unwrap().iter() {
            out.push_str(&format!("fsdp_requests_total{{status=\"{status}\"}} {n}\n"));
        }
        out.push_str(&format!(
            "# HELP fsdp_queue_size Requests waiting for a slot.\n# TYPE fsdp_queue_size gauge\nfsdp_queue_size {queued}\n"
        ));
        out.push_str(&format!("# HELP fsdp_running_sequences Sequences being generated.\n# TYPE fsdp_running_sequences gauge\nfsdp_running_sequences {running}\n"));
        self.ttft.lock().unwrap().render("fsdp_time_to_first_token_seconds", "Time from admission to the first token.", &mut out);
        self.itl.lock().unwrap().render("fsdp_inter_token_latency_seconds", "Time between consecutive tokens of a sequence.", &mut out);
        out.push_str(&format!(
            "# HELP fsdp_generated_tokens_total Tokens generated.\n# TYPE fsdp_generated_tokens_total counter\nfsdp_generated_tokens_total {}\n",
            self.tokens.load(Ordering::Relaxed)
        ));
        out.push_str(&format!(
            "# HELP fsdp_cancelled_sequences_total Sequences dropped because their client disconnected.\n# TYPE fsdp_cancelled_sequences_total counter\nfsdp_cancelled_sequences_total {}\n",
            self.cancelled.load(Ordering::Relaxed)
        ));
        out.push_str(&format!(
            "# HELP fsdp_stream_errors_total Streams ended by an error event after their 200 (engine failure, shutdown).\n# TYPE fsdp_stream_errors_total counter\nfsdp_stream_errors_total {}\n",
            self.stream_errors.load(Ordering::Relaxed)
        ));
        out.push_str(&format!(
            "# HELP fsdp_prefix_cache_bytes Bytes of KV blocks the prefix cache keeps (at most --kv-cache-memory).\n# TYPE fsdp_prefix_cache_bytes gauge\nfsdp_prefix_cache_bytes {}\n",
            self.prefix_cache_bytes.load(Ordering::Relaxed)
        ));
        out.push_str(&format!(
            "# HELP fsdp_queue_timeouts_total Sequences answered 429 after waiting longer than --max-queue-wait.\n# TYPE fsdp_queue_timeouts_total counter\nfsdp_queue_timeouts_total {}\n",
            self.queue_timeouts.load(Ordering::Relaxed)
        ));
        out
    }
}
