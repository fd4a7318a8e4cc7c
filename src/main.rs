//! The `fsdp-app` binary: the command line lives in `cli/`, everything else in the library. The
//! process is the binary's: it declares the allocator here, and `cli::main` makes the one
//! whole-process call (`fsdp_app::process::init`) before any work starts.

mod cli;

#[global_allocator]
static ALLOCATOR: fsdp_app::process::Allocator = fsdp_app::process::Allocator;

fn main() {
    cli::main();
}
