//! `ferry`: the command line.
//!
//! - `ferry generate`: run the engine colocated on this machine and print the completion;
//! - `ferry model fetch NAME`: place a known model in the local cache and print its path;
//! - `ferry up`: a whole cluster on this machine (see [`up`]);
//! - `ferry bench`: a load generator against a router (see [`bench`]);
//! - `ferry prefill`, `ferry decode`, `ferry router`: the daemons (see [`daemons`]).

mod bench;
mod daemons;
mod fetch;
mod generate;
mod health;
mod procs;
#[cfg(test)]
mod reference;
mod up;

use clap::{Parser, Subcommand};

/// jemalloc, as `ferry-router`'s: the routers of `ferry up` and `ferry router` allocate a
/// prompt's size per request, and the engines keep their passes' buffers from faulting in
/// again under it (docs/performance.md, "The engine under jemalloc").
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// How a typed choice is spelled on the command line (`cache-aware`, `shared-prefix`): for
/// passing it on to a child process and for reports.
fn flag_name<T: clap::ValueEnum>(v: &T) -> String {
    v.to_possible_value().map(|p| p.get_name().to_string()).unwrap_or_default()
}

/// Ferry: disaggregated prefill/decode LLM serving.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a whole cluster on this machine (router, prefill and decode daemons) and serve
    /// until Ctrl-C. It logs warnings, and the router's workers joining, leaving and coming
    /// back into placement (`RUST_LOG` overrides).
    Up(up::UpArgs),
    /// Load a router with a workload and report latency, throughput and goodput.
    Bench(Box<bench::BenchArgs>),
    /// Generate a completion with the engine on this machine (no cluster).
    Generate(generate::GenerateArgs),
    /// Run a prefill daemon (the same flags as `ferry-prefill`).
    Prefill(daemons::PrefillCmd),
    /// Run a decode daemon (the same flags as `ferry-decode`).
    Decode(daemons::DecodeCmd),
    /// Run a router (the same flags as `ferry-router`).
    Router(daemons::RouterCmd),
    /// Ask a daemon's gRPC health service whether it serves (exit 0 when SERVING), over
    /// mutual TLS when given certificates: the exec probe of pods whose daemons use it.
    Health(health::HealthArgs),
    /// Manage cached models.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Place a known model in the cache (reusing it when present) and print its path.
    Fetch(fetch::FetchArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Up(args) => up::run(args),
        Command::Bench(args) => bench::run(*args),
        Command::Generate(args) => generate::run(args),
        Command::Model { command: ModelCommand::Fetch(args) } => fetch::run(args),
        Command::Prefill(args) => daemons::prefill(args),
        Command::Decode(args) => daemons::decode(args),
        Command::Router(args) => daemons::router(args),
        Command::Health(args) => health::run(args),
    }
}
