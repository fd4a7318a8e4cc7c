//! Agent libraries, unchanged, against `fsdp-app serve` with the real SmolLM2-135M-Instruct
//! (converted from the PyPI GGUF): LangChain's ChatOpenAI (`bind_tools`, `with_structured_output`),
//! the OpenAI Agents SDK (a function tool and an `output_type`, on its Chat Completions and its
//! Responses model classes, streamed and not) and the official client for `$defs` schemas under
//! every tool choice and json_schema integers (tests/agent_libraries.py holds the checks). The
//! libraries come from PyPI into target/pyenv, pinned to the versions this was written against.
//! Without the GGUF or PyPI it fails under CI=true and skips (counted) elsewhere.

mod common;

use common::server::{run_client_script, Server};
use common::*;

const TEST: &str = "langchain_and_the_agents_sdk_get_parsed_schema_valid_answers_from_smollm2";

#[test]
fn langchain_and_the_agents_sdk_get_parsed_schema_valid_answers_from_smollm2() {
    let Some(gguf) = smollm2_gguf_or_skip(TEST) else { return };
    let packages = ["openai", "jsonschema", "pydantic", "langchain-openai==1.7.3", "openai-agents==0.24.0:agents"];
    let Some(python) = python_or_skip(TEST, &packages) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("smollm2");
    let conv = run_cli(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", model.to_str().unwrap()], &[]);
    assert!(conv.status.success(), "{}", stderr(&conv));
    let server = Server::start(&model, &["--api-key", "k3y"]);
    // The Agents SDK would send traces to OpenAI; the script turns tracing off, this too.
    let log = run_client_script(&python, "agent_libraries.py", &server, "k3y", "tiny", &[("OPENAI_AGENTS_DISABLE_TRACING", "1")]);
    eprintln!("{log}");
}
