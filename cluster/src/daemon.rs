//! What every daemon does the same way: bind its gRPC and `/metrics` listeners, register in
//! etcd when asked, serve until shutdown, and stop gracefully — leave etcd and report
//! NOT_SERVING (routers stop placing here), trigger shutdown, tell the engine thread to drain,
//! wait for it, give open calls a few seconds, then cut them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::args::Announce;
use crate::discovery::etcd::{Registration, register};
use crate::mtls::InternalTls;
use crate::shutdown::{Shutdown, ShutdownTrigger};

/// Why a daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A flag is wrong.
    #[error("{0}")]
    Config(String),
    /// The model did not load.
    #[error("loading the model: {0}")]
    Model(String),
    /// etcd could not be reached or refused the registration.
    #[error("etcd discovery: {0}")]
    Discovery(String),
    /// A socket or thread could not be set up.
    #[error("{what}: {source}")]
    Io {
        /// Which socket or thread.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

impl From<crate::args::FlagError> for StartError {
    fn from(e: crate::args::FlagError) -> Self {
        Self::Config(e.0)
    }
}

impl StartError {
    /// A configuration error from anything printable.
    pub fn config(e: impl std::fmt::Display) -> Self {
        Self::Config(e.to_string())
    }
}

/// Binds the gRPC listener first (so the worker id can name its port).
pub async fn bind_grpc(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let io = |source| StartError::Io { what: "gRPC address", source };
    let l = TcpListener::bind(addr).await.map_err(io)?;
    let a = l.local_addr().map_err(io)?;
    Ok((l, a))
}

/// A running daemon's common parts.
pub struct Daemon {
    /// gRPC address.
    pub grpc_addr: SocketAddr,
    /// `/metrics` address.
    pub metrics_addr: SocketAddr,
    /// Worker id.
    pub worker_id: ferry_core::WorkerId,
    trigger: ShutdownTrigger,
    drain: Box<dyn FnOnce() + Send>,
    engine: std::thread::JoinHandle<()>,
    stop_within: Duration,
    tasks: Vec<JoinHandle<()>>,
    health: tonic_health::server::HealthReporter,
    registration: Option<Registration>,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon").field("grpc_addr", &self.grpc_addr).field("worker_id", &self.worker_id).finish()
    }
}

/// What [`Daemon::serve`] needs.
pub struct Parts {
    /// The bound gRPC listener.
    pub listener: TcpListener,
    /// Its address.
    pub grpc_addr: SocketAddr,
    /// Where `/metrics` listens.
    pub metrics_addr: SocketAddr,
    /// Worker id.
    pub worker_id: ferry_core::WorkerId,
    /// The engine thread, which exits once drained.
    pub engine: std::thread::JoinHandle<()>,
    /// Tells the engine thread to drain (stop admitting, end what is in flight, free pages).
    pub drain: Box<dyn FnOnce() + Send>,
    /// The gRPC health service's reporter (set NOT_SERVING at stop).
    pub health: tonic_health::server::HealthReporter,
    /// Register in etcd once serving.
    pub announce: Option<Announce>,
    /// Mutual TLS on the gRPC listener (clients must present a certificate the CA signed).
    pub tls: Option<Arc<InternalTls>>,
    /// The daemon's role (a metrics label).
    pub role: &'static str,
    /// How long a graceful stop waits for the engine to drain before it gives up on it
    /// (logged): every wait inside the drain has its own bound, this one backs them all.
    pub stop_within: Duration,
}

impl Daemon {
    /// Serves `router` on the listener and `/metrics` until [`stop`](Self::stop).
    pub async fn serve(
        parts: Parts,
        router: tonic::transport::server::Router,
        trigger: ShutdownTrigger,
        shutdown: Shutdown,
    ) -> Result<Self, StartError> {
        let registration = match &parts.announce {
            None => None,
            Some(a) => match register(&a.etcd, &a.worker, a.ttl).await {
                Ok(r) => Some(r),
                Err(e) => {
                    trigger.trigger();
                    (parts.drain)();
                    let engine = parts.engine;
                    let _ = tokio::task::spawn_blocking(move || engine.join()).await;
                    return Err(StartError::Discovery(e.to_string()));
                }
            },
        };
        let (metrics_addr, metrics_task) = crate::exporter::serve(parts.metrics_addr, shutdown.clone())
            .await
            .map_err(|source| StartError::Io { what: "metrics address", source })?;
        let worker = parts.worker_id.clone();
        let listener = parts.listener;
        crate::mtls::warn_plaintext(parts.tls.as_ref());
        let grpc_task = match parts.tls {
            None => tokio::spawn(async move {
                let incoming = crate::accept::incoming(listener);
                if let Err(e) = router.serve_with_incoming_shutdown(incoming, shutdown.wait()).await {
                    tracing::error!(%worker, error = %e, "gRPC server failed");
                }
            }),
            Some(tls) => {
                let incoming = tls.incoming(listener, parts.role);
                tokio::spawn(async move {
                    if let Err(e) = router.serve_with_incoming_shutdown(incoming, shutdown.wait()).await {
                        tracing::error!(%worker, error = %e, "gRPC server (mutual TLS) failed");
                    }
                })
            }
        };
        Ok(Self {
            grpc_addr: parts.grpc_addr,
            metrics_addr,
            worker_id: parts.worker_id,
            trigger,
            drain: parts.drain,
            engine: parts.engine,
            stop_within: parts.stop_within,
            tasks: vec![grpc_task, metrics_task],
            health: parts.health,
            registration,
        })
    }

    /// Graceful stop: stop serving, drain the engine (it ends what is in flight and frees every
    /// page), wait for it (at most `stop_within`); open calls get 5 s to finish, then are cut.
    pub async fn stop(mut self) {
        self.health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        if let Some(r) = self.registration.take() {
            r.leave().await;
        }
        self.trigger.trigger();
        (self.drain)();
        // Joined on a thread of its own, not the runtime's blocking pool: an engine that does
        // not stop must not hold the runtime's shutdown (nor the process's exit) too.
        let engine = self.engine;
        let (done, joined) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let _ = engine.join();
            let _ = done.send(());
        });
        if tokio::time::timeout(self.stop_within, joined).await.is_err() {
            tracing::error!(worker = %self.worker_id, within = ?self.stop_within, "the engine did not drain in time; stopping without it");
        }
        for t in self.tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), t).await.is_err() {
                abort.abort();
            }
        }
    }
}

/// Serves until `shutdown` resolves, telling systemd (when it supervises) that the daemon is
/// ready and then stopping, and stops `running` with `stop`.
pub async fn serve_until<R, F>(running: R, shutdown: impl std::future::Future<Output = ()>, stop: impl FnOnce(R) -> F)
where
    F: std::future::Future<Output = ()>,
{
    crate::notify::notify("READY=1");
    shutdown.await;
    crate::notify::notify("STOPPING=1");
    stop(running).await;
}
