//! llama.cpp's server's own API (`/completion`, `/props`, `/apply-template`, `/tokenize` with
//! `content`) against a real server on SmolLM2: each answer checked against the OpenAI endpoint
//! given the same request in its names (the same greedy text, the same scores), streamed against
//! whole, and every refusal by the field llama.cpp names.

mod common;

use common::server::*;
use common::*;
use serde_json::{json, Value};

const PROMPT: &str = "The capital of France is";

fn completion(server: &Server, body: Value) -> Value {
    post_json(&server.url("/completion"), &body)
}

fn refused(server: &Server, body: Value) -> Value {
    let (status, text, _) = post(&server.url("/completion"), &body.to_string(), None);
    assert_eq!(status, 400, "{body}: {text}");
    serde_json::from_str::<Value>(&text).unwrap()["error"].clone()
}

#[test]
fn completion_answers_as_llama_server_does() {
    let Some(gguf) = smollm2_gguf_or_skip("completion_answers_as_llama_server_does") else { return };
    let server = Server::start(&gguf, &[]);

    // Greedy: the OpenAI endpoint's text and scores for the same prompt and length.
    let whole = completion(&server, json!({"prompt": PROMPT, "n_predict": 12, "temperature": 0, "n_probs": 3, "return_tokens": true}));
    let openai = post_json(
        &server.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}),
    );
    let content = whole["content"].as_str().unwrap();
    assert_eq!(content, openai["choices"][0]["text"], "{whole}");
    assert_eq!(whole["stop"], true);
    assert_eq!(whole["stop_type"], "limit");
    assert_eq!(whole["model"], "tiny");
    assert_eq!(whole["tokens_predicted"], 12);
    assert_eq!(whole["tokens_evaluated"], openai["usage"]["prompt_tokens"]);
    assert_eq!(whole["prompt"], PROMPT);
    assert_eq!(whole["has_new_line"], content.contains('\n'));
    assert_eq!(whole["generation_settings"]["n_predict"], 12);
    assert_eq!(whole["generation_settings"]["samplers"], json!(["penalties", "top_k", "top_p", "min_p", "temperature"]));
    let timings = &whole["timings"];
    assert_eq!(timings["predicted_n"], 12);
    assert!(timings["predicted_ms"].as_f64().unwrap() > 0.0 && timings["predicted_per_second"].as_f64().unwrap() > 0.0, "{timings}");
    // The ids are the text's.
    let tokens = whole["tokens"].clone();
    assert_eq!(tokens.as_array().unwrap().len(), 12);
    assert_eq!(post_json(&server.url("/detokenize"), &json!({"tokens": tokens}))["content"], content);
    // Scores: each token's, with its 3 best alternatives (the greedy token the best), as OpenAI's.
    let probs = whole["completion_probabilities"].as_array().unwrap();
    let theirs = openai["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(probs.len(), 12);
    for (p, lp) in probs.iter().zip(theirs) {
        assert_eq!(p["top_logprobs"].as_array().unwrap().len(), 3, "{p}");
        assert_eq!(p["top_logprobs"][0]["id"], p["id"], "{p}");
        assert!((p["logprob"].as_f64().unwrap() - lp.as_f64().unwrap()).abs() < 1e-4, "{p} vs {lp}");
        assert_eq!(p["bytes"], json!(p["token"].as_str().unwrap().as_bytes()), "{p}");
    }

    // Streamed: a `data:` event per token with its id, then the whole answer's fields; no [DONE].
    let events: Vec<Value> = sse(&server.url("/completion"), &json!({"prompt": PROMPT, "n_predict": 12, "temperature": 0, "stream": true}))
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let (last, pieces) = events.split_last().unwrap();
    let streamed: String = pieces.iter().map(|e| e["content"].as_str().unwrap()).collect();
    assert_eq!(streamed, content);
    assert!(pieces.iter().all(|e| e["stop"] == false && e["tokens"].as_array().unwrap().len() == 1), "{pieces:?}");
    let streamed_ids: Vec<Value> = pieces.iter().map(|e| e["tokens"][0].clone()).collect();
    assert_eq!(json!(streamed_ids), tokens);
    assert_eq!((&last["stop"], &last["stop_type"], &last["tokens_predicted"]), (&json!(true), &json!("limit"), &json!(12)), "{last}");

    // response_fields: only those, nested ones under their paths, missing ones left out; the
    // stream's last event likewise.
    let fields = json!(["content", "timings/predicted_n", "generation_settings/n_predict", "no/such"]);
    let picked = completion(&server, json!({"prompt": PROMPT, "n_predict": 12, "temperature": 0, "response_fields": fields}));
    assert_eq!(picked, json!({"content": content, "timings/predicted_n": 12, "generation_settings/n_predict": 12}));
    let streamed_last = sse(
        &server.url("/completion"),
        &json!({"prompt": PROMPT, "n_predict": 3, "temperature": 0, "stream": true, "response_fields": ["stop_type"]}),
    );
    assert_eq!(serde_json::from_str::<Value>(streamed_last.last().unwrap()).unwrap(), json!({"stop_type": "limit"}));

    // A stop word ends it, named, and out of the text (more than OpenAI's 4 may be given).
    let words = json!(["Berlin", "\n", "Rome", "Madrid", "Lisbon", "Vienna"]);
    let stopped = completion(&server, json!({"prompt": PROMPT, "n_predict": 40, "temperature": 0, "stop": words}));
    assert_eq!((&stopped["stop_type"], &stopped["stopping_word"]), (&json!("word"), &json!("\n")), "{stopped}");
    assert_eq!(stopped["content"].as_str().unwrap(), content.split('\n').next().unwrap());

    // A chat rendered by /apply-template and continued to the model's end (n_predict -1, the
    // default): the chat endpoint's greedy answer, ended by eos.
    let messages = json!([{"role": "user", "content": "Say hello in one short sentence."}]);
    let rendered = post_json(&server.url("/apply-template"), &json!({"messages": messages}));
    let prompt = rendered["prompt"].as_str().unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{rendered}");
    let chat_turn = completion(&server, json!({"prompt": prompt, "temperature": 0}));
    let chat = post_json(&server.url("/v1/chat/completions"), &json!({"model": "tiny", "messages": messages, "temperature": 0}));
    assert_eq!(chat_turn["content"], chat["choices"][0]["message"]["content"], "{chat_turn}");
    assert_eq!(chat_turn["stop_type"], "eos");
    assert_eq!(chat_turn["generation_settings"]["n_predict"], -1);

    // Ids and text mixed: the text's ids.
    let tail = post_json(&server.url("/tokenize"), &json!({"content": " of France is"}))["tokens"].clone();
    let mut mixed = vec![json!("The capital")];
    mixed.extend(tail.as_array().unwrap().iter().cloned());
    let from_mixed = completion(&server, json!({"prompt": mixed, "n_predict": 12, "temperature": 0}));
    assert_eq!((&from_mixed["content"], &from_mixed["tokens_evaluated"]), (&whole["content"], &whole["tokens_evaluated"]));

    // logit_bias as llama.cpp writes it: false bans a token, by id or by its text.
    let first = &tokens[0];
    for bias in [json!([[first, false]]), json!([[" Paris", false]]), json!({first.to_string(): -100})] {
        let banned =
            completion(&server, json!({"prompt": PROMPT, "n_predict": 2, "temperature": 0, "return_tokens": true, "logit_bias": bias}));
        assert_ne!(&banned["tokens"][0], first, "{bias}: {banned}");
    }

    // Grammars: GBNF and a JSON schema.
    let yes_no = completion(&server, json!({"prompt": "Is Paris in France?", "grammar": "root ::= \"yes\" | \"no\"", "seed": 3}));
    assert!(["yes", "no"].contains(&yes_no["content"].as_str().unwrap()), "{yes_no}");
    let schema = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]});
    let city = completion(&server, json!({"prompt": PROMPT, "json_schema": schema, "n_predict": 30, "temperature": 0}));
    let parsed: Value = serde_json::from_str(city["content"].as_str().unwrap()).unwrap_or_else(|e| panic!("{e}: {city}"));
    assert!(parsed["city"].is_string(), "{city}");

    // Ids without scores: a grammar makes the answer emoji, whose bytes span several tokens, so
    // some tokens show no text yet; the stream still gives every token's id, once, and neither
    // answer has scores nobody asked for.
    let emoji = |extra: Value| {
        let mut body = json!({"prompt": PROMPT, "grammar": "root ::= \"\u{1F600}\u{1F680}\"", "temperature": 0, "n_predict": 8});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let whole = completion(&server, emoji(json!({"return_tokens": true})));
    let ids = whole["tokens"].as_array().unwrap();
    assert_eq!((whole["content"].as_str(), ids.len()), (Some("\u{1F600}\u{1F680}"), whole["tokens_predicted"].as_u64().unwrap() as usize));
    assert!(ids.len() > 2 && whole.get("completion_probabilities").is_none(), "{whole}");
    assert_eq!(post_json(&server.url("/detokenize"), &json!({"tokens": ids}))["content"], whole["content"]);
    let events: Vec<Value> =
        sse(&server.url("/completion"), &emoji(json!({"stream": true}))).iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let (_, pieces) = events.split_last().unwrap();
    assert!(pieces.iter().any(|e| e["content"] == "") && pieces.iter().all(|e| e.get("completion_probabilities").is_none()), "{pieces:?}");
    let streamed_ids: Vec<Value> = pieces.iter().flat_map(|e| e["tokens"].as_array().unwrap().clone()).collect();
    assert_eq!(&streamed_ids, ids);
}

#[test]
fn sampling_follows_llama_cpps_settings() {
    let Some(gguf) = smollm2_gguf_or_skip("sampling_follows_llama_cpps_settings") else { return };
    let server = Server::start(&gguf, &[]);
    let openai = |extra: Value| {
        let mut body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post_json(&server.url("/v1/completions"), &body)["choices"][0]["text"].clone()
    };
    let ours = |extra: Value| {
        let mut body = json!({"prompt": PROMPT, "n_predict": 24, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        completion(&server, body)["content"].clone()
    };
    // repeat_last_n: -1 penalises the whole context (vLLM's repetition_penalty), 0 nothing, and
    // a short window only its tokens: this greedy answer repeats itself, and the penalty changes it.
    let plain = ours(json!({}));
    let whole_context = ours(json!({"repeat_penalty": 1.8, "repeat_last_n": -1}));
    assert_eq!(whole_context, openai(json!({"repetition_penalty": 1.8})));
    assert_ne!(whole_context, plain);
    assert_eq!(ours(json!({"repeat_penalty": 1.8, "repeat_last_n": 0})), plain);
    let window = ours(json!({"repeat_penalty": 1.8, "repeat_last_n": 4}));
    assert_ne!(window, whole_context);
    // Without `penalties` in the chain there are none.
    assert_eq!(ours(json!({"repeat_penalty": 1.8, "samplers": ["top_k", "temperature"]})), plain);

    // The default temperature (0.8) samples: a seed repeats its answer, and the seed reported
    // for a random one repeats it too.
    let sampled = |extra: Value| {
        let mut body = json!({"prompt": PROMPT, "n_predict": 24});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        completion(&server, body)
    };
    let a = sampled(json!({"seed": 5}));
    assert_eq!(a["content"], sampled(json!({"seed": 5}))["content"]);
    assert_eq!(a["generation_settings"]["temperature"], 0.8);
    let random = sampled(json!({}));
    let seed = random["generation_settings"]["seed"].clone();
    assert!(seed.as_u64().is_some_and(|s| s <= u32::MAX as u64), "{seed}");
    assert_eq!(sampled(json!({"seed": seed}))["content"], random["content"]);
    // top_k 1 anywhere in the chain is greedy whatever the temperature.
    assert_eq!(sampled(json!({"top_k": 1, "temperature": 1.5, "seed": 9}))["content"], plain);
}

#[test]
fn llama_cpp_requests_are_refused_by_field() {
    let Some(gguf) = smollm2_gguf_or_skip("llama_cpp_requests_are_refused_by_field") else { return };
    let server = Server::start(&gguf, &[]);
    for (extra, param) in [
        (json!({"mirostat": 2}), "mirostat"),
        (json!({"typical_p": 0.5}), "typical_p"),
        (json!({"dry_multiplier": 0.8}), "dry_multiplier"),
        (json!({"xtc_probability": 0.5}), "xtc_probability"),
        (json!({"id_slot": 1000}), "id_slot"),
        (json!({"lora": [{"id": 0, "scale": 1.0}]}), "lora"),
        (json!({"n_predict": 0}), "n_predict"),
        (json!({"n_predict": 100000}), "n_predict"),
        (json!({"temperature": 3.0}), "temperature"),
        (json!({"n_probs": 50}), "n_probs"),
        (json!({"repeat_penalty": 0}), "repeat_penalty"),
        (json!({"samplers": ["top_k", "mystery"]}), "samplers"),
        (json!({"samplers": ["temperature", "penalties"]}), "samplers"),
        (json!({"logit_bias": [[1, "x"]]}), "logit_bias"),
        (json!({"logit_bias": [[99999999, 1.0]]}), "logit_bias"),
        (json!({"prompt": [1, 99999999]}), "prompt"),
        (json!({"post_sampling_probs": true}), "post_sampling_probs"),
        (json!({"stop": "\n"}), "stop"),
        (json!({"response_fields": "content"}), "response_fields"),
        (json!({"stop": ["ok", ""]}), "stop"),
        (json!({"grammar": "root ::= missing"}), "grammar"),
        (json!({"unknown_thing": 1}), "unknown_thing"),
    ] {
        let mut body = json!({"prompt": PROMPT});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let error = refused(&server, body);
        assert_eq!(error["param"], param, "{extra}: {error}");
    }
    // Inert fields are taken: the samplers they tune are off, the cache is always used.
    let taken = completion(
        &server,
        json!({"prompt": PROMPT, "n_predict": 2, "cache_prompt": true, "id_slot": 0, "dry_base": 1.75, "mirostat": 0,
               "typical_p": 1.0, "min_keep": 0, "n_keep": 0, "grammar": "", "lora": []}),
    );
    assert_eq!(taken["tokens_predicted"], 2);
}

#[test]
fn props_and_tokenize_answer_as_llama_server_does() {
    let Some(gguf) = smollm2_gguf_or_skip("props_and_tokenize_answer_as_llama_server_does") else { return };
    let server = Server::start(&gguf, &["--max-model-len", "1024", "--max-num-seqs", "3"]);
    let props = get_json(&server.url("/props"));
    let settings = &props["default_generation_settings"];
    assert_eq!(settings["n_ctx"], 1024, "{props}");
    assert_eq!(settings["params"]["temperature"], 0.8);
    assert_eq!(settings["params"]["n_predict"], -1);
    assert_eq!(props["total_slots"], 3);
    assert!(props["chat_template"].as_str().unwrap().contains("<|im_start|>"), "{props}");

    let plain = post_json(&server.url("/tokenize"), &json!({"content": "Hello world, héllo!"}));
    let vllm = post_json(&server.url("/tokenize"), &json!({"prompt": "Hello world, héllo!", "add_special_tokens": false}));
    assert_eq!(plain["tokens"], vllm["tokens"]);
    let pieces = post_json(&server.url("/tokenize"), &json!({"content": "Hello world, héllo!", "with_pieces": true}));
    let mut bytes = vec![];
    for p in pieces["tokens"].as_array().unwrap() {
        match &p["piece"] {
            Value::String(s) => bytes.extend(s.as_bytes()),
            Value::Array(b) => bytes.extend(b.iter().map(|x| x.as_u64().unwrap() as u8)),
            other => panic!("{other}"),
        }
    }
    assert_eq!(String::from_utf8(bytes).unwrap(), "Hello world, héllo!");
    let (status, text, _) = post(&server.url("/tokenize"), &json!({"content": "x", "parse_special": false}).to_string(), None);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("parse_special"), "{text}");
}

#[test]
fn embedding_answers_as_llama_server_does() {
    let Some(gguf) = smollm2_gguf_or_skip("embedding_answers_as_llama_server_does") else { return };
    let server = Server::start(&gguf, &[]);
    let texts = ["The capital of France is Paris.", "Bonjour"];
    let openai = post_json(&server.url("/v1/embeddings"), &json!({"model": "tiny", "input": texts}));
    let vector = |v: &Value| -> Vec<f64> { v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect() };
    let unit: Vec<Vec<f64>> = openai["data"].as_array().unwrap().iter().map(|d| vector(&d["embedding"])).collect();
    let close =
        |a: &[f64], b: &[f64], tol: f64| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * y.abs().max(1e-3));

    // Each text's entry: its index and a list of vectors (one, the pooled one), at unit length
    // by default, as OpenAI's; `/embeddings` and `input` are the same route and field.
    for (route, field) in [("/embedding", "content"), ("/embeddings", "input")] {
        let answer = post_json(&server.url(route), &json!({field: texts}));
        let entries = answer.as_array().unwrap_or_else(|| panic!("{answer}"));
        assert_eq!(entries.len(), 2);
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(e["index"], i);
            assert_eq!(e["embedding"].as_array().unwrap().len(), 1, "{route}");
            assert!(close(&vector(&e["embedding"][0]), &unit[i], 1e-5), "{route} {i}");
        }
    }
    // embd_normalize: -1 the model's own vector, 0 the int16 range, 1 taxicab, 3 a p-norm; each
    // the unit vector scaled.
    let one = |extra: Value| {
        let mut body = json!({"content": texts[0]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        vector(&post_json(&server.url("/embedding"), &body)[0]["embedding"][0])
    };
    let raw = one(json!({"embd_normalize": -1}));
    let length = raw.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!(length > 1.5 && close(&raw.iter().map(|x| x / length).collect::<Vec<_>>(), &unit[0], 1e-5), "{length}");
    let int16 = one(json!({"embd_normalize": 0}));
    let biggest = int16.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    assert!((biggest - 32760.0).abs() < 1e-2, "{biggest}");
    for p in [1, 3] {
        let scaled = one(json!({"embd_normalize": p}));
        let norm = scaled.iter().map(|x| x.abs().powi(p)).sum::<f64>().powf(1.0 / p as f64);
        let direction = (scaled[0] / unit[0][0], scaled[7] / unit[0][7]);
        assert!((norm - 1.0).abs() < 1e-4 && (direction.0 - direction.1).abs() < 1e-3 * direction.0.abs(), "{p}: {norm} {direction:?}");
    }
    // llama.cpp's mixed form: ids and text in one list are one text.
    let ids = post_json(&server.url("/tokenize"), &json!({"content": "The capital of France", "add_special": true}))["tokens"].clone();
    let mut mixed = ids.as_array().unwrap().clone();
    mixed.push(json!(" is Paris."));
    let from_mixed = post_json(&server.url("/embedding"), &json!({"content": [mixed]}));
    assert!(close(&vector(&from_mixed[0]["embedding"][0]), &unit[0], 1e-4));

    // Refusals name the field.
    for (body, param) in [
        (json!({"texts": ["x"]}), "texts"),
        (json!({}), "content"),
        (json!({"content": "x", "encoding_format": "base64"}), "encoding_format"),
        (json!({"content": "x", "embd_normalize": -2}), "embd_normalize"),
        (json!({"content": ""}), "content"),
        (json!({"content": [1, "x", 99999999]}), "content"),
    ] {
        let (status, text, _) = post(&server.url("/embedding"), &body.to_string(), None);
        assert_eq!(status, 400, "{body}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["param"], param, "{body}: {text}");
    }
}

/// llama.cpp's other names of routes answer as the routes do, with the key where those need it.
#[test]
fn llama_cpps_route_names_answer() {
    let Some(gguf) = smollm2_gguf_or_skip("llama_cpps_route_names_answer") else { return };
    let server = Server::start(&gguf, &["--api-key", "k"]);
    let key = Some("k");
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0});
    let rerank = json!({"model": "tiny", "query": "capital of France", "documents": ["Paris is in France.", "Bananas are yellow."]});
    for (name, original, body) in
        [("/chat/completions", "/v1/chat/completions", &chat), ("/reranking", "/v1/rerank", &rerank), ("/v1/reranking", "/rerank", &rerank)]
    {
        let (status, text, _) = post(&server.url(name), &body.to_string(), key);
        let (_, expected, _) = post(&server.url(original), &body.to_string(), key);
        assert_eq!(status, 200, "{name}: {text}");
        let (mut got, mut want): (Value, Value) = (serde_json::from_str(&text).unwrap(), serde_json::from_str(&expected).unwrap());
        for v in [&mut got, &mut want] {
            v.as_object_mut().unwrap().retain(|k, _| !["id", "created", "system_fingerprint"].contains(&k.as_str()));
        }
        assert_eq!(got, want, "{name}");
        assert_eq!(post(&server.url(name), &body.to_string(), None).0, 401, "{name} without the key");
    }
    let models = |path: &str, key: Option<&str>| {
        let mut req = ureq::get(&server.url(path));
        if let Some(k) = key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        match req.call() {
            Ok(r) => (200, r.into_string().unwrap()),
            Err(ureq::Error::Status(code, _)) => (code, String::new()),
            Err(e) => panic!("{path}: {e}"),
        }
    };
    assert_eq!(models("/models", key), models("/v1/models", key));
    assert_eq!(models("/models", None).0, 401);
    assert_eq!(models("/v1/health", None), models("/health", None));
}

/// A list of prompts, split as llama.cpp's server splits it (strings and lists each a prompt; a
/// list holding ids is one prompt, strings mixed in): a list of answers, each with its prompt's
/// `index` and equal to that prompt's answer alone; streamed, each prompt's events carry its
/// index and end once. A prompt's refusal names it.
#[test]
fn a_list_of_prompts_is_answered_as_llama_server_does() {
    let Some(gguf) = smollm2_gguf_or_skip("a_list_of_prompts_is_answered_as_llama_server_does") else { return };
    // One sequence at a time: each prompt runs as it would alone, so the answers are equal to the bit.
    let server = Server::start(&gguf, &["--max-concurrent-requests", "1", "--max-queue", "3"]);
    let ids = post_json(&server.url("/tokenize"), &json!({"content": "Once upon a time"}))["tokens"].clone();
    let mixed = json!([ids[0], " upon a time"]);
    let prompts = json!([PROMPT, ids, mixed]);
    let body = |prompt: &Value| json!({"prompt": prompt, "n_predict": 6, "temperature": 0, "n_probs": 2, "return_tokens": true});
    let compared = |v: &Value| {
        let keys = ["content", "tokens", "completion_probabilities", "tokens_predicted", "tokens_evaluated", "stop_type", "prompt"];
        keys.iter().map(|k| v[*k].clone()).collect::<Vec<_>>()
    };
    let answers = completion(&server, body(&prompts));
    let answers = answers.as_array().unwrap_or_else(|| panic!("a list of answers: {answers}"));
    assert_eq!(answers.len(), 3);
    for (i, prompt) in prompts.as_array().unwrap().iter().enumerate() {
        let alone = completion(&server, body(prompt));
        assert_eq!(answers[i]["index"], i, "{}", answers[i]);
        assert_eq!(compared(&answers[i]), compared(&alone), "prompt {i}");
    }
    // Ids with a string mixed in are one prompt: the same as its text.
    assert_eq!(answers[2]["content"], answers[1]["content"]);
    // One prompt answers one object, as before.
    assert!(completion(&server, body(&json!([PROMPT])))["content"].is_string());

    let mut streamed = body(&prompts);
    streamed["stream"] = json!(true);
    let events: Vec<Value> = sse(&server.url("/completion"), &streamed).iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    for (i, answer) in answers.iter().enumerate() {
        let mine: Vec<&Value> = events.iter().filter(|e| e["index"] == i).collect();
        let text: String = mine.iter().map(|e| e["content"].as_str().unwrap()).collect::<String>();
        let (last, pieces) = mine.split_last().unwrap();
        assert_eq!(last["stop"], true, "prompt {i} ends with its stop event");
        assert!(pieces.iter().all(|e| e["stop"] == false), "prompt {i}: one stop event");
        assert_eq!(text, answer["content"].as_str().unwrap(), "prompt {i}");
    }

    for (prompt, param) in [
        (json!([]), "prompt"),
        (json!([1, [2]]), "prompt"),
        (json!(["a", {"b": 1}]), "prompt[1]"),
        (json!(["a", [1, 1_000_000]]), "prompt[1]"),
    ] {
        let error = refused(&server, json!({"prompt": prompt, "n_predict": 2}));
        assert_eq!(error["param"], param, "{prompt}: {error}");
    }
    // Five prompts are more than the server admits at once (1 + 3).
    let error = refused(&server, json!({"prompt": ["a", "b", "c", "d", "e"], "n_predict": 2}));
    assert_eq!(error["param"], "prompt", "{error}");
}
