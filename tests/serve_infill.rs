//! Filling in the middle against a real server: `/v1/completions` with `suffix` (OpenAI's,
//! llama-cpp-python's), llama.cpp's `/infill` (llama.vim's and llama.vscode's completion, with
//! files of context and its prefix and suffix cuts) and Ollama's `/api/generate` with `suffix`.
//! The model is the tiny Qwen2 with Qwen2.5-Coder's FIM tokens added to its vocabulary; each
//! answer must equal the plain completion of the prompt laid out by hand here, token by token,
//! as llama.cpp's server lays it out (`format_prompt_infill`) and Qwen2.5-Coder's model card
//! gives it; the `openai` and `ollama` packages from PyPI send `suffix` (tests/infill_clients.py).
//! A model without the tokens is refused on every route.

mod common;

use std::path::{Path, PathBuf};

use common::server::*;
use common::*;
use serde_json::{json, Value};
use tokenizers::{AddedToken, Tokenizer};

/// Qwen2.5-Coder's FIM and repository tokens, in the order they are added (ids 384 on).
const FIM_TOKENS: [&str; 6] = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"];

const PREFIX: &str = "def add(a, b):\n    return ";
const SUFFIX: &str = "\n\nprint(add(1, 2))\n";

/// The tiny Qwen2 with room for six more tokens, a 4,096-token context, and the FIM tokens in
/// its tokenizer.json.
fn fim_model(root: &Path) -> PathBuf {
    let dir = fixture_with("qwen2", &root.join("coder"), &[("vocab_size", 392), ("max_position_embeddings", 4096)]);
    let path = dir.join("tokenizer.json");
    let mut tok = Tokenizer::from_file(&path).unwrap();
    let added: Vec<AddedToken> = FIM_TOKENS.iter().map(|t| AddedToken::from(t.to_string(), true)).collect();
    assert_eq!(tok.add_special_tokens(&added), FIM_TOKENS.len());
    tok.save(&path, false).unwrap();
    dir
}

struct Vocab(Tokenizer);

impl Vocab {
    fn of(model: &Path) -> Vocab {
        Vocab(Tokenizer::from_file(model.join("tokenizer.json")).unwrap())
    }
    fn text(&self, s: &str) -> Vec<u32> {
        self.0.encode(s, false).unwrap().get_ids().to_vec()
    }
    fn id(&self, token: &str) -> u32 {
        self.0.token_to_id(token).unwrap()
    }
    /// The repository-level context: `<|repo_name|>myproject`, each file as `<|file_sep|>` name
    /// and text, `<|file_sep|>filename` (the current file).
    fn context(&self, files: &[(&str, &str)]) -> Vec<u32> {
        let mut ids = vec![self.id("<|repo_name|>")];
        ids.extend(self.text("myproject\n"));
        for (name, text) in files {
            ids.push(self.id("<|file_sep|>"));
            ids.extend(self.text(&format!("{name}\n")));
            ids.extend(self.text(text));
        }
        ids.push(self.id("<|file_sep|>"));
        ids.extend(self.text("filename\n"));
        ids
    }

    /// `<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>`.
    fn psm(&self, prefix: &[u32], suffix: &[u32]) -> Vec<u32> {
        let mut ids = vec![self.id("<|fim_prefix|>")];
        ids.extend(prefix);
        ids.push(self.id("<|fim_suffix|>"));
        ids.extend(suffix);
        ids.push(self.id("<|fim_middle|>"));
        ids
    }
}

fn completion(server: &Server, body: Value) -> Value {
    post_json(&server.url("/v1/completions"), &body)
}

#[test]
fn openai_suffix_fills_the_gap_between_prompt_and_suffix() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fim_model(tmp.path());
    let vocab = Vocab::of(&model);
    let server = Server::start(&model, &[]);
    let expected = vocab.psm(&vocab.text(PREFIX), &vocab.text(SUFFIX));
    // The tokens' log-probabilities too: a random model's greedy text may not change with the
    // context, its distributions do.
    let by_hand = completion(&server, json!({"model": "tiny", "prompt": expected, "max_tokens": 8, "temperature": 0, "logprobs": 2}));
    let filled =
        completion(&server, json!({"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0, "logprobs": 2}));
    assert_eq!(filled["choices"][0]["text"], by_hand["choices"][0]["text"], "{filled}");
    assert_eq!(filled["choices"][0]["logprobs"], by_hand["choices"][0]["logprobs"]);
    assert_eq!(filled["usage"]["prompt_tokens"], json!(expected.len()));
    // The prompt as token ids is the prefix's tokens.
    let ids = completion(
        &server,
        json!({"model": "tiny", "prompt": vocab.text(PREFIX), "suffix": SUFFIX, "max_tokens": 8, "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(ids["choices"][0]["logprobs"], filled["choices"][0]["logprobs"]);
    // An empty suffix still fills in the middle (the gap is at the end), as llama-cpp-python.
    let at_end = completion(&server, json!({"model": "tiny", "prompt": PREFIX, "suffix": "", "max_tokens": 1}));
    assert_eq!(at_end["usage"]["prompt_tokens"], json!(vocab.psm(&vocab.text(PREFIX), &[]).len()));

    // The pad and the context tokens end a FIM answer (stop, not shown); a plain completion
    // runs through them.
    for end in ["<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"] {
        let bias = json!({vocab.id(end).to_string(): 100});
        let ended = completion(&server, json!({"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 5, "logit_bias": bias}));
        assert_eq!(ended["choices"][0]["finish_reason"], "stop", "{end}: {ended}");
        assert_eq!((&ended["choices"][0]["text"], &ended["usage"]["completion_tokens"]), (&json!(""), &json!(1)), "{end}");
        let plain = completion(&server, json!({"model": "tiny", "prompt": PREFIX, "max_tokens": 5, "logit_bias": bias}));
        assert_eq!(plain["choices"][0]["finish_reason"], "length", "{end}: {plain}");
    }

    // Streamed, the same text.
    let events = sse(
        &server.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0, "stream": true}),
    );
    let text: String = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(text, filled["choices"][0]["text"].as_str().unwrap());

    let (status, body, _) =
        post(&server.url("/v1/completions"), &json!({"model": "tiny", "prompt": "a", "suffix": "b", "echo": true}).to_string(), None);
    assert_eq!((status, param(&body)), (400, json!("echo")), "{body}");
    let (status, body, _) = post(&server.url("/v1/completions"), &json!({"model": "tiny", "prompt": "a", "suffix": 3}).to_string(), None);
    assert_eq!((status, param(&body)), (400, json!("suffix")), "{body}");
}

/// llama-server's own `/infill` (tests/reference/llama-cpp-infill.json, made by
/// make_llama_cpp_infill_reference.py beside it): the same requests to SmolLM2's GGUF with FIM
/// tokens evaluate the prompt it evaluated, as text (special tokens written out) and as a count.
#[test]
fn infill_prompts_are_llama_servers() {
    let Some(gguf) = smollm2_gguf_or_skip("infill_prompts_are_llama_servers") else { return };
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("reference").join("llama-cpp-infill.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let renames: Vec<(usize, String)> =
        reference["renames"].as_object().unwrap().iter().map(|(id, t)| (id.parse().unwrap(), t.as_str().unwrap().to_string())).collect();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("smollm2-fim.gguf");
    common::gguf::with_renamed_tokens(&gguf, &renames, &model);
    let server = Server::start(&model, &["--max-total-tokens", &reference["context"].to_string()]);
    for case in reference["cases"].as_array().unwrap() {
        let answer = post_json(&server.url("/infill"), &case["request"]);
        let ours = (&answer["prompt"], &answer["tokens_evaluated"]);
        assert_eq!(ours, (&case["prompt"], &case["tokens_evaluated"]), "{}", case["request"]);
    }
}

/// llama.vim's request as it sends it (llama.vim's `llama#fim`): its chunks' `time`, its
/// code-completion limits, its `infill` sampler and `response_fields` are all taken.
#[test]
fn llama_vims_request_is_answered() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&fim_model(tmp.path()), &[]);
    let body = json!({
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "",
        "input_extra": [{"text": "def sub(a, b):\n    return a - b\n", "time": 1732990000.5, "filename": "util.py"}],
        "n_predict": 16, "n_indent": 4, "top_k": 40, "top_p": 0.99, "stream": false, "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": true, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
        "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"],
    });
    let r = ureq::post(&server.url("/infill")).set("Content-Type", "application/json").send_string(&body.to_string()).unwrap();
    assert_eq!(r.header("x-fsdp-app-ignored-params"), None);
    let answer: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
    let mut keys: Vec<&String> = answer.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["content", "timings/predicted_n", "timings/prompt_n", "tokens_cached", "truncated"], "{answer}");
}

/// The infill sampler in a request's chain (its choices are checked against llama.cpp's in
/// `generate::infill_sampler`'s tests): with a top-k of 1 before it the one text token is left
/// and the answer is the greedy one; with an end token made the likeliest, only the ends are
/// left and the answer ends there.
#[test]
fn the_infill_sampler_runs_in_the_chain() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fim_model(tmp.path());
    let vocab = Vocab::of(&model);
    let server = Server::start(&model, &[]);
    let infill = |extra: Value| {
        let mut body = json!({"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6, "seed": 3});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post_json(&server.url("/infill"), &body)
    };
    let top = infill(json!({"samplers": ["top_k", "infill"], "top_k": 1}));
    let greedy = infill(json!({"temperature": 0}));
    assert_eq!(top["content"], greedy["content"], "{top}");
    assert!(!greedy["content"].as_str().unwrap().is_empty());
    let ended = infill(json!({"samplers": ["top_k", "infill"], "top_k": 5, "logit_bias": [[vocab.id("<|fim_pad|>"), 30.0]]}));
    assert_eq!((&ended["stop_type"], &ended["content"]), (&json!("eos"), &json!("")), "{ended}");
}

/// llama.cpp's code-completion limits, on the text a grammar makes the model write: `n_indent`
/// ends the answer at a line indented less (its indentation kept), `t_max_predict_ms` ends one
/// that holds a new line once it has run that long.
#[test]
fn n_indent_and_t_max_predict_ms_end_the_answer_as_llama_cpps() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&fim_model(tmp.path()), &[]);
    let completion = |extra: Value| {
        let mut body = json!({"prompt": "x", "n_predict": 40, "temperature": 0, "grammar": "root ::= \"if a:\\n    b = 1\\n  c\" [a-z]*"});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post_json(&server.url("/completion"), &body)
    };
    let free = completion(json!({}));
    assert!(free["content"].as_str().unwrap().starts_with("if a:\n    b = 1\n  c"), "{free}");
    let cut = completion(json!({"n_indent": 4}));
    assert_eq!((&cut["content"], &cut["stop_type"]), (&json!("if a:\n    b = 1\n  "), &json!("limit")), "{cut}");
    assert_eq!(completion(json!({"n_indent": 2}))["content"], free["content"]);
    // Streamed, the same text up to the cut.
    let events = sse(
        &server.url("/completion"),
        &json!({"prompt": "x", "n_predict": 40, "temperature": 0, "stream": true, "n_indent": 4,
                                                        "grammar": "root ::= \"if a:\\n    b = 1\\n  c\" [a-z]*"}),
    );
    let streamed: String =
        events.iter().map(|e| serde_json::from_str::<Value>(e).unwrap()["content"].as_str().unwrap().to_string()).collect();
    assert_eq!(streamed, "if a:\n    b = 1\n  ");

    // The time limit counts once the answer holds a new line.
    let timed = completion(json!({"t_max_predict_ms": 1, "grammar": "root ::= \"ab\\n\" [a-z]*"}));
    let text = timed["content"].as_str().unwrap();
    assert_eq!(timed["stop_type"], "limit", "{timed}");
    assert!(text.contains('\n') && timed["tokens_predicted"].as_u64().unwrap() < 40, "{timed}");
    let untimed = completion(json!({"grammar": "root ::= \"ab\\n\" [a-z]*"}));
    assert_eq!(untimed["tokens_predicted"], 40, "{untimed}");
    let one_line = completion(json!({"t_max_predict_ms": 1, "grammar": "root ::= [a-z]*"}));
    assert_eq!((&one_line["tokens_predicted"], &one_line["stop_type"]), (&json!(40), &json!("limit")), "{one_line}");
}

/// The `openai` and `ollama` packages' `suffix` (tests/infill_clients.py).
#[test]
fn the_openai_and_ollama_clients_fill_in_the_middle() {
    let Some(python) = python_or_skip("the_openai_and_ollama_clients_fill_in_the_middle", &["openai", "ollama"]) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = fim_model(tmp.path());
    let vocab = Vocab::of(&model);
    let server = Server::start(&model, &["--api-key", "k"]);
    let ids = vocab.psm(&vocab.text(PREFIX), &vocab.text(SUFFIX)).iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    run_client_script(
        &python,
        "infill_clients.py",
        &server,
        "k",
        "tiny",
        &[("PREFIX", PREFIX), ("SUFFIX", SUFFIX), ("FIM_PROMPT_IDS", &ids)],
    );
}

fn param(body: &str) -> Value {
    serde_json::from_str::<Value>(body).unwrap()["error"]["param"].clone()
}

#[test]
fn llama_cpp_infill_lays_out_context_prefix_prompt_and_suffix_as_llama_server() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fim_model(tmp.path());
    let vocab = Vocab::of(&model);
    let server = Server::start(&model, &[]);
    let extra = json!([{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}, {"text": "X = 1\n"}]);
    let body = json!({"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "a", "input_extra": extra,
                      "n_predict": 8, "temperature": 0});
    // [repo]myproject\n [sep]util.py\n text [sep]tmp\n text [sep]filename\n [pre]prefix prompt [suf]suffix [mid]
    let mut expected = vocab.context(&[("util.py", "def sub(a, b):\n    return a - b\n"), ("tmp", "X = 1\n")]);
    expected.extend(vocab.psm(&[vocab.text(PREFIX), vocab.text("a")].concat(), &vocab.text(SUFFIX)));

    let infill = post_json(&server.url("/infill"), &body);
    let by_hand = post_json(&server.url("/completion"), &json!({"prompt": expected, "n_predict": 8, "temperature": 0}));
    assert_eq!(infill["content"], by_hand["content"], "{infill}");
    assert_eq!(infill["tokens_evaluated"], json!(expected.len()), "{infill}");
    assert_eq!(infill["prompt"], by_hand["prompt"]);

    // llama.cpp's cuts, at its 2,048-token window: the prefix keeps its last 1,536 tokens, the
    // suffix its first 512 - 2 - prompt, the context its last 4,096 - 2,048 + 2 (llama-server's
    // n_ctx - n_batch - 2 x its default n_predict, -1). First prefix and suffix:
    let long_prefix = "x = 1\n".repeat(700);
    let long_suffix = "y = 2\n".repeat(300);
    let long_extra = "z = 3\n".repeat(800);
    let (prefix, suffix) = (vocab.text(&long_prefix), vocab.text(&long_suffix));
    assert!(prefix.len() > 1536 && suffix.len() > 510, "{} {}", prefix.len(), suffix.len());
    let mut cut = vocab.context(&[]);
    cut.extend(vocab.psm(&[&prefix[prefix.len() - 1536..], &vocab.text("a")[..]].concat(), &suffix[..512 - 2 - 1]));
    let long = json!({"input_prefix": long_prefix, "input_suffix": long_suffix, "prompt": "a", "n_predict": 4, "temperature": 0});
    let answer = post_json(&server.url("/infill"), &long);
    let by_hand = post_json(&server.url("/completion"), &json!({"prompt": cut, "n_predict": 4, "temperature": 0}));
    assert_eq!(answer["tokens_evaluated"], json!(cut.len()), "{answer}");
    assert_eq!((&answer["content"], &answer["prompt"]), (&by_hand["content"], &by_hand["prompt"]));
    // The context (with a short suffix, so that the whole prompt fits the 4,096 tokens).
    let context = vocab.context(&[("big.py", &long_extra)]);
    let context_take = 4096 - 2048 + 2;
    assert!(context.len() > context_take, "{}", context.len());
    let mut cut = context[context.len() - context_take..].to_vec();
    cut.extend(vocab.psm(&prefix[prefix.len() - 1536..], &vocab.text(SUFFIX)));
    let long = json!({"input_prefix": long_prefix, "input_suffix": SUFFIX, "n_predict": 4, "temperature": 0,
                      "input_extra": [{"filename": "big.py", "text": long_extra}]});
    let answer = post_json(&server.url("/infill"), &long);
    assert_eq!(answer["tokens_evaluated"], json!(cut.len()), "{answer}");
    let by_hand = post_json(&server.url("/completion"), &json!({"prompt": cut, "n_predict": 4, "temperature": 0}));
    assert_eq!((&answer["content"], &answer["prompt"]), (&by_hand["content"], &by_hand["prompt"]));

    // Its ends stop the answer here too.
    let ended = post_json(
        &server.url("/infill"),
        &json!({"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 5,
                                                           "logit_bias": [[vocab.id("<|fim_pad|>"), 100.0]]}),
    );
    assert_eq!((&ended["stop_type"], &ended["tokens_predicted"]), (&json!("eos"), &json!(1)), "{ended}");

    // Refusals name the field.
    for (bad, name) in [
        (json!({"input_prefix": "a"}), "input_suffix"),
        (json!({"input_suffix": "a"}), "input_prefix"),
        (json!({"input_prefix": "a", "input_suffix": "b", "prompt": [1, 2]}), "prompt"),
        (json!({"input_prefix": "a", "input_suffix": "b", "input_extra": {"text": "x"}}), "input_extra"),
        (json!({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": 3}]}), "input_extra[0].text"),
        (json!({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "x", "path": "p"}]}), "input_extra[0].path"),
        (json!({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "x", "filename": 1}]}), "input_extra[0].filename"),
        (json!({"input_prefix": "a", "input_suffix": "b", "mirostat": 2}), "mirostat"),
    ] {
        let (status, text, _) = post(&server.url("/infill"), &bad.to_string(), None);
        assert_eq!((status, param(&text)), (400, json!(name)), "{bad}: {text}");
    }
}

#[test]
fn ollamas_suffix_fills_in_the_middle_and_models_without_fim_tokens_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fim_model(tmp.path());
    let server = Server::start(&model, &[]);
    let openai = completion(&server, json!({"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}));
    let ollama = post_json(
        &server.url("/api/generate"),
        &json!({"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "stream": false, "options": {"temperature": 0, "num_predict": 8}}),
    );
    assert_eq!(ollama["response"], openai["choices"][0]["text"], "{ollama}");
    assert_eq!(ollama["prompt_eval_count"], openai["usage"]["prompt_tokens"]);
    // Sampled with a seed: the draws follow the distributions, which the layout changes.
    let sampled = |url: &str, body: Value| post_json(&server.url(url), &body);
    let openai = sampled(
        "/v1/completions",
        json!({"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 12, "temperature": 1.5, "seed": 7}),
    );
    let ollama = sampled(
        "/api/generate",
        json!({"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "stream": false, "options": {"temperature": 1.5, "seed": 7, "num_predict": 12}}),
    );
    assert_eq!(ollama["response"], openai["choices"][0]["text"], "{ollama}");
    let show = post_json(&server.url("/api/show"), &json!({"model": "tiny"}));
    assert!(show["capabilities"].as_array().unwrap().contains(&json!("insert")), "{show}");
    // A gap at the start of a file (no prompt) is filled, not answered as a load.
    let start = post_json(
        &server.url("/api/generate"),
        &json!({"model": "tiny", "suffix": SUFFIX, "stream": false, "options": {"temperature": 0, "num_predict": 3}}),
    );
    assert_eq!((&start["done_reason"], &start["eval_count"]), (&json!("length"), &json!(3)), "{start}");
    let (status, text, _) =
        post(&server.url("/api/generate"), &json!({"model": "tiny", "prompt": "a", "suffix": "b", "raw": true}).to_string(), None);
    assert_eq!(status, 400, "{text}");
    assert!(serde_json::from_str::<Value>(&text).unwrap()["error"].as_str().unwrap().starts_with("`raw`"), "{text}");

    // The plain fixture has no FIM tokens: every route refuses, saying which are missing.
    let plain = Server::start(&fixture("qwen2", tmp.path()), &[]);
    let show = post_json(&plain.url("/api/show"), &json!({"model": "tiny"}));
    assert!(!show["capabilities"].as_array().unwrap().contains(&json!("insert")), "{show}");
    let (status, text, _) = post(&plain.url("/v1/completions"), &json!({"model": "tiny", "prompt": "a", "suffix": "b"}).to_string(), None);
    assert_eq!((status, param(&text)), (400, json!("suffix")), "{text}");
    assert!(text.contains("prefix token is missing"), "{text}");
    let (status, text, _) = post(&plain.url("/infill"), &json!({"input_prefix": "a", "input_suffix": "b"}).to_string(), None);
    assert_eq!(status, 400, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["type"], "not_supported_error", "{text}");
    assert!(error["error"]["message"].as_str().unwrap().starts_with("Infill is not supported by this model: prefix token is missing."));
    let (status, text, _) = post(&plain.url("/api/generate"), &json!({"model": "tiny", "prompt": "a", "suffix": "b"}).to_string(), None);
    assert_eq!(status, 400, "{text}");
    let error = serde_json::from_str::<Value>(&text).unwrap()["error"].as_str().unwrap().to_string();
    assert!(
        error.starts_with("`suffix` needs a model trained to fill in the middle") && error.contains("prefix token is missing"),
        "{text}"
    );
}
