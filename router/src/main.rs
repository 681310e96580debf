//! `ferry-router`: see the library docs; every flag is documented in `--help`.

use clap::Parser;

/// jemalloc, not glibc's malloc: per request the router allocates and frees buffers of a
/// prompt's size (bodies, ids, gRPC messages); measured in docs/performance.md ("W3, fifth
/// pass: jemalloc").
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = ferry_router::RouterArgs::parse();
    // RUST_LOG picks what is logged; by default, info (which prints the bound addresses).
    let telemetry = ferry_cluster::telemetry::init("ferry-router", "info", args.telemetry.otlp_endpoint.as_deref())?;
    ferry_router::run(args.check()?, ferry_cluster::shutdown::signal()).await?;
    drop(telemetry);
    Ok(())
}
