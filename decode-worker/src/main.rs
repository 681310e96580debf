//! `ferry-decode`: see the library docs; every flag is documented in `--help`.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = ferry_decode::DecodeArgs::parse();
    // RUST_LOG picks what is logged; by default, info (which prints the bound addresses).
    let telemetry =
        ferry_cluster::telemetry::init("ferry-decode", "info", args.worker.telemetry.otlp_endpoint.as_deref())?;
    ferry_decode::run(args.check()?, ferry_cluster::shutdown::signal()).await?;
    drop(telemetry);
    Ok(())
}
