//! `ferry prefill`, `ferry decode`, `ferry router`: the three daemons from one binary (the
//! same flags as `ferry-prefill`, `ferry-decode`, `ferry-router`); `ferry up --processes`
//! starts its daemons this way. Each serves until SIGINT or SIGTERM, then stops gracefully;
//! under systemd (`Type=notify`) each reports READY=1 once serving and STOPPING=1.

use std::future::Future;

/// The line a daemon started with `--ready-line` prints once it serves.
pub const READY: &str = "FERRY_READY";

/// `ferry prefill`.
#[derive(Debug, clap::Args)]
pub struct PrefillCmd {
    #[command(flatten)]
    args: ferry_prefill::PrefillArgs,
    /// Print `FERRY_READY grpc=ADDR metrics=ADDR` on stdout once serving (for supervisors
    /// such as `ferry up --processes`).
    #[arg(long)]
    ready_line: bool,
}

/// `ferry decode`.
#[derive(Debug, clap::Args)]
pub struct DecodeCmd {
    #[command(flatten)]
    args: ferry_decode::DecodeArgs,
    /// Print `FERRY_READY grpc=ADDR metrics=ADDR` on stdout once serving.
    #[arg(long)]
    ready_line: bool,
}

/// `ferry router`.
#[derive(Debug, clap::Args)]
pub struct RouterCmd {
    #[command(flatten)]
    args: ferry_router::RouterArgs,
    /// Print `FERRY_READY grpc=ADDR http=ADDR metrics=ADDR` on stdout once serving and every
    /// worker named by flags answers its health checks (or 60 s have passed).
    #[arg(long)]
    ready_line: bool,
}

fn serve<R, E, S, F>(
    service: &'static str,
    otlp: Option<String>,
    start: S,
    ready: impl AsyncFnOnce(&R) -> Option<String>,
    stop: impl FnOnce(R) -> F,
) -> anyhow::Result<()>
where
    E: std::error::Error + Send + Sync + 'static,
    S: Future<Output = Result<R, E>>,
    F: Future<Output = ()>,
{
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        // In the runtime: the OTLP exporter's client lives there.
        let _telemetry = ferry_cluster::telemetry::init(service, "info", otlp.as_deref())?;
        let running = start.await?;
        if let Some(line) = ready(&running).await {
            println!("{READY} {line}");
        }
        ferry_cluster::daemon::serve_until(running, ferry_cluster::shutdown::signal(), stop).await;
        Ok(())
    })
}

/// Runs `ferry prefill`.
pub fn prefill(c: PrefillCmd) -> anyhow::Result<()> {
    let config = c.args.check()?;
    let otlp = config.worker.args.telemetry.otlp_endpoint.clone();
    serve(
        "ferry-prefill",
        otlp,
        ferry_prefill::start_checked(config),
        async |r| c.ready_line.then(|| format!("grpc={} metrics={}", r.grpc_addr, r.metrics_addr)),
        |r| r.stop(),
    )
}

/// Runs `ferry decode`.
pub fn decode(c: DecodeCmd) -> anyhow::Result<()> {
    let config = c.args.check()?;
    let otlp = config.worker.args.telemetry.otlp_endpoint.clone();
    serve(
        "ferry-decode",
        otlp,
        ferry_decode::start_checked(config),
        async |r| c.ready_line.then(|| format!("grpc={} metrics={}", r.grpc_addr, r.metrics_addr)),
        |r| r.stop(),
    )
}

/// Runs `ferry router`.
pub fn router(c: RouterCmd) -> anyhow::Result<()> {
    let (np, nd) = (c.args.prefill.len(), c.args.decode.len());
    // With etcd, workers beyond those named join as they come: ready once a decode worker has.
    let discovered = !c.args.etcd.endpoints.is_empty();
    let config = c.args.check()?;
    let otlp = config.args.telemetry.otlp_endpoint.clone();
    serve(
        "ferry-router",
        otlp,
        ferry_router::start_checked(config),
        async |r| {
            if !c.ready_line {
                return None;
            }
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            let ready = |r: &ferry_router::Running| {
                if discovered { r.ready_at_least(np, nd.max(1)) } else { r.ready(np, nd) }
            };
            while !ready(r) && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Some(format!("grpc={} http={} metrics={}", r.grpc_addr, r.http_addr, r.metrics_addr))
        },
        |r| r.stop(),
    )
}
