//! Fine-tuning jobs: the typed job (`spec`), OpenAI's HTTP API for them (`api`), and the
//! runner that executes them as child processes (`runner`).

pub mod api;
pub mod runner;
pub mod spec;

pub use runner::{recover, start_runner, Wakeup};
