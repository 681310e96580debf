//! `ferry-prefill`: the prefill daemon (DESIGN.md §2–§3).
//!
//! - [`rooms`]: the bootstrap → waiting → inflight queue, a pure state machine with a timeout
//!   in every state; either the request or the decode node's handshake may come first;
//! - [`engine`]: the thread that owns the model, page pool, prefix cache and scheduler; it
//!   computes prompts in chunks and hands each chunk's finished pages to the room's transfer
//!   task right after the chunk (cached prefix pages first; the first sampled token with the
//!   last chunk);
//! - [`service`]: gRPC `Prefill`, `Bootstrap`, `KvEvents`, `Load`, plus gRPC health.
//!
//! [`start`] brings a daemon up (port 0 works: tests and `ferry up` run several in one
//! process); [`run`] is `start`, wait, then a graceful stop.

mod engine;
pub mod rooms;
mod service;

pub use engine::{Load, PrefillDone};

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use ferry_cluster::{LayoutDescriptor, Shutdown, ShutdownTrigger, WorkerArgs};
use ferry_engine::scheduler::{Policy, Scheduler, SchedulerConfig};
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
use crate::service::{BootstrapSvc, KvEventsSvc, LoadSvc, PrefillSvc, SenderPool, Shared};

/// The prefill daemon's flags.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "ferry-prefill", version, about = "Ferry prefill daemon")]
pub struct PrefillArgs {
    /// Flags every worker shares.
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Order of waiting requests: `lpm` (longest cached prefix first), `dfs-weight` or `fcfs`.
    #[arg(long, env = "FERRY_SCHEDULE_POLICY", default_value = "lpm")]
    pub schedule_policy: String,
    /// A request sharing at least this many uncached tokens with a prompt being computed
    /// waits for it (the in-queue prefix check); 0 disables the check.
    #[arg(long, env = "FERRY_IN_QUEUE_THRESHOLD", default_value_t = 32)]
    pub in_queue_threshold: usize,
    /// Longest destination page list one handshake may carry.
    #[arg(long, env = "FERRY_MAX_DEST_PAGES", default_value_t = 1 << 16)]
    pub max_dest_pages: usize,
}

impl PrefillArgs {
    /// Defaults for `model`.
    pub fn for_model(model: impl Into<std::path::PathBuf>) -> Self {
        Self {
            worker: WorkerArgs::for_model(model),
            schedule_policy: "lpm".into(),
            in_queue_threshold: 32,
            max_dest_pages: 1 << 16,
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

/// A running prefill daemon.
pub struct Running {
    /// gRPC address.
    pub grpc_addr: SocketAddr,
    /// `/metrics` address.
    pub metrics_addr: SocketAddr,
    /// Worker id.
    pub worker_id: String,
    /// The KV layout it sends.
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

    /// Graceful stop: stop serving, abort rooms in flight (telling decode nodes), free every
    /// page, wait for the engine thread.
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

/// Loads the model, allocates the pool, and starts serving.
pub async fn start(args: PrefillArgs) -> Result<Running, StartError> {
    let w = &args.worker;
    w.check().map_err(StartError::Config)?;
    let policy: Policy = args.schedule_policy.parse().map_err(bad)?;
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
    // SAFETY: the arena lives as long as `arena` (kept by the HostPages); the engine and the
    // room tasks follow page ownership (a room's pages stay locked until its task reports).
    let mem = unsafe { HostPages::external(arena.base_ptr(), page_bytes, pages, arena.clone()) }
        .ok_or_else(|| StartError::Config("empty KV pool".into()))?;
    let mem = Arc::new(mem);
    let descriptor = layout_of(&model, w.page_size);

    let listener =
        TcpListener::bind(w.grpc_addr).await.map_err(|source| StartError::Io { what: "gRPC address", source })?;
    let grpc_addr = listener.local_addr().map_err(|source| StartError::Io { what: "gRPC address", source })?;
    let worker_id = w.worker_id.clone().unwrap_or_else(|| format!("prefill-{}", grpc_addr.port()));
    let (t_boot, t_wait, t_xfer) = w.timeouts();
    let timeouts = Timeouts { bootstrap: t_boot, waiting: t_wait, transferring: t_xfer };
    let transfer = TransferConfig {
        tcp: TcpConfig { connections: w.transfer_connections.max(1), timeouts, ..TcpConfig::default() },
        rdma: ferry_transfer::rdma::RdmaConfig { timeouts, ..Default::default() },
    };

    let (events, _) = tokio::sync::broadcast::channel(1024);
    let load = Arc::new(Mutex::new(Load::default()));
    let senders = Arc::new(SenderPool::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let sched_cfg =
        SchedulerConfig { policy, chunk_size: w.chunked_prefill_size, in_queue_threshold: args.in_queue_threshold };
    let engine = Engine::new(
        model,
        pool,
        Scheduler::new(sched_cfg, w.page_size),
        Arc::clone(&mem),
        tokio::runtime::Handle::current(),
        tx.clone(),
        EngineConfig { worker: worker_id.clone(), timeouts, senders: Arc::clone(&senders) },
        events.clone(),
        Arc::clone(&load),
    );
    let engine_thread = std::thread::Builder::new()
        .name(format!("{worker_id}-engine"))
        .spawn(move || engine.run(rx))
        .map_err(|source| StartError::Io { what: "engine thread", source })?;

    let engine_tx = Arc::new(Mutex::new(tx));
    let (trigger, shutdown) = Shutdown::new();
    let shared = Arc::new(Shared {
        engine: Mutex::new(engine_tx.lock().map_err(|_| bad("poisoned"))?.clone()),
        worker: worker_id.clone(),
        layout: descriptor.clone(),
        backend,
        transfer,
        mem,
        senders,
        max_dest_pages: args.max_dest_pages,
        events,
        load: Arc::clone(&load),
        shutdown: shutdown.clone(),
    });
    let (metrics_addr, metrics_task) = ferry_cluster::exporter::serve(w.metrics_addr, shutdown.clone())
        .await
        .map_err(|source| StartError::Io { what: "metrics address", source })?;
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<pb::prefill_server::PrefillServer<PrefillSvc>>().await;
    health.set_serving::<pb::bootstrap_server::BootstrapServer<BootstrapSvc>>().await;
    let server = tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(pb::prefill_server::PrefillServer::new(PrefillSvc(Arc::clone(&shared))))
        .add_service(pb::bootstrap_server::BootstrapServer::new(BootstrapSvc(Arc::clone(&shared))))
        .add_service(pb::kv_events_server::KvEventsServer::new(KvEventsSvc(Arc::clone(&shared))))
        .add_service(pb::load_server::LoadServer::new(LoadSvc(Arc::clone(&shared))));
    let stop = shutdown.clone();
    let grpc_task = tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        if let Err(e) = server.serve_with_incoming_shutdown(incoming, stop.wait()).await {
            tracing::error!(error = %e, "prefill gRPC server failed");
        }
    });
    tracing::info!(%grpc_addr, %metrics_addr, worker = %worker_id, backend = %backend, pages, "prefill worker up");
    Ok(Running {
        grpc_addr,
        metrics_addr,
        worker_id,
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
pub async fn run(args: PrefillArgs, shutdown: impl std::future::Future<Output = ()>) -> Result<(), StartError> {
    let r = start(args).await?;
    shutdown.await;
    r.stop().await;
    Ok(())
}
