//! `ferry-router`: see the library docs; every flag is documented in `--help`.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // RUST_LOG picks what is logged; by default, info (which prints the bound addresses).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let args = ferry_router::RouterArgs::parse();
    ferry_router::run(args, ferry_cluster::shutdown::signal()).await?;
    Ok(())
}
