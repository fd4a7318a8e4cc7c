//! The `fsdp-app` binary: the command line lives in `cli/`, everything else in the library.

mod cli;

fn main() {
    cli::main();
}
