//! `ferry-decode`: see the library docs; every flag is documented in `--help`.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let args = ferry_decode::DecodeArgs::parse();
    ferry_decode::run(args, ferry_cluster::shutdown::signal()).await?;
    Ok(())
}
