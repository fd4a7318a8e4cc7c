//! Several stop strings against a real server: the earliest match in the text wins, whatever the
//! order of the list, also when one token completes both; a stop string may span two tokens; the
//! streamed answer ends where the whole one does (the stop string itself is not returned).

mod common;

use common::server::*;
use common::*;
use serde_json::{json, Value};

/// The `len` bytes of `text` at `at` when they are ASCII letters, digits and spaces, beginning
/// and ending with a letter or digit (None otherwise).
fn piece(text: &str, at: usize, len: usize) -> Option<&str> {
    let s = text.get(at..at + len)?;
    let b = s.as_bytes();
    let ok =
        b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b' ') && b[0].is_ascii_alphanumeric() && b[len - 1].is_ascii_alphanumeric();
    ok.then_some(s)
}

#[test]
fn the_earliest_of_several_stop_strings_wins_streamed_and_not() {
    // A model that writes words (a tiny random one writes bytes that are not text).
    let Some(gguf) = smollm2_gguf_or_skip("the_earliest_of_several_stop_strings_wins_streamed_and_not") else { return };
    let server = Server::start(&gguf, &[]);
    let url = server.url("/v1/completions");
    let request = |extra: Value| {
        let mut body = json!({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0, "logprobs": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let plain = post_json(&url, &request(json!({})));
    let text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let tokens: Vec<String> =
        plain["choices"][0]["logprobs"]["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
    assert_eq!(tokens.concat(), text, "the tokens' texts make the text");
    // Two stop strings that the same token completes: `first` spans the boundary into that
    // token, `inner` lies inside it, after `first` starts. Listed inner first, the earlier match
    // (`first`) must still win: a matcher that took the list's first would cut at `inner`.
    let starts: Vec<usize> = tokens.iter().scan(0, |at, t| Some(std::mem::replace(at, *at + t.len()))).collect();
    let (first, inner, at) = starts
        .iter()
        .zip(&tokens)
        .skip(1)
        .filter(|(_, t)| t.len() >= 3)
        .filter_map(|(&b, _)| Some((piece(&text, b.checked_sub(1)?, 3)?, piece(&text, b + 1, 2)?, b - 1)))
        .find(|(first, inner, at)| text.find(first) == Some(*at) && text.find(inner) == Some(at + 2))
        .unwrap_or_else(|| panic!("no token of 3+ bytes whose pieces first occur there: {text:?}"));
    let want = &text[..at];
    let stops = json!({"stop": [inner, first]});
    let whole = post_json(&url, &request(stops.clone()));
    assert_eq!(whole["choices"][0]["finish_reason"], "stop", "{whole}");
    assert_eq!(whole["choices"][0]["text"].as_str().unwrap(), want, "stops {stops} in {text:?}");

    let mut body = request(stops.clone());
    body["stream"] = true.into();
    body.as_object_mut().unwrap().remove("logprobs");
    let lines = sse(&url, &body);
    assert_eq!(lines.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"].get(0).and_then(|ch| ch["text"].as_str())).collect();
    assert_eq!(streamed, want, "streamed with stops {stops}");
    let reasons: Vec<&Value> =
        chunks.iter().filter_map(|c| c["choices"].get(0).map(|ch| &ch["finish_reason"])).filter(|r| !r.is_null()).collect();
    assert_eq!(reasons, [&json!("stop")]);
}
