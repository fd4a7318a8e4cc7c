//! `/v1/embeddings` against a real server: the `qwen3-embedding` fixture (a bare Qwen3Model with
//! sentence-transformers' last-token pooling, laid out as Qwen3-Embedding is) embeds as
//! sentence-transformers does on the same files (tests/reference/embeddings-qwen3.json, made by
//! make_embedding_reference.py), from text or token ids, as floats or base64, pooled by the
//! model's own files or `--pooling`; a generating model embeds too; what cannot be done is a 400
//! naming the field. The `openai` package and LangChain's `OpenAIEmbeddings` run against it
//! (tests/embeddings_client.py).

mod common;

use base64::Engine as _;
use common::server::*;
use common::*;
use serde_json::{json, Value};

fn reference() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/embeddings-qwen3.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn vector(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn assert_close(ours: &[f32], theirs: &[f32], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}");
    let worst = ours.iter().zip(theirs).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(worst < 2e-5, "{what}: max difference {worst}");
}

fn embedding_fixture(root: &std::path::Path) -> std::path::PathBuf {
    let dir = root.join("emb");
    let o = run_cli(&["fixture", "--name", "qwen3-embedding", "--out", dir.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    dir
}

#[test]
fn embeddings_match_sentence_transformers_and_refuse_what_they_cannot_do() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&embedding_fixture(tmp.path()), &[]);
    let url = server.url("/v1/embeddings");
    let r = reference();
    let texts: Vec<&Value> = r["texts"].as_array().unwrap().iter().collect();
    let inputs: Vec<&str> = texts.iter().map(|t| t["text"].as_str().unwrap()).collect();

    let batch = post_json(&url, &json!({"model": "tiny", "input": inputs}));
    assert_eq!(batch["object"], "list");
    let prompt_tokens: usize = texts.iter().map(|t| t["ids"].as_array().unwrap().len()).sum();
    assert_eq!(batch["usage"], json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}));
    for (i, t) in texts.iter().enumerate() {
        let item = &batch["data"][i];
        assert_eq!((item["object"].as_str(), item["index"].as_u64()), (Some("embedding"), Some(i as u64)));
        assert_close(&vector(&item["embedding"]), &vector(&t["embedding"]), &format!("text {i} vs sentence-transformers"));
    }
    // Token ids embed as their text; base64 is the same floats' little-endian bytes.
    let ids = post_json(&url, &json!({"model": "tiny", "input": texts[1]["ids"], "encoding_format": "base64"}));
    let bytes = base64::engine::general_purpose::STANDARD.decode(ids["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let decoded: Vec<f32> = bytes.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_close(&decoded, &vector(&batch["data"][1]["embedding"]), "token ids, base64");

    // Refusals, each naming its field.
    let refused = |body: Value, param: &str, says: &str| {
        let (status, text, _) = post(&url, &body.to_string(), None);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{text}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{text}");
    };
    refused(json!({"model": "tiny", "input": "hi", "dimensions": 8}), "dimensions", "matryoshka");
    refused(json!({"model": "tiny", "input": vec![5; 257]}), "input", "257 tokens; this model's context is 256");
    refused(json!({"model": "tiny", "input": ["ok", ""]}), "input[1]", "empty");
    refused(json!({"model": "tiny", "input": "hi", "encoding_format": "int8"}), "encoding_format", "base64");
    let (status, text, _) = post(
        &server.url("/v1/chat/completions"),
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
        None,
    );
    assert!(status == 400 && text.contains("embeddings only"), "{text}");
    drop(server);

    // `--pooling mean` overrides the model's own: transformers' states, averaged.
    let server = Server::start(&embedding_fixture(&tmp.path().join("again")), &["--pooling", "mean"]);
    let mean = post_json(&server.url("/v1/embeddings"), &json!({"model": "tiny", "input": inputs[0]}));
    assert_close(&vector(&mean["data"][0]["embedding"]), &vector(&texts[0]["mean_pooled"]), "mean pooling vs transformers");
}

#[test]
fn a_generating_model_embeds_too_and_matryoshka_sizes_are_cut() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    config["matryoshka_dimensions"] = json!([16, 32]);
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let server = Server::start(&model, &[]);
    let url = server.url("/v1/embeddings");
    let full = vector(&post_json(&url, &json!({"model": "tiny", "input": "hello"}))["data"][0]["embedding"]);
    assert_eq!(full.len(), 64);
    let cut = vector(&post_json(&url, &json!({"model": "tiny", "input": "hello", "dimensions": 16}))["data"][0]["embedding"]);
    let norm = full[..16].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert_close(&cut, &full[..16].iter().map(|x| x / norm).collect::<Vec<_>>(), "the first 16, normalised again");
    let (status, text, _) = post(&url, &json!({"model": "tiny", "input": "hello", "dimensions": 20}).to_string(), None);
    assert!(status == 400 && text.contains("[16, 32]"), "{text}");
    // It still generates.
    let chat = post_json(
        &server.url("/v1/chat/completions"),
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(chat["object"], "chat.completion");
}

#[test]
fn the_openai_client_and_langchain_embed_against_the_server() {
    let test = "the_openai_client_and_langchain_embed_against_the_server";
    let Some(python) = python_or_skip(test, &["openai", "numpy", "langchain-openai:langchain_openai"]) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&embedding_fixture(tmp.path()), &["--api-key", "k"]);
    run_client_script(&python, "embeddings_client.py", &server, "k", "tiny", &[]);
}

/// `/v1/score` and `/v1/rerank` (and `/rerank`, `/v2/rerank`): the cosine similarities of
/// sentence-transformers' embeddings of the same texts, paired and sorted as vLLM does; then
/// Cohere's v1 and v2 clients rerank against the server (tests/rerank_client.py).
#[test]
fn scores_and_reranking_are_the_reference_embeddings_cosines() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&embedding_fixture(tmp.path()), &[]);
    let r = reference();
    let texts: Vec<&str> = r["texts"].as_array().unwrap().iter().map(|t| t["text"].as_str().unwrap()).collect();
    let reference: Vec<Vec<f32>> = r["texts"].as_array().unwrap().iter().map(|t| vector(&t["embedding"])).collect();
    let cosine = |a: &[f32], b: &[f32]| {
        let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        dot / (a.iter().map(|x| x * x).sum::<f32>().sqrt() * b.iter().map(|x| x * x).sum::<f32>().sqrt())
    };
    let close = |got: &Value, want: f32, what: &str| assert!((got.as_f64().unwrap() as f32 - want).abs() < 1e-4, "{what}: {got} vs {want}");

    // One against many, and pairwise.
    let one = post_json(&server.url("/v1/score"), &json!({"model": "tiny", "text_1": texts[0], "text_2": [texts[1], texts[2]]}));
    assert_eq!((one["object"].as_str(), one["data"].as_array().map(Vec::len)), (Some("list"), Some(2)), "{one}");
    close(&one["data"][0]["score"], cosine(&reference[0], &reference[1]), "text 0 with text 1");
    close(&one["data"][1]["score"], cosine(&reference[0], &reference[2]), "text 0 with text 2");
    let pairwise =
        post_json(&server.url("/score"), &json!({"model": "tiny", "text_1": [texts[0], texts[1]], "text_2": [texts[2], texts[1]]}));
    close(&pairwise["data"][0]["score"], cosine(&reference[0], &reference[2]), "pair 0");
    close(&pairwise["data"][1]["score"], 1.0, "a text with itself");

    // Rerank: best first, each with its index and text; top_n cuts; all three paths.
    let documents = json!([texts[1], {"text": texts[2]}, texts[0]]);
    let mut want: Vec<(usize, f32)> = [1, 2, 0].iter().enumerate().map(|(i, &t)| (i, cosine(&reference[0], &reference[t]))).collect();
    want.sort_by(|a, b| b.1.total_cmp(&a.1));
    for path in ["/v1/rerank", "/rerank", "/v2/rerank"] {
        let ranked = post_json(&server.url(path), &json!({"model": "tiny", "query": texts[0], "documents": documents, "top_n": 2}));
        let results = ranked["results"].as_array().unwrap();
        assert_eq!(results.len(), 2, "{ranked}");
        for (got, (index, score)) in results.iter().zip(&want) {
            assert_eq!(got["index"].as_u64(), Some(*index as u64), "{ranked}");
            close(&got["relevance_score"], *score, path);
            let text = documents[*index].as_str().or(documents[*index]["text"].as_str()).unwrap();
            assert_eq!(got["document"]["text"].as_str(), Some(text), "{ranked}");
        }
    }
    let bare = post_json(
        &server.url("/v1/rerank"),
        &json!({"model": "tiny", "query": texts[0], "documents": documents, "return_documents": false}),
    );
    assert!(
        bare["results"].as_array().unwrap().iter().all(|r| r.get("document").is_none()) && bare["results"].as_array().unwrap().len() == 3
    );

    // Refusals name the field.
    for (path, body, param) in [
        ("/v1/score", json!({"model": "tiny", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}), "text_2"),
        ("/v1/score", json!({"model": "tiny", "text_1": "a"}), "text_2"),
        ("/v1/rerank", json!({"model": "tiny", "query": "a", "documents": []}), "documents"),
        ("/v1/rerank", json!({"model": "tiny", "query": "a", "documents": ["b", ""]}), "documents[1]"),
        ("/v1/rerank", json!({"model": "tiny", "query": "a", "documents": ["b"], "rank_fields": ["x"]}), "rank_fields"),
    ] {
        let (status, text, _) = post(&server.url(path), &body.to_string(), None);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{path} {body}: {text}");
    }

    let Some(python) = python_or_skip("scores_and_reranking_are_the_reference_embeddings_cosines", &["cohere"]) else { return };
    run_client_script(&python, "rerank_client.py", &server, "", "tiny", &[("QUERY", texts[0]), ("DOCUMENTS", &documents.to_string())]);
}
