//! `fsdp-app serve`: an OpenAI-compatible HTTP API over one base model and the models fine-tuned
//! from it, plus OpenAI's files and fine-tuning jobs APIs and the web pages.
//!
//! A generation request goes one way through these modules (TGI's router split):
//! `router` (auth) -> `routes` -> `body` (JSON) -> `validate` (one pass into a
//! [`validate::ValidatedRequest`]) -> `admission` (bounded queue, submit to the model's `engine`
//! thread) -> `response` (JSON or SSE). `state` holds the served models (`served_model`) and
//! the settings every route reads; `server` starts it all; `listen` is the accept loop with its
//! timeouts and `shutdown` the drain on SIGTERM. Fine-tuning: `files`, `jobs` (API and runner),
//! `store` (SQLite), `checkpoints` (a job's checkpoints, served), `process` (their process
//! groups). `fields` says which request fields each endpoint takes, `tools` is function calling
//! (`tool_format` the models' own call formats, `call_stream` a call's JSON as it streams),
//! `error` OpenAI's error shape (and Anthropic's, for `/v1/messages`); `llama_cpp` is
//! llama.cpp's server's own routes (`/completion`, `/props`). `embeddings` is
//! `/v1/embeddings`, whose texts the engine embeds between decode steps; `scores` is
//! `/v1/score` and `/v1/rerank` over those embeddings.

mod adapters;
mod admission;
mod body;
mod call_stream;
pub mod checkpoints;
mod clock;
pub mod embeddings;
pub mod engine;
pub mod error;
pub mod fields;
pub mod files;
pub mod ids;
pub mod jobs;
pub mod listen;
mod llama_cpp;
pub mod metrics;
mod ollama;
pub mod openapi;
mod process;
mod response;
mod router;
mod routes;
pub mod scores;
pub mod served_model;
mod server;
pub mod shutdown;
pub mod state;
pub mod store;
pub mod tool_format;
pub mod tools;
pub mod validate;
pub mod web;

pub use served_model::Task;
pub use server::{run, ServeConfig};
