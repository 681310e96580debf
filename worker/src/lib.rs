//! `ferry-worker`: what the prefill and decode daemons share.
//!
//! - [`Loaded::load`]: checks the shared flags, picks the transfer backend (`auto` falls back
//!   to tcp), loads the model, allocates the KV pool once and shares its memory with the
//!   transfer ([`HostPages::external`]), and derives the room timeouts and transfer settings;
//! - [`EngineLink`] / [`answer`]: how gRPC handlers reach a daemon's engine thread and turn
//!   its refusals into counted gRPC statuses.

use std::sync::{Arc, Mutex};

use ferry_cluster::daemon::StartError;
use ferry_cluster::{LayoutDescriptor, Refused, WorkerArgs};
use ferry_engine::{Model, PagePool};
use ferry_kernels::cpu::CpuBackend;
use ferry_transfer::BackendKind;
use ferry_transfer::backend::TransferConfig;
use ferry_transfer::memory::HostPages;
use ferry_transfer::room::Timeouts;
use ferry_transfer::tcp::TcpConfig;
use tokio::sync::oneshot;
use tonic::Status;

/// A model on a KV pool whose memory the transfer shares.
pub struct Loaded {
    /// The model.
    pub model: Model<CpuBackend>,
    /// Its KV pool.
    pub pool: PagePool<CpuBackend>,
    /// The pool's memory, as the transfer sees it.
    pub mem: Arc<HostPages>,
    /// Pages in the pool.
    pub pages: usize,
    /// What peers must match.
    pub layout: LayoutDescriptor,
    /// The transfer backend chosen.
    pub backend: BackendKind,
    /// Room timeouts.
    pub timeouts: Timeouts,
    /// Transfer settings.
    pub transfer: TransferConfig,
}

impl Loaded {
    /// Loads what `w` names (the model load runs off the async runtime).
    pub async fn load(w: &WorkerArgs) -> Result<Self, StartError> {
        w.check().map_err(StartError::Config)?;
        let requested: BackendKind = w.transfer.parse().map_err(StartError::config)?;
        let backend = ferry_transfer::backend::choose(requested, ferry_transfer::backend::rdma_usable())
            .map_err(StartError::config)?;
        let path = w.model.clone();
        let model = tokio::task::spawn_blocking(move || Model::load(&path, CpuBackend))
            .await
            .map_err(|e| StartError::Config(format!("model loader panicked: {e}")))?
            .map_err(|e| StartError::Model(e.to_string()))?;
        let kv = model.kv_layout(w.page_size);
        let page_bytes = kv.page_floats() * 4;
        let pages = w.pool_pages(page_bytes);
        let pool = PagePool::new(model.backend(), kv, pages).map_err(|e| StartError::Model(e.to_string()))?;
        let arena = Arc::clone(pool.storage());
        // SAFETY: the arena lives as long as `arena` (kept by the HostPages). Page ownership
        // keeps the engine and the transfer apart: a prefill room's pages stay locked until
        // its transfer ended; a decode room's pages are written only by the transfer until the
        // room completed, and a closed room's pages are reused only once no write is in flight.
        let mem = unsafe { HostPages::external(arena.base_ptr(), page_bytes, pages, arena.clone()) }
            .ok_or_else(|| StartError::Config("empty KV pool".into()))?;
        let c = model.config();
        let layout = LayoutDescriptor {
            model_fingerprint: model.fingerprint().to_string(),
            dtype: "f32".into(),
            num_layers: c.num_layers as u32,
            num_kv_heads: c.num_kv_heads as u32,
            head_dim: c.head_dim as u32,
            page_size: w.page_size as u32,
        };
        let (bootstrap, waiting, transferring) = w.timeouts();
        let timeouts = Timeouts { bootstrap, waiting, transferring };
        let transfer = TransferConfig {
            tcp: TcpConfig { connections: w.transfer_connections.max(1), timeouts, ..TcpConfig::default() },
            rdma: ferry_transfer::rdma::RdmaConfig { timeouts, ..Default::default() },
        };
        Ok(Self { model, pool, mem: Arc::new(mem), pages, layout, backend, timeouts, transfer })
    }
}

/// A handler's way to the engine thread.
pub struct EngineLink<C> {
    tx: Arc<Mutex<std::sync::mpsc::Sender<C>>>,
    role: &'static str,
}

impl<C> Clone for EngineLink<C> {
    fn clone(&self) -> Self {
        Self { tx: Arc::clone(&self.tx), role: self.role }
    }
}

impl<C> EngineLink<C> {
    /// A link over `tx` for a daemon of `role`.
    pub fn new(tx: std::sync::mpsc::Sender<C>, role: &'static str) -> Self {
        Self { tx: Arc::new(Mutex::new(tx)), role }
    }

    /// Sends a command; `UNAVAILABLE` once the engine has stopped.
    pub fn send(&self, c: C) -> Result<(), Status> {
        let tx = self.tx.lock().map_err(|_| Status::internal("engine channel poisoned"))?;
        tx.send(c).map_err(|_| Status::unavailable(format!("the {} engine has stopped", self.role)))
    }

    /// The daemon's role (a metrics label).
    pub fn role(&self) -> &'static str {
        self.role
    }
}

/// Awaits the engine's answer: its value, or its refusal as a counted status.
pub async fn answer<T>(rx: oneshot::Receiver<Result<T, Refused>>, role: &'static str) -> Result<T, Status> {
    match rx.await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(r)) => Err(r.status(role)),
        Err(_) => Err(Status::unavailable(format!("the {role} engine dropped the call (shutting down?)"))),
    }
}
