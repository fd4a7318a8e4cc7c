//! The generation API's finer points against a real server: `--lenient` (what strict mode
//! refuses is ignored and listed in a header), `logit_bias`, `echo` with `logprobs`, and `n`
//! at admission; vLLM's command line; completions' batches of prompts and `/tokenizer_info`.

mod common;

use common::server::*;
use common::*;
use serde_json::{json, Value};

/// `--lenient` ignores what strict mode refuses and says so in a header; `logit_bias` moves the
/// sampler; `echo` with `logprobs` scores the prompt too (the first token null) and
/// `text_offset` points into the returned text; `n` takes n places of admission.
#[test]
fn lenient_mode_logit_bias_echo_logprobs_and_n_admission() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &["--lenient", "--max-concurrent-requests", "2", "--max-queue", "1"]);
    let comp = server.url("/v1/completions");
    let r = ureq::post(&comp)
        .set("Content-Type", "application/json")
        .send_string(&json!({"model": "tiny", "prompt": "hello", "max_tokens": 2, "foo_bar": 1, "tools": []}).to_string())
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.header("x-fsdp-app-ignored-params"), Some("foo_bar, tools"));
    // Every endpoint that reads a body lists what it ignored: embeddings, rerank, a job's nested fields.
    let ignored = |path: &str, body: Value| {
        let r = ureq::post(&server.url(path)).set("Content-Type", "application/json").send_string(&body.to_string()).unwrap();
        r.header("x-fsdp-app-ignored-params").map(str::to_string)
    };
    assert_eq!(ignored("/v1/embeddings", json!({"model": "tiny", "input": "hi", "truncate": "END"})).as_deref(), Some("truncate"));
    let rerank = json!({"model": "tiny", "query": "a", "documents": ["b"], "rank_fields": ["text"]});
    assert_eq!(ignored("/v1/rerank", rerank).as_deref(), Some("rank_fields"));
    let chat = std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/zephyrix-codename.jsonl")).unwrap();
    let (status, file) = upload(&server, "chat.jsonl", &chat);
    assert_eq!(status, 200, "{file}");
    let job = json!({"model": "tiny", "training_file": file["id"],
                     "method": {"type": "supervised", "supervised": {"hyperparameters": {}, "x": 1}}, "fsdp_app": {"max_steps": 1, "y": 2}});
    assert_eq!(ignored("/v1/fine_tuning/jobs", job).as_deref(), Some("method.supervised.x, fsdp_app.y"));

    // Greedy's first token, then banned by logit_bias: another token comes first.
    let greedy = |extra: Value| {
        let mut body = json!({"model": "tiny", "prompt": "hello", "max_tokens": 1, "temperature": 0, "logprobs": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post_json(&comp, &body)
    };
    let first = |v: &Value| v["choices"][0]["logprobs"]["tokens"][0].as_str().unwrap().to_string();
    // Every token's text (byte-level pieces of a character show as U+FFFD and are not unique).
    let config: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap();
    let texts: Vec<String> = (0..vocab)
        .map(|i| post_json(&server.url("/detokenize"), &json!({"tokens": [i]}))["prompt"].as_str().unwrap().to_string())
        .collect();
    let ids_of = |t: &str| (0..vocab).filter(|&i| texts[i as usize] == t).collect::<Vec<_>>();
    let plain = greedy(json!({}));
    let bias = |ids: &[u64], b: f64| Value::Object(ids.iter().map(|i| (i.to_string(), json!(b))).collect());
    let banned = ids_of(&first(&plain));
    assert!(!banned.is_empty());
    let biased = greedy(json!({"logit_bias": bias(&banned, -100.0)}));
    assert_ne!(first(&biased), first(&plain), "logit_bias -100 bans the greedy token");
    // +100 on a token whose text no other token has makes it the greedy choice.
    let forced = (0..vocab)
        .find(|&i| {
            let t = &texts[i as usize];
            t.chars().count() > 1 && t.chars().all(char::is_alphanumeric) && ids_of(t).len() == 1 && *t != first(&plain)
        })
        .expect("a token with a text of its own");
    let got = greedy(json!({"logit_bias": bias(&[forced], 100.0)}));
    assert_eq!(first(&got), texts[forced as usize], "logit_bias +100 forces the token");

    // Echo + logprobs: every prompt token and every generated one, the first null.
    let prompt = "the cat sat";
    let prompt_ids = post_json(&server.url("/tokenize"), &json!({"prompt": prompt}))["tokens"].as_array().unwrap().len();
    let v = post_json(&comp, &json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": true, "logprobs": 2}));
    let choice = &v["choices"][0];
    let text = choice["text"].as_str().unwrap();
    let lp = &choice["logprobs"];
    let generated = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let n_tokens = lp["tokens"].as_array().unwrap().len();
    assert_eq!(n_tokens, prompt_ids + generated, "{lp}");
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
    assert!((1..n_tokens).all(|i| lp["token_logprobs"][i].as_f64().is_some_and(|x| x <= 0.0)), "{lp}");
    assert!(text.starts_with(prompt), "{text}");
    let chars: Vec<char> = text.chars().collect();
    // Each token's text is where its offset points (a byte-level piece of a character, shown as
    // U+FFFD, has no text of its own to find); the generated ones start after the prompt.
    assert_eq!(lp["text_offset"][prompt_ids].as_u64(), Some(prompt.chars().count() as u64), "{lp}");
    for i in 0..n_tokens {
        let (t, at) = (lp["tokens"][i].as_str().unwrap(), lp["text_offset"][i].as_u64().unwrap() as usize);
        let here: String = chars[at.min(chars.len())..].iter().collect();
        assert!(t.contains('\u{FFFD}') || here.starts_with(t), "token {i} {t:?} is not at offset {at} of {text:?}");
    }
    // The same as a stream: the prompt's scores come with the echoed text, offsets continue.
    let chunks: Vec<Value> = sse(
        &comp,
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": true, "logprobs": 2, "stream": true}),
    )
    .into_iter()
    .filter(|l| l != "[DONE]")
    .map(|l| serde_json::from_str(&l).unwrap())
    .collect();
    let mut offsets = vec![];
    for c in &chunks {
        if let Some(o) = c["choices"][0]["logprobs"]["text_offset"].as_array() {
            offsets.extend(o.iter().map(|x| x.as_u64().unwrap()));
        }
    }
    assert_eq!(offsets, lp["text_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<_>>());

    // n = 4 needs four places; this server admits three at once.
    let (status, text, _) = post(&comp, &json!({"model": "tiny", "prompt": "x", "n": 4}).to_string(), None);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("\"param\":\"n\""), "{text}");
}

/// `serve --chat-template` (vLLM's flag), a file or inline: chat prompts render with it instead
/// of the model's own.
#[test]
fn chat_template_replaces_the_models_own() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
    let file = tmp.path().join("t.jinja");
    std::fs::write(&file, template).unwrap();
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]});
    for given in [file.to_str().unwrap(), template] {
        let server = Server::start(&model, &["--chat-template", given]);
        let ids = post_json(&server.url("/tokenize"), &body)["tokens"].clone();
        let text = post_json(&server.url("/detokenize"), &json!({"tokens": ids}))["prompt"].as_str().unwrap().to_string();
        assert_eq!(text, "<user>Hi<assistant>", "{given}");
    }
    let o = run_cli(&["serve", "--model", model.to_str().unwrap(), "--chat-template", "/no/such.jinja"], &[]);
    assert!(!o.status.success() && stderr(&o).contains("--chat-template /no/such.jinja: no such file"), "{}", stderr(&o));
}

/// `chat_template_kwargs` reach the chat template (vLLM's and SGLang's field): Qwen3's
/// `enable_thinking: false` renders its no-think prompt, in `/tokenize` and in a chat request's
/// prompt; a variable the server sets is refused by name.
#[test]
fn chat_template_kwargs_reach_the_template() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen3", tmp.path());
    std::fs::write(model.join("chat_template.jinja"), common::reasoning::QWEN3_TEMPLATE).unwrap();
    let server = Server::start(&model, &[]);
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let tokenize = |extra: Value| {
        let mut body = json!({"model": "tiny", "messages": messages});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post_json(&server.url("/tokenize"), &body)["tokens"].clone()
    };
    let text = |ids: &Value| post_json(&server.url("/detokenize"), &json!({"tokens": ids}))["prompt"].as_str().unwrap().to_string();
    let (thinking, plain) = (tokenize(json!({})), tokenize(json!({"chat_template_kwargs": {"enable_thinking": false}})));
    assert!(text(&thinking).ends_with("<|im_start|>assistant\n"), "{}", text(&thinking));
    assert!(text(&plain).ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{}", text(&plain));
    assert_eq!(tokenize(json!({"chat_template_kwargs": {"enable_thinking": true}})), thinking);
    let chat = |kwargs: Value| {
        let body = json!({"model": "tiny", "messages": messages, "max_tokens": 1, "chat_template_kwargs": kwargs});
        post_json(&server.url("/v1/chat/completions"), &body)["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    assert_eq!(chat(json!({"enable_thinking": false})), plain.as_array().unwrap().len() as u64);
    assert_eq!(chat(json!({})), thinking.as_array().unwrap().len() as u64);
    for (kwargs, param) in [(json!({"messages": []}), "chat_template_kwargs.messages"), (json!(true), "chat_template_kwargs")] {
        let body = json!({"model": "tiny", "messages": messages, "chat_template_kwargs": kwargs});
        let (status, answer, _) = post(&server.url("/v1/chat/completions"), &body.to_string(), None);
        let v: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{answer}");
    }
    // `/tokenize` names a field it does not take instead of ignoring it.
    let body = json!({"model": "tiny", "messages": messages, "add_generation_prompt": false});
    let (status, answer, _) = post(&server.url("/tokenize"), &body.to_string(), None);
    let v: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("add_generation_prompt")), "{answer}");
}

/// A `vllm serve` command line runs as it is: the model as an argument, vLLM's names of the
/// limits (--max-model-len, --max-num-seqs, --max-num-batched-tokens), --lora-modules in both
/// of its forms, --enable-auto-tool-choice, --enable-lora, --enable-tokenizer-info-endpoint,
/// --enable-prefix-caching (and its `--no-` switch), --trust-remote-code, `--dtype float`,
/// `GET /version`; `max_model_len` is the limit set.
#[test]
fn a_vllm_command_line_serves_with_its_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let peft = reference_dir().join("lora-llama");
    let (as_pair, as_json) = (format!("a={}", peft.display()), json!({"name": "b", "path": peft}).to_string());
    #[rustfmt::skip]
    let server = Server::start_with(&[
        model.to_str().unwrap(), "--served-model-name", "tiny", "--max-model-len", "48", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "32", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-lora",
        "--trust-remote-code", "--dtype", "float", "--lora-modules", &as_pair, &as_json, "--enable-tokenizer-info-endpoint",
    ]);
    assert_eq!(get_json(&server.url("/version"))["version"], env!("CARGO_PKG_VERSION"));
    let models = get_json(&server.url("/v1/models"));
    let listed: Vec<(&str, u64)> =
        models["data"].as_array().unwrap().iter().map(|m| (m["id"].as_str().unwrap(), m["max_model_len"].as_u64().unwrap())).collect();
    assert_eq!(listed, [("tiny", 48), ("a", 48), ("b", 48)], "{models}");
    let info = get_json(&server.url("/info"));
    assert_eq!((info["max_model_len"].as_u64(), info["max_concurrent_requests"].as_u64()), (Some(48), Some(3)), "{info}");
    // A prompt and answer past 48 tokens is refused; within it, the adapter answers.
    let prompt: Vec<u32> = (1..40).collect();
    let (status, text, _) =
        post(&server.url("/v1/completions"), &json!({"model": "b", "prompt": prompt, "max_tokens": 20}).to_string(), None);
    assert_eq!(status, 400, "{text}");
    let ok = post_json(&server.url("/v1/completions"), &json!({"model": "b", "prompt": prompt, "max_tokens": 4}));
    assert_eq!(ok["usage"]["completion_tokens"], 4, "{ok}");
    // Prefix caching is on (the same prompt again reads its full 64-token blocks from the
    // cache), and off with vLLM's switch.
    let cached = |switch: &str| {
        let server = Server::start_with(&[model.to_str().unwrap(), "--served-model-name", "tiny", switch]);
        let body = json!({"model": "tiny", "prompt": (1..140).collect::<Vec<u32>>(), "max_tokens": 1});
        post_json(&server.url("/v1/completions"), &body);
        post_json(&server.url("/v1/completions"), &body)["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
    };
    assert_eq!((cached("--enable-prefix-caching"), cached("--no-enable-prefix-caching")), (128, 0));

    // A bad --lora-modules is named.
    let bad = run_cli(&["serve", model.to_str().unwrap(), "--lora-modules", "{\"name\": \"x\", \"root\": \"y\"}"], &[]);
    assert!(!bad.status.success() && stderr(&bad).contains("`root` is not supported"), "{}", stderr(&bad));
    let off_and_sized = run_cli(&["serve", model.to_str().unwrap(), "--no-enable-prefix-caching", "--kv-cache-memory", "64"], &[]);
    assert!(!off_and_sized.status.success() && stderr(&off_and_sized).contains("cannot be used with"), "{}", stderr(&off_and_sized));
    let both = run_cli(&["serve", model.to_str().unwrap(), "--model", model.to_str().unwrap()], &[]);
    assert!(!both.status.success() && stderr(&both).contains("cannot be used with"), "{}", stderr(&both));
}

/// `/v1/completions` takes a batch of prompts as OpenAI and vLLM do (a list of strings, or of
/// token-id lists, as lm-evaluation-harness sends them): prompt i's answer j is choice
/// `i * n + j` and equals that prompt's answer alone, usage is summed, a stream numbers its
/// chunks the same way and ends with one usage chunk; a bad prompt is named by its index, and a
/// batch larger than the server admits at once is refused.
#[test]
fn completions_take_a_batch_of_prompts() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    // One sequence at a time: a batch's answers run as each would alone, so they are equal to the bit.
    let server = Server::start(&model, &["--max-concurrent-requests", "1", "--max-queue", "3"]);
    let comp = server.url("/v1/completions");
    let ask = |prompt: Value, extra: Value| {
        let mut body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0.9, "seed": 3, "logprobs": 1});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let texts = ["the cat sat", "once upon a time"];
    let ids: Vec<Value> = texts.iter().map(|t| post_json(&server.url("/tokenize"), &json!({"prompt": t}))["tokens"].clone()).collect();
    for (prompts, extra) in
        [(json!(texts), json!({"n": 2, "echo": true})), (json!(ids), json!({"n": 2})), (json!(ids), json!({"temperature": 0}))]
    {
        let batch = post_json(&comp, &ask(prompts.clone(), extra.clone()));
        let n = extra["n"].as_u64().unwrap_or(1) as usize;
        let choices = batch["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2 * n, "{batch}");
        let (mut prompt_tokens, mut completion_tokens) = (0, 0);
        for (i, prompt) in prompts.as_array().unwrap().iter().enumerate() {
            let alone = post_json(&comp, &ask(prompt.clone(), extra.clone()));
            prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
            completion_tokens += alone["usage"]["completion_tokens"].as_u64().unwrap();
            for j in 0..n {
                let mut expected = alone["choices"][j].clone();
                expected["index"] = json!(i * n + j);
                assert_eq!(choices[i * n + j], expected, "prompt {i} answer {j}");
            }
        }
        assert_eq!(batch["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens), "{batch}");
        assert_eq!(batch["usage"]["completion_tokens"].as_u64(), Some(completion_tokens), "{batch}");
    }
    // Without `model` (as vLLM and llama.cpp take it, and lm-evaluation-harness's `gguf` client
    // sends it), the served base model answers; Anthropic's API still wants it.
    let mut unnamed = ask(json!(texts[0]), json!({"temperature": 0}));
    let named = post_json(&comp, &unnamed);
    unnamed.as_object_mut().unwrap().remove("model");
    let answer = post_json(&comp, &unnamed);
    assert_eq!((&answer["model"], &answer["choices"]), (&json!("tiny"), &named["choices"]), "{answer}");
    let chat = post_json(&server.url("/v1/chat/completions"), &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}));
    assert_eq!(chat["model"], "tiny", "{chat}");
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    let (status, text, _) = post(&server.url("/v1/messages"), &body.to_string(), None);
    assert!(status == 400 && text.contains("model"), "{text}");

    // One token-id list inside a list is one prompt.
    let one = post_json(&comp, &ask(json!([ids[0]]), json!({})));
    assert_eq!(one["choices"].as_array().unwrap().len(), 1, "{one}");
    assert_eq!(one["choices"][0], post_json(&comp, &ask(ids[0].clone(), json!({})))["choices"][0]);

    // Streamed: each choice's chunks add up to the whole answer's text, each ends once, and the
    // last chunk before [DONE] holds the batch's usage.
    let whole = post_json(&comp, &ask(json!(texts), json!({"n": 2})));
    let lines = sse(&comp, &ask(json!(texts), json!({"n": 2, "stream": true, "stream_options": {"include_usage": true}})));
    assert_eq!(lines.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"] && c["object"] == "text_completion"), "one response");
    for index in 0..4 {
        let mine: Vec<&Value> = chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()).filter(|ch| ch["index"] == index).collect();
        let text: String = mine.iter().map(|ch| ch["text"].as_str().unwrap()).collect();
        assert_eq!(text, whole["choices"][index]["text"].as_str().unwrap(), "choice {index}");
        assert_eq!(mine.iter().filter(|ch| !ch["finish_reason"].is_null()).count(), 1, "choice {index}");
    }
    assert_eq!(chunks.last().unwrap()["usage"], whole["usage"]);

    // Refused, by name: an empty batch, an id past the vocabulary in prompt 1, prompt 1 longer
    // than the context, more sequences than the server admits at once (2 x 3 > 1 + 3).
    let long = "word ".repeat(400);
    for (prompt, extra, param) in [
        (json!([]), json!({}), "prompt"),
        (json!(["a", [1, 1_000_000]]), json!({}), "prompt[1]"),
        (json!(["a", {"text": "b"}]), json!({}), "prompt[1]"),
        (json!(["a", long]), json!({}), "prompt[1]"),
        (json!(["a", "b"]), json!({"n": 3}), "prompt"),
    ] {
        let (status, answer, _) = post(&comp, &ask(prompt, extra).to_string(), None);
        let v: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{answer}");
        assert!(v["error"]["message"].as_str().unwrap().contains(param), "{answer}");
    }
    // `/tokenize` takes one prompt.
    let (status, answer, _) = post(&server.url("/tokenize"), &json!({"prompt": ["a", "b"]}).to_string(), None);
    assert_eq!(status, 400, "{answer}");

    // lm-evaluation-harness's remote tokenizer: `/tokenizer_info`'s eos_token is text that
    // `/tokenize` reads as the one eos id the model's config names.
    let info = get_json(&server.url("/tokenizer_info"));
    let eos = info["eos_token"].as_str().unwrap_or_else(|| panic!("{info}"));
    let ids = post_json(&server.url("/tokenize"), &json!({"prompt": eos, "add_special_tokens": false}))["tokens"].clone();
    let config: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(ids, json!([config["eos_token_id"]]), "{info}");
    assert!(info["tokenizer_class"].as_str().unwrap().ends_with("Fast"), "{info}");
}
