//! The Prometheus exporter: one recorder per process (daemons started in one process share
//! it, told apart by their `worker` label) and a `/metrics` HTTP endpoint per daemon.

use std::net::SocketAddr;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::shutdown::Shutdown;

/// The process's recorder, installed on first use. None when another recorder was installed
/// first (metrics then go there and `/metrics` serves an empty page).
pub fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
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
