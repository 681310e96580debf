//! `ferry-decode`: the decode daemon (DESIGN.md §2–§3).
//!
//! - [`queues`]: prealloc → transfer (or local prefill) → waiting → running, a pure state
//!   machine; admission reserves pages for the prompt and a decode reservation on top of every
//!   reservation already promised, so no running request is ever pushed out;
//! - the engine thread owns the model and the page pool: it preallocates a room's pages,
//!   opens the room on the transfer receiver (which writes arriving pages straight into them),
//!   starts the handshake with the prefill node, and decodes with continuous batching; a
//!   request whose `prefill_bootstrap_addr` is empty is prefilled here (colocated mode);
//! - gRPC `Decode` (Generate stream, Abort), `Load`, and gRPC health.
//!
//! [`start`] brings a daemon up (port 0 works); [`run`] is `start`, wait, graceful stop.

mod engine;
mod handshake;
pub mod queues;
mod service;

pub use engine::Load;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_cluster::{LayoutDescriptor, Shutdown, ShutdownTrigger, WorkerArgs};
use ferry_engine::{Model, PagePool};
use ferry_kernels::cpu::CpuBackend;
use ferry_proto::v1 as pb;
use ferry_transfer::BackendKind;
use ferry_transfer::backend::TransferConfig;
use ferry_transfer::memory::HostPages;
use ferry_transfer::room::Timeouts;
use ferry_transfer::tcp::TcpConfig;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::engine::{Cmd, Engine, EngineConfig};
use crate::handshake::Handshakes;
use crate::queues::Limits;
use crate::service::{DecodeSvc, LoadSvc, Shared};

/// The decode daemon's flags.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "ferry-decode", version, about = "Ferry decode daemon")]
pub struct DecodeArgs {
    /// Flags every worker shares.
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Most requests admitted at once (transferring, prefilling, waiting and running).
    #[arg(long, env = "FERRY_MAX_RUNNING_REQUESTS", default_value_t = 64)]
    pub max_running_requests: usize,
    /// Decode tokens reserved per request at admission (capped by its max_new_tokens), so a
    /// running request always has pages to grow into.
    #[arg(long, env = "FERRY_NUM_RESERVED_DECODE_TOKENS", default_value_t = 256)]
    pub num_reserved_decode_tokens: usize,
    /// Seconds a request may wait for free pages before it is refused.
    #[arg(long, env = "FERRY_PREALLOC_TIMEOUT", default_value_t = 60.0)]
    pub prealloc_timeout: f64,
}

impl DecodeArgs {
    /// Defaults for `model`.
    pub fn for_model(model: impl Into<std::path::PathBuf>) -> Self {
        Self {
            worker: WorkerArgs::for_model(model),
            max_running_requests: 64,
            num_reserved_decode_tokens: 256,
            prealloc_timeout: 60.0,
        }
    }
}

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A flag is wrong.
    #[error("{0}")]
    Config(String),
    /// The model did not load.
    #[error("loading the model: {0}")]
    Model(#[from] ferry_engine::EngineError),
    /// A socket could not be bound.
    #[error("{what}: {source}")]
    Io {
        /// Which socket.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

/// A running decode daemon.
pub struct Running {
    /// gRPC address.
    pub grpc_addr: SocketAddr,
    /// `/metrics` address.
    pub metrics_addr: SocketAddr,
    /// Worker id.
    pub worker_id: String,
    /// Where prefill nodes send this node's KV pages.
    pub data_endpoint: String,
    /// The KV layout it receives.
    pub layout: LayoutDescriptor,
    /// The transfer backend in use.
    pub backend: BackendKind,
    trigger: ShutdownTrigger,
    engine: Arc<Mutex<std::sync::mpsc::Sender<Cmd>>>,
    engine_thread: std::thread::JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
    load: Arc<Mutex<Load>>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").field("grpc_addr", &self.grpc_addr).field("worker_id", &self.worker_id).finish()
    }
}

impl Running {
    /// The latest load figures (queue depths, pages).
    pub fn load(&self) -> Load {
        self.load.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Graceful stop: stop serving, end every request (closing its room), free every page,
    /// wait for the engine thread.
    pub async fn stop(self) {
        self.trigger.trigger();
        if let Ok(tx) = self.engine.lock() {
            let _ = tx.send(Cmd::Shutdown);
        }
        let t = self.engine_thread;
        let _ = tokio::task::spawn_blocking(move || t.join()).await;
        for t in self.tasks {
            // Servers finish their open calls first; a call that will not end is cut.
            let abort = t.abort_handle();
            if tokio::time::timeout(std::time::Duration::from_secs(5), t).await.is_err() {
                abort.abort();
            }
        }
    }
}

fn bad(e: impl std::fmt::Display) -> StartError {
    StartError::Config(e.to_string())
}

/// The KV layout descriptor of `model`'s pages at `page_size`.
pub fn layout_of(model: &Model<CpuBackend>, page_size: usize) -> LayoutDescriptor {
    let c = model.config();
    LayoutDescriptor {
        model_fingerprint: model.fingerprint().to_string(),
        dtype: "f32".into(),
        num_layers: c.num_layers as u32,
        num_kv_heads: c.num_kv_heads as u32,
        head_dim: c.head_dim as u32,
        page_size: page_size as u32,
    }
}

/// Loads the model, allocates the pool, binds the transfer receiver and starts serving.
pub async fn start(args: DecodeArgs) -> Result<Running, StartError> {
    let w = &args.worker;
    w.check().map_err(StartError::Config)?;
    let requested: BackendKind = w.transfer.parse().map_err(bad)?;
    let backend = ferry_transfer::backend::choose(requested, ferry_transfer::backend::rdma_usable()).map_err(bad)?;
    let path = w.model.clone();
    let model = tokio::task::spawn_blocking(move || Model::load(&path, CpuBackend))
        .await
        .map_err(|e| StartError::Config(format!("model loader panicked: {e}")))??;
    let layout = model.kv_layout(w.page_size);
    let page_bytes = layout.page_floats() * 4;
    let pages = w.pool_pages(page_bytes);
    let pool = PagePool::new(model.backend(), layout, pages)?;
    let arena = Arc::clone(pool.storage());
    // SAFETY: the arena lives as long as `arena` (kept by the HostPages); the receiver writes
    // only into pages preallocated for an open room, which no forward pass touches until the
    // room completed, and a closed room's pages are reused only once no write is in flight.
    let mem = unsafe { HostPages::external(arena.base_ptr(), page_bytes, pages, arena.clone()) }
        .ok_or_else(|| StartError::Config("empty KV pool".into()))?;
    let mem = Arc::new(mem);
    let descriptor = layout_of(&model, w.page_size);
    let (t_boot, t_wait, t_xfer) = w.timeouts();
    let timeouts = Timeouts { bootstrap: t_boot, waiting: t_wait, transferring: t_xfer };
    let transfer = TransferConfig {
        tcp: TcpConfig { connections: w.transfer_connections.max(1), timeouts, ..TcpConfig::default() },
        rdma: ferry_transfer::rdma::RdmaConfig { timeouts, ..Default::default() },
    };
    let (receiver, data_endpoint) = ferry_transfer::backend::bind(backend, w.transfer_addr, mem, transfer)
        .await
        .map_err(|source| StartError::Io { what: "transfer address", source })?;
    let receiver = Arc::new(receiver);

    let listener =
        TcpListener::bind(w.grpc_addr).await.map_err(|source| StartError::Io { what: "gRPC address", source })?;
    let grpc_addr = listener.local_addr().map_err(|source| StartError::Io { what: "gRPC address", source })?;
    let worker_id = w.worker_id.clone().unwrap_or_else(|| format!("decode-{}", grpc_addr.port()));
    let load = Arc::new(Mutex::new(Load::default()));
    let (tx, rx) = std::sync::mpsc::channel();
    let engine_tx = Arc::new(Mutex::new(tx));
    let handshakes = Handshakes::new(tokio::runtime::Handle::current(), Arc::clone(&engine_tx), t_boot);
    let limits = Limits {
        max_running: args.max_running_requests.max(1),
        prealloc_timeout: Duration::from_secs_f64(args.prealloc_timeout.max(0.001)),
        waiting_timeout: t_wait,
    };
    let cfg = EngineConfig {
        worker: worker_id.clone(),
        limits,
        reserved_decode_tokens: args.num_reserved_decode_tokens,
        chunk_size: w.chunked_prefill_size,
        layout: descriptor.clone(),
        data_endpoint: data_endpoint.clone(),
        backend: backend.as_str(),
    };
    let engine = Engine::new(model, pool, receiver, handshakes, cfg, Arc::clone(&load));
    let engine_thread = std::thread::Builder::new()
        .name(format!("{worker_id}-engine"))
        .spawn(move || engine.run(rx))
        .map_err(|source| StartError::Io { what: "engine thread", source })?;

    let shared =
        Arc::new(Shared { engine: Arc::clone(&engine_tx), worker: worker_id.clone(), load: Arc::clone(&load) });
    let (trigger, shutdown) = Shutdown::new();
    let (metrics_addr, metrics_task) = ferry_cluster::exporter::serve(w.metrics_addr, shutdown.clone())
        .await
        .map_err(|source| StartError::Io { what: "metrics address", source })?;
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<pb::decode_server::DecodeServer<DecodeSvc>>().await;
    let server = tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(pb::decode_server::DecodeServer::new(DecodeSvc(Arc::clone(&shared))))
        .add_service(pb::load_server::LoadServer::new(LoadSvc(Arc::clone(&shared))));
    let stop = shutdown.clone();
    let grpc_task = tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        if let Err(e) = server.serve_with_incoming_shutdown(incoming, stop.wait()).await {
            tracing::error!(error = %e, "decode gRPC server failed");
        }
    });
    tracing::info!(%grpc_addr, %metrics_addr, %data_endpoint, worker = %worker_id, backend = %backend, pages, "decode worker up");
    Ok(Running {
        grpc_addr,
        metrics_addr,
        worker_id,
        data_endpoint,
        layout: descriptor,
        backend,
        trigger,
        engine: engine_tx,
        engine_thread,
        tasks: vec![grpc_task, metrics_task],
        load,
    })
}

/// Runs the daemon until `shutdown` resolves, then stops it gracefully.
pub async fn run(args: DecodeArgs, shutdown: impl std::future::Future<Output = ()>) -> Result<(), StartError> {
    let r = start(args).await?;
    shutdown.await;
    r.stop().await;
    Ok(())
}
