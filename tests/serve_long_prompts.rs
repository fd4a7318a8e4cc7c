//! Long prompts on a real server process: a conversation's second turn takes its first turn's
//! KV blocks from the prefix cache and answers exactly as a server without the cache does, and
//! a short request sent while a long prompt is being prefilled (in chunks) is answered before
//! that prompt's first token; a quantised model goes through the same chunks and cache; after a
//! burst of long prompts an idle server holds its prefix cache and little more.

mod common;

use std::time::{Duration, Instant};

use common::server::{post_json, slow_model, sse, Server};
use common::*;
use serde_json::{json, Value};

/// A system prompt of several hundred tokens, as agents and chat front-ends send on every turn.
fn long_system_prompt() -> String {
    (0..60).map(|i| format!("Rule {i}: answer briefly and cite the rule.")).collect::<Vec<_>>().join(" ")
}

fn chat(server: &Server, messages: &Value, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    post_json(&server.url("/v1/chat/completions"), &body)
}

fn answer(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

fn cached_tokens(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or_else(|| panic!("no cached_tokens in {usage}"))
}

#[test]
fn a_second_turn_reuses_the_first_turns_blocks_and_answers_as_without_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture_with("qwen2", &tmp.path().join("m"), &[("max_position_embeddings", 2048)]);
    let cached = Server::start(&model, &["--max-prefill-tokens", "100"]);
    let cold = Server::start(&model, &["--kv-cache-memory", "0", "--max-prefill-tokens", "100"]);
    let system = long_system_prompt();
    let mut messages = json!([{"role": "system", "content": system}, {"role": "user", "content": "What is rule 7?"}]);
    let first = chat(&cached, &messages, json!({"prompt_cache_key": "conversation-1"}));
    assert_eq!(answer(&first), answer(&chat(&cold, &messages, json!({}))), "first turn");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 300, "the first turn is long enough to fill blocks: {prompt_tokens} tokens");
    assert_eq!(cached_tokens(&first["usage"]), 0, "nothing was cached before the first turn");

    messages
        .as_array_mut()
        .unwrap()
        .extend([json!({"role": "assistant", "content": answer(&first)}), json!({"role": "user", "content": "And rule 12?"})]);
    let second = chat(&cached, &messages, json!({"prompt_cache_key": "conversation-1"}));
    let second_cold = chat(&cold, &messages, json!({}));
    assert_eq!(answer(&second), answer(&second_cold), "second turn, warm vs cold");
    let reused = cached_tokens(&second["usage"]);
    assert!(reused >= 256 && reused.is_multiple_of(64), "the first turn's full blocks are reused: {reused} of {prompt_tokens}");
    assert_eq!(cached_tokens(&second_cold["usage"]), 0, "--kv-cache-memory 0 caches nothing");

    // The same turn again, streamed: its whole prompt but the last partial block is cached,
    // and the streamed usage says so too.
    let events = sse(
        &cached.url("/v1/chat/completions"),
        &json!({"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    let chunks: Vec<Value> = events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, answer(&second), "streamed from the cache");
    let usage = chunks.iter().find(|c| !c["usage"].is_null()).expect("a usage chunk")["usage"].clone();
    assert!(cached_tokens(&usage) >= reused, "{usage}");
}

#[test]
fn a_short_request_is_answered_while_a_long_prompt_is_prefilled() {
    let tmp = tempfile::tempdir().unwrap();
    let model = slow_model(tmp.path());
    let server = Server::start(&model, &["--max-prefill-tokens", "64"]);
    let url = server.url("/v1/completions");
    // ~950 tokens: 15 chunks of 64, each a step the short request can join.
    let long_prompt: String = (0..90).map(|i| format!("line {i} of the log. ")).collect();
    let long = {
        let url = url.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let v = post_json(&url, &json!({"model": "tiny", "prompt": long_prompt, "max_tokens": 1, "temperature": 0}));
            (t.elapsed(), Instant::now(), v["usage"]["prompt_tokens"].as_u64().unwrap())
        })
    };
    // The long prompt is in the engine before the short one is sent.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = ureq::get(&server.url("/metrics")).call().unwrap().into_string().unwrap();
        if m.contains("fsdp_running_sequences 1") {
            break;
        }
        assert!(Instant::now() < deadline, "the long request never started:\n{m}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Instant::now();
    let short = post_json(&url, &json!({"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0}));
    let (short_latency, short_done) = (t.elapsed(), Instant::now());
    let (long_latency, long_done, long_tokens) = long.join().unwrap();
    eprintln!("short request {short_latency:?} during a {long_tokens}-token prefill that took {long_latency:?}");
    assert_eq!(short["usage"]["completion_tokens"], 2);
    assert!(long_tokens > 800, "{long_tokens}");
    // Loose on purpose (machines here are shared): the short answer comes first, well before
    // the long prompt's end, not after all of it as without chunked prefill.
    assert!(short_done < long_done, "the short request ({short_latency:?}) waited for the long prefill ({long_latency:?})");
    assert!(short_latency < long_latency / 2, "short {short_latency:?}, long {long_latency:?}");
}

#[test]
fn a_quantised_model_answers_the_same_in_small_chunks_and_from_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture_with("qwen2", &tmp.path().join("m"), &[("max_position_embeddings", 2048)]);
    let chunked = Server::start(&model, &["--quantize", "q8_0", "--max-prefill-tokens", "16"]);
    let whole = Server::start(&model, &["--quantize", "q8_0", "--max-prefill-tokens", "4096", "--kv-cache-memory", "0"]);
    let messages = json!([{"role": "system", "content": long_system_prompt()}, {"role": "user", "content": "What is rule 3?"}]);
    let first = chat(&chunked, &messages, json!({}));
    let reference = answer(&chat(&whole, &messages, json!({})));
    assert_eq!(answer(&first), reference, "16-token chunks vs the whole prompt in one forward");
    let again = chat(&chunked, &messages, json!({}));
    assert!(cached_tokens(&again["usage"]) >= 256, "{}", again["usage"]);
    assert_eq!(answer(&again), reference, "from the prefix cache");
}

/// Bytes of KV blocks the server's prefix cache holds (its `/metrics` gauge).
fn prefix_cache_bytes(server: &Server) -> u64 {
    let metrics = ureq::get(&server.url("/metrics")).call().unwrap().into_string().unwrap();
    let line = metrics.lines().find(|l| l.starts_with("fsdp_prefix_cache_bytes ")).expect("the prefix cache gauge");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A burst of eight long prompts at once, then idle: the resident set grows by what the prefix
/// cache now keeps (at most its budget) and little more. Each KV block is one allocation for all
/// layers; per-layer blocks of a few KiB, the cached ones interleaved with those freed, kept
/// allocator pages alive (75-85 MiB over the cache on SmolLM2, 29 now).
#[test]
fn an_idle_server_after_a_burst_of_long_prompts_holds_its_cache_and_little_more() {
    let Some(gguf) = smollm2_gguf_or_skip("an_idle_server_after_a_burst_of_long_prompts_holds_its_cache_and_little_more") else { return };
    let server = Server::start(&gguf, &["--kv-cache-memory", "256", "--max-queue-wait", "0"]);
    let url = server.url("/v1/completions");
    let words: String = (0..700).map(|i| format!(" word{i}")).collect();
    let complete = |prompt: String| post_json(&url, &json!({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}));
    // Warm: one long prompt has run (its one-off growth, and its blocks in the cache).
    complete(format!("warm{words}"));
    std::thread::sleep(Duration::from_millis(1500));
    let pid = server.child.id();
    let (start, cached_at_start) = (rss_of(pid), prefix_cache_bytes(&server));
    std::thread::scope(|s| {
        for k in 0..8 {
            let prompt = format!("{k}{words}");
            s.spawn(move || complete(prompt));
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let (idle, cached) = (rss_of(pid), prefix_cache_bytes(&server));
    assert!(cached <= 256 << 20 && cached > cached_at_start, "the cache keeps {cached} bytes (was {cached_at_start})");
    let over = (idle - start) as f64 / 1048576.0 - (cached - cached_at_start) as f64 / 1048576.0;
    eprintln!(
        "idle: {:.0} MiB above the start, the cache {:.0} MiB more",
        (idle - start) as f64 / 1048576.0,
        (cached - cached_at_start) as f64 / 1048576.0
    );
    // Below what the per-layer blocks kept, above what the allocator holds when this binary's
    // other servers run beside it.
    assert!(over < 56.0, "idle: {:.0} MiB above the start, {over:.0} MiB more than the cache's growth", (idle - start) as f64 / 1048576.0);
}
