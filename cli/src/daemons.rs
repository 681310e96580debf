//! `ferry prefill`, `ferry decode`, `ferry router`: the three daemons from one binary (the
//! same as `ferry-prefill`, `ferry-decode`, `ferry-router`); `ferry up --processes` starts
//! its daemons this way. Each serves until SIGINT or SIGTERM, then stops gracefully.

use std::future::Future;

/// Logs at info unless RUST_LOG says otherwise.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();
}

/// Runs `serve` on a fresh multi-threaded runtime.
pub fn block_on<E: std::error::Error + Send + Sync + 'static>(
    serve: impl Future<Output = Result<(), E>>,
) -> anyhow::Result<()> {
    init_logging();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(serve)?;
    Ok(())
}

/// `ferry prefill`.
pub fn prefill(args: ferry_prefill::PrefillArgs) -> anyhow::Result<()> {
    block_on(async { ferry_prefill::run(args, ferry_cluster::shutdown::signal()).await })
}

/// `ferry decode`.
pub fn decode(args: ferry_decode::DecodeArgs) -> anyhow::Result<()> {
    block_on(async { ferry_decode::run(args, ferry_cluster::shutdown::signal()).await })
}

/// `ferry router`.
pub fn router(args: ferry_router::RouterArgs) -> anyhow::Result<()> {
    block_on(async { ferry_router::run(args, ferry_cluster::shutdown::signal()).await })
}
