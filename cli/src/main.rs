//! `ferry`: the command line.
//!
//! - `ferry generate`: run the engine colocated on this machine and print the completion;
//! - `ferry model fetch NAME`: place a known model in the local cache and print its path;
//! - `ferry prefill`, `ferry decode`, `ferry router`: the daemons (see [`daemons`]).

mod daemons;
mod fetch;
mod generate;

use clap::{Parser, Subcommand};

/// Ferry: disaggregated prefill/decode LLM serving.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a completion with the engine on this machine (no cluster).
    Generate(generate::GenerateArgs),
    /// Run a prefill daemon (the same flags as `ferry-prefill`).
    Prefill(ferry_prefill::PrefillArgs),
    /// Run a decode daemon (the same flags as `ferry-decode`).
    Decode(ferry_decode::DecodeArgs),
    /// Run a router (the same flags as `ferry-router`).
    Router(ferry_router::RouterArgs),
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
        Command::Generate(args) => generate::run(args),
        Command::Model { command: ModelCommand::Fetch(args) } => fetch::run(args),
        Command::Prefill(args) => daemons::prefill(args),
        Command::Decode(args) => daemons::decode(args),
        Command::Router(args) => daemons::router(args),
    }
}
