//! vLLM's sampling extensions against a real server on SmolLM2 (a model that writes words and
//! ends its turns with an eos token): `ignore_eos`, `min_tokens`, `stop_token_ids`,
//! `include_stop_str_in_output`, `skip_special_tokens`, `spaces_between_special_tokens` and
//! `best_of`, each checked against the plain greedy answer it changes, streamed and not.

mod common;

use common::server::*;
use serde_json::{json, Value};

/// `base` with `extra`'s fields added.
fn with(base: &Value, extra: Value) -> Value {
    let mut body = base.clone();
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

fn chat_text(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

fn completion_tokens(v: &Value) -> u64 {
    v["usage"]["completion_tokens"].as_u64().unwrap()
}

/// The streamed text of a completions or chat SSE answer.
fn streamed_text(lines: &[String]) -> String {
    assert_eq!(lines.last().map(String::as_str), Some("[DONE]"));
    lines[..lines.len() - 1]
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|c| {
            let ch = c["choices"].get(0)?.clone();
            ch["text"].as_str().or(ch["delta"]["content"].as_str()).map(str::to_string)
        })
        .collect()
}

#[test]
fn vllm_sampling_extensions_do_what_vllm_documents() {
    let Some(gguf) = common::smollm2_gguf_or_skip("vllm_sampling_extensions_do_what_vllm_documents") else { return };
    let server = Server::start(&gguf, &[]);
    let chat_url = server.url("/v1/chat/completions");
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 48, "temperature": 0});

    // The plain answer ends by itself (the eos token): its length is what the rest changes.
    let plain = post_json(&chat_url, &chat);
    assert_eq!(plain["choices"][0]["finish_reason"], "stop", "{plain}");
    let (plain_text, plain_len) = (chat_text(&plain), completion_tokens(&plain));
    assert!(plain_len + 8 <= 48, "the plain answer leaves room: {plain}");

    // ignore_eos: the answer goes on to max_tokens; the eos token is not shown (special), and
    // with skip_special_tokens false it is.
    let ignored = post_json(&chat_url, &with(&chat, json!({"ignore_eos": true})));
    assert_eq!((ignored["choices"][0]["finish_reason"].as_str(), completion_tokens(&ignored)), (Some("length"), 48), "{ignored}");
    assert!(chat_text(&ignored).starts_with(&plain_text), "{ignored}");
    assert!(!chat_text(&ignored).contains("<|im_end|>"), "{ignored}");
    let shown = post_json(&chat_url, &with(&chat, json!({"ignore_eos": true, "skip_special_tokens": false})));
    assert!(chat_text(&shown).starts_with(&format!("{plain_text}<|im_end|>")), "{shown}");
    // spaces_between_special_tokens: this byte-level tokenizer puts no spaces between tokens,
    // so either value writes the same text (the decoder that does is tested in `tokenize`).
    let tight = post_json(
        &chat_url,
        &with(&chat, json!({"ignore_eos": true, "skip_special_tokens": false, "spaces_between_special_tokens": false})),
    );
    assert_eq!(chat_text(&tight), chat_text(&shown));

    // min_tokens: eos is held off until the answer has that many tokens, streamed alike.
    let at_least = plain_len + 6;
    let longer = post_json(&chat_url, &with(&chat, json!({"min_tokens": at_least})));
    assert!(completion_tokens(&longer) >= at_least, "{longer}");
    assert!(chat_text(&longer).starts_with(&plain_text) && chat_text(&longer).len() > plain_text.len(), "{longer}");
    let lines = sse(&chat_url, &with(&chat, json!({"min_tokens": at_least, "stream": true})));
    assert_eq!(streamed_text(&lines), chat_text(&longer));

    // Completions: stop strings and stop tokens, kept in the text or not.
    let url = server.url("/v1/completions");
    let completion = json!({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0});
    let text = post_json(&url, &completion)["choices"][0]["text"].as_str().unwrap().to_string();
    let ids: Vec<u32> = serde_json::from_value(
        post_json(&server.url("/tokenize"), &json!({"prompt": text, "add_special_tokens": false}))["tokens"].clone(),
    )
    .unwrap();
    // A token of the answer past its start, with the text it reads as.
    let k = (3..ids.len()).find(|&k| !ids[..k].contains(&ids[k])).expect("a token that first occurs past the third");
    let piece = post_json(&server.url("/detokenize"), &json!({"tokens": [ids[k]]}))["prompt"].as_str().unwrap().to_string();
    let cut = post_json(&url, &with(&completion, json!({"stop_token_ids": [ids[k]]})));
    let cut_text = cut["choices"][0]["text"].as_str().unwrap();
    assert_eq!(cut["choices"][0]["finish_reason"], "stop", "{cut}");
    assert!(text.starts_with(cut_text) && cut_text.len() < text.len(), "{cut_text:?} of {text:?}");
    let kept = post_json(&url, &with(&completion, json!({"stop_token_ids": [ids[k]], "include_stop_str_in_output": true})));
    assert_eq!(kept["choices"][0]["text"].as_str().unwrap(), format!("{cut_text}{piece}"), "{kept}");
    assert_eq!(completion_tokens(&kept), completion_tokens(&cut), "the stop token counts either way");

    // A stop string: cut before it, or kept with include_stop_str_in_output, streamed alike.
    let word = text.split_whitespace().nth(2).expect("three words");
    let at = text.find(word).unwrap();
    let stopped = post_json(&url, &with(&completion, json!({"stop": [word]})));
    assert_eq!(stopped["choices"][0]["text"].as_str().unwrap(), &text[..at]);
    let body = with(&completion, json!({"stop": [word], "include_stop_str_in_output": true}));
    let included = post_json(&url, &body);
    assert_eq!(included["choices"][0]["text"].as_str().unwrap(), &text[..at + word.len()]);
    assert_eq!(streamed_text(&sse(&url, &with(&body, json!({"stream": true})))), &text[..at + word.len()]);

    // Bad values are 400s naming the field.
    for (extra, param) in [
        (json!({"stop_token_ids": [1 << 30]}), "stop_token_ids"),
        (json!({"min_tokens": 40}), "min_tokens"),
        (json!({"best_of": 2, "n": 3}), "best_of"),
        (json!({"best_of": 2, "stream": true}), "best_of"),
        (json!({"ignore_eos": 1}), "ignore_eos"),
    ] {
        let (status, answer, _) = post(&url, &with(&completion, extra.clone()).to_string(), None);
        let v: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{extra}: {answer}");
    }
}

/// best_of: of `best_of` sampled candidates (the same ones `n = best_of` returns, seeded alike),
/// the `n` of highest summed log-probability come back, most likely first.
#[test]
fn best_of_returns_the_most_likely_candidates() {
    let Some(gguf) = common::smollm2_gguf_or_skip("best_of_returns_the_most_likely_candidates") else { return };
    let server = Server::start(&gguf, &[]);
    let url = server.url("/v1/completions");
    let base = json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 11, "logprobs": 0});
    let all = post_json(&url, &with(&base, json!({"n": 4})));
    let mut candidates: Vec<(f64, String)> = all["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let sum = c["logprobs"]["token_logprobs"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).sum();
            (sum, c["text"].as_str().unwrap().to_string())
        })
        .collect();
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
    assert!(candidates.windows(2).any(|w| w[0].1 != w[1].1), "sampled candidates differ: {all}");
    let best = post_json(&url, &with(&base, json!({"n": 2, "best_of": 4})));
    let texts: Vec<&str> = best["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, [candidates[0].1.as_str(), candidates[1].1.as_str()], "{best} of {candidates:?}");
    let indices: Vec<u64> = best["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indices, [0, 1]);
    // vLLM's usage: the returned answers' tokens.
    let returned: usize = best["choices"].as_array().unwrap().iter().map(|c| c["logprobs"]["tokens"].as_array().unwrap().len()).sum();
    assert_eq!(completion_tokens(&best), returned as u64, "{best}");
}

/// continue_final_message: the last assistant message is the start of the answer, which
/// continues it; the prompt is the conversation's with that text after the opened assistant
/// turn, so the greedy answer equals a completion of exactly those tokens.
#[test]
fn continue_final_message_continues_the_assistants_text() {
    let Some(gguf) = common::smollm2_gguf_or_skip("continue_final_message_continues_the_assistants_text") else { return };
    let server = Server::start(&gguf, &[]);
    let user = json!({"role": "user", "content": "Tell me about cats."});
    let begun = "Cats are small";
    let rendered = post_json(&server.url("/tokenize"), &json!({"model": "tiny", "messages": [user]}));
    let text = post_json(&server.url("/detokenize"), &json!({"model": "tiny", "tokens": rendered["tokens"]}))["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    let ids = post_json(&server.url("/tokenize"), &json!({"model": "tiny", "prompt": text + begun, "add_special_tokens": false}))["tokens"]
        .clone();
    let completion =
        post_json(&server.url("/v1/completions"), &json!({"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0}));
    let chat = json!({"model": "tiny", "messages": [user, {"role": "assistant", "content": begun}], "max_tokens": 12, "temperature": 0,
                      "continue_final_message": true, "add_generation_prompt": false});
    let continued = post_json(&server.url("/v1/chat/completions"), &chat);
    assert_eq!(continued["choices"][0]["message"]["content"], completion["choices"][0]["text"], "{continued} vs {completion}");
    assert_eq!(continued["usage"]["prompt_tokens"], completion["usage"]["prompt_tokens"], "{continued}");

    for (extra, param) in [
        (json!({"continue_final_message": true, "add_generation_prompt": true}), "add_generation_prompt"),
        (json!({"continue_final_message": false, "add_generation_prompt": false}), "add_generation_prompt"),
        (json!({"continue_final_message": true, "messages": [user]}), "continue_final_message"),
    ] {
        let (status, body, _) = post(&server.url("/v1/chat/completions"), &with(&chat, extra).to_string(), None);
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((status, e["error"]["param"].as_str()), (400, Some(param)), "{body}");
    }
}
