//! The command line, one file per command. Each command's argument struct converts into the
//! library's settings; the library does the work.

mod estimate;
mod finetune;
mod generate;
mod launch;
mod model_files;
mod perplexity;
mod serve;

use anyhow::Result;
use clap::{Parser, Subcommand};
use fsdp_app::process::CpuWorkload;

use estimate::EstimateArgs;
use fsdp_app::train::finetune::FinetuneArgs;
use generate::GenerateArgs;
use launch::LaunchArgs;
use model_files::{ConvertArgs, FixtureArgs, MergeArgs};
use perplexity::PerplexityArgs;
use serve::ServeArgs;

#[derive(Parser)]
#[command(name = "fsdp-app", version, about = "Fine-tune and serve Hugging Face causal language models, on candle")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt with a model from a local directory or the Hugging Face Hub.
    Generate(GenerateArgs),
    /// The perplexity of a text file under a model (one window, as llama.cpp's
    /// `llama-perplexity` reports it), to compare formats and quantisations.
    Perplexity(PerplexityArgs),
    /// Convert a llama.cpp GGUF file into a Hugging Face model directory (safetensors, config,
    /// tokenizer, chat template).
    Convert(ConvertArgs),
    /// Full fine-tuning with FSDP-style sharding across ranks (`--world-size N` runs N ranks as
    /// threads of this process).
    Finetune(Box<FinetuneArgs>),
    /// Turn a sharded checkpoint into a Hugging Face model directory (one CPU process, memory
    /// about one tensor).
    Merge(MergeArgs),
    /// Start this node's ranks as processes with torchrun's variables, e.g.
    /// `fsdp-app launch --nproc-per-node 2 -- finetune --model M --data D --output-dir O`.
    Launch(LaunchArgs),
    /// Write a tiny random model directory (for tests and for trying fsdp-app offline).
    Fixture(FixtureArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (/v1/models, /v1/completions,
    /// /v1/chat/completions and /v1/responses with SSE streaming, fine-tuning jobs, /health,
    /// /metrics, /tokenize, /detokenize, /info).
    Serve(ServeArgs),
    /// Per-rank memory of a fine-tuning run (parameters, gradients, optimizer, gathered units,
    /// activations) from config.json alone, without reading weights.
    Estimate(EstimateArgs),
}

/// Parses the command line and runs the command; errors are printed in one line (a chain
/// without backtrace frames, see [`exit_with`]) with exit code 1.
pub fn main() {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Before any tensor work starts candle's threads. A server takes the shared setting: it
    // shares the cores between many requests, its fine-tuning jobs and other processes, where
    // idle threads that spin cost more than they save (with decoding's spin, a 2-core CI
    // machine running the server tests beside each other timed requests out).
    let workload = match cli.command {
        Command::Generate(_) | Command::Perplexity(_) => CpuWorkload::Decode,
        Command::Finetune(_) => fsdp_app::process::finetune_workload(),
        _ => CpuWorkload::Shared,
    };
    if let Err(e) = fsdp_app::process::init(workload, None) {
        exit_with(e);
    }
    let result: Result<()> = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Convert(a) => model_files::run_convert(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Finetune(a) => {
            let sub = matches.subcommand_matches("finetune").expect("the finetune subcommand's matches");
            // Which flags the command line set: they win over --config files.
            let given =
                |flag: &str| sub.try_get_raw(flag).is_ok() && sub.value_source(flag) == Some(clap::parser::ValueSource::CommandLine);
            finetune::run(*a, &given)
        }
        Command::Merge(a) => model_files::run_merge(a),
        Command::Launch(a) => launch::run(a),
        Command::Fixture(a) => model_files::run_fixture(a),
        Command::Estimate(a) => estimate::run(a),
        Command::Serve(a) => serve::run(a),
    };
    if let Err(e) = result {
        exit_with(e);
    }
}

/// An error is one line, its causes joined, whatever RUST_BACKTRACE says (many users set it for
/// every Rust program, and a stack trace under a wrong flag reads like a crash); a developer who
/// wants where it came from sets RUST_LIB_BACKTRACE=1 (anyhow's own variable).
fn exit_with(e: anyhow::Error) -> ! {
    if std::env::var("RUST_LIB_BACKTRACE").is_ok_and(|v| v != "0") {
        eprintln!("error: {e:?}");
    } else {
        eprintln!("error: {e:#}");
    }
    std::process::exit(1)
}
