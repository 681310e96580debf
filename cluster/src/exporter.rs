//! The Prometheus exporter: one recorder per process (daemons started in one process share
//! it, told apart by their `worker` label) and a `/metrics` HTTP endpoint per daemon.

use std::net::SocketAddr;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::shutdown::Shutdown;

/// Bucket bounds of every latency histogram (`*_seconds`): 1 ms to 2 min.
pub const LATENCY_BUCKETS: [f64; 16] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Bucket bounds of the decode batch size (requests per step).
pub const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// The recorder: histograms as Prometheus histograms with buckets (aggregatable across
/// daemons: `histogram_quantile` over `_bucket`), not per-process summaries.
fn recorder() -> metrics_exporter_prometheus::PrometheusRecorder {
    let b = PrometheusBuilder::new();
    let b = b
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(crate::metrics::DECODE_BATCH.into()), &BATCH_BUCKETS));
    match b {
        Ok(b) => b.build_recorder(),
        // Only for empty bucket lists, which these are not.
        Err(_) => PrometheusBuilder::new().build_recorder(),
    }
}

/// The process's recorder, installed on first use. None when another recorder was installed
/// first (metrics then go there and `/metrics` serves an empty page).
pub fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = recorder();
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => {
                    crate::metrics::describe();
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a metrics recorder was already installed; /metrics stays empty");
                    None
                }
            }
        })
        .as_ref()
}

/// Serves `/metrics` on `addr` until `shutdown`; returns the bound address.
pub async fn serve(addr: SocketAddr, shutdown: Shutdown) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let h = handle();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || async move { h.map(PrometheusHandle::render).unwrap_or_default() }),
    );
    let task = tokio::spawn(async move {
        let stop = async move { shutdown.wait().await };
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(stop).await {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok((bound, task))
}
