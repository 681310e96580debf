//! A worker daemon once serving ([`Running`]) and the last step of both daemons' start
//! ([`serve`]): the engine thread, the etcd registration, `/metrics`, the gRPC services and,
//! later, the graceful stop.

use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::WorkerConfig;
use ferry_cluster::daemon::{Daemon, Parts, StartError};
use ferry_cluster::discovery::Role;
use ferry_cluster::{LayoutDescriptor, Shutdown, ShutdownTrigger, WorkerId};
use ferry_transfer::BackendKind;
use tokio::net::TcpListener;

/// A worker daemon serving; `L` is what its Load service reports.
pub struct Running<L> {
    /// gRPC address.
    pub grpc_addr: SocketAddr,
    /// `/metrics` address.
    pub metrics_addr: SocketAddr,
    /// Worker id.
    pub worker_id: WorkerId,
    /// The KV layout it sends or receives.
    pub layout: LayoutDescriptor,
    /// The transfer backend in use.
    pub backend: BackendKind,
    /// Whether KV pages travel through a host mirror of the pool (a GPU pool, or
    /// `--kv-host-mirror`).
    pub kv_mirrored: bool,
    daemon: Daemon,
    load: Arc<Mutex<L>>,
}

impl<L> std::fmt::Debug for Running<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").field("grpc_addr", &self.grpc_addr).field("worker_id", &self.worker_id).finish()
    }
}

impl<L: Clone + Default> Running<L> {
    /// The latest load figures (queue depths, pages).
    pub fn load(&self) -> L {
        self.load.lock().clone()
    }

    /// Graceful stop: stop serving, drain the engine (every request ends with a reason, its
    /// rooms closed or aborted, every page freed), wait for the engine thread (at most
    /// 2 × `--transfer-timeout` + 5 s).
    pub async fn stop(self) {
        self.daemon.stop().await;
    }
}

/// What [`serve`] takes from a daemon's start: its engine, its services and what it reports.
pub struct Serve<L> {
    /// Prefill or decode.
    pub role: Role,
    /// The bound gRPC listener.
    pub listener: TcpListener,
    /// Its address.
    pub grpc_addr: SocketAddr,
    /// Worker id.
    pub worker_id: WorkerId,
    /// The engine thread's body (its loop); started here, on a thread named after the worker.
    pub engine: Box<dyn FnOnce() + Send>,
    /// Tells the engine to drain.
    pub drain: Box<dyn FnOnce() + Send>,
    /// How long its running requests may go on once told (a decode worker's
    /// `--drain-grace`; prefill: 0): the stop waits that much longer for the engine.
    pub drain_grace: std::time::Duration,
    /// The gRPC health reporter (NOT_SERVING at stop).
    pub health: tonic_health::server::HealthReporter,
    /// The gRPC services.
    pub services: tonic::transport::server::Router,
    /// The stop's trigger and signal (the services' streams watch it).
    pub stop: (ShutdownTrigger, Shutdown),
    /// The KV layout.
    pub layout: LayoutDescriptor,
    /// The transfer backend.
    pub backend: BackendKind,
    /// Whether pages travel through a host mirror.
    pub kv_mirrored: bool,
    /// The load figures the engine publishes.
    pub load: Arc<Mutex<L>>,
}

/// Starts the engine thread, registers in etcd (with `--etcd`), serves `/metrics` and the
/// gRPC services (under mutual TLS unless `--insecure-internal`).
pub async fn serve<L>(config: &WorkerConfig, s: Serve<L>) -> Result<Running<L>, StartError> {
    let w = &config.args;
    // Before the engine thread starts: a bad announcement must not leave it running.
    let announce = config.announce(s.role, &s.worker_id, s.grpc_addr)?;
    let engine = s.engine;
    let engine = std::thread::Builder::new()
        .name(format!("{}-engine", s.worker_id))
        .spawn(engine)
        .map_err(|source| StartError::Io { what: "engine thread", source })?;
    let parts = Parts {
        listener: s.listener,
        grpc_addr: s.grpc_addr,
        metrics_addr: w.metrics_addr,
        worker_id: s.worker_id.clone(),
        engine,
        drain: s.drain,
        health: s.health,
        announce,
        tls: config.internal_tls.clone(),
        role: s.role.as_str(),
        // A stalled read or send ends after the transfer timeout, the abort after it too.
        stop_within: s.drain_grace + std::time::Duration::from_secs_f64(2.0 * w.transfer_timeout + 5.0),
    };
    let (trigger, shutdown) = s.stop;
    let daemon = Daemon::serve(parts, s.services, trigger, shutdown).await?;
    Ok(Running {
        grpc_addr: s.grpc_addr,
        metrics_addr: daemon.metrics_addr,
        worker_id: s.worker_id,
        layout: s.layout,
        backend: s.backend,
        kv_mirrored: s.kv_mirrored,
        daemon,
        load: s.load,
    })
}
