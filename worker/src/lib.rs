//! `ferry-worker`: what the prefill and decode daemons share.
//!
//! - [`WorkerArgs`] / [`WorkerConfig`]: the flags both take, checked before anything starts
//!   ([`Device`]: `--device`); [`data_plane`]: the KV data plane under their mutual TLS;
//! - [`Loaded::load`]: from the checked flags (`WorkerConfig`), picks the transfer backend
//!   (`auto` falls back to tcp), loads the model onto a compute backend, allocates the KV pool
//!   once and gives the transfer its pages ([`KvHost`]: the pool itself on the CPU, a pinned
//!   host mirror on a GPU), and derives the transfer settings;
//! - [`EngineLink`] / [`answer`]: how gRPC handlers reach a daemon's engine thread and turn
//!   its refusals into counted gRPC statuses;
//! - [`engine_loop`]: the engine thread's loop (block until a command or a deadline, one turn,
//!   exit once stopped and empty);
//! - [`serve`] / [`Running`]: the last step of a start (engine thread, etcd, `/metrics`, gRPC)
//!   and the daemon it gives, with its load figures and its graceful stop;
//! - [`kv_events`]: `KvEvents`, a prefix cache's snapshot and events, which both daemons serve;
//! - [`senders`]: data-plane senders by endpoint, connected once and reused.

pub mod args;
pub mod data_plane;
mod device;
pub mod engine_loop;
pub mod kv_events;
mod kv_host;
mod running;
pub mod senders;

pub use args::{Dtype, WorkerArgs, WorkerConfig};
pub use device::{Device, NO_CUDA_BUILD};
pub use kv_host::KvHost;
pub use running::{Running, Serve, serve};

use std::sync::Arc;

use ferry_cluster::daemon::StartError;
use ferry_cluster::{LayoutDescriptor, Refused};
use ferry_engine::{Model, PagePool};
use ferry_kernels::Backend;
use ferry_transfer::BackendKind;
use ferry_transfer::backend::TransferConfig;
use ferry_transfer::room::Timeouts;
use ferry_transfer::tcp::TcpConfig;
use tokio::sync::oneshot;
use tonic::Status;

/// A model on a KV pool whose pages the transfer reaches.
pub struct Loaded<B: Backend> {
    /// The model.
    pub model: Model<B>,
    /// Its KV pool.
    pub pool: PagePool<B>,
    /// The pool's pages as the transfer sees them.
    pub kv: Arc<KvHost>,
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
    /// The same for pulls (decode → prefill: the peer roles swapped under mutual TLS).
    pub pull: TransferConfig,
}

impl<B: Backend> Loaded<B> {
    /// Loads what `config` names onto `backend` (the model load runs off the async runtime);
    /// `role` labels the mirror's metrics.
    pub async fn load(config: &WorkerConfig, backend_: B, role: &'static str) -> Result<Self, StartError> {
        let w = &config.args;
        let backend = ferry_transfer::backend::choose(w.transfer, ferry_transfer::backend::rdma_usable())
            .map_err(StartError::config)?;
        let path = w.model.clone();
        let model = tokio::task::spawn_blocking(move || Model::load(&path, backend_))
            .await
            .map_err(|e| StartError::Config(format!("model loader panicked: {e}")))?
            .map_err(|e| StartError::Model(e.to_string()))?;
        let kv = model.kv_layout(w.page_size);
        let page_bytes = kv.page_floats() * 4;
        let pages = w.pool_pages(page_bytes, model.backend().device_memory());
        let pool = PagePool::new(model.backend(), kv, pages).map_err(|e| StartError::Model(e.to_string()))?;
        let host = KvHost::new(model.backend(), &pool, w.kv_host_mirror, role)
            .map_err(|e| StartError::Model(format!("the KV pool's host pages: {e}")))?;
        let c = model.config();
        let layout = LayoutDescriptor {
            model_fingerprint: model.fingerprint().to_string(),
            dtype: w.dtype.as_str().into(),
            num_layers: c.num_layers as u32,
            num_kv_heads: c.num_kv_heads as u32,
            head_dim: c.head_dim as u32,
            page_size: w.page_size as u32,
        };
        let timeouts = config.timeouts;
        let transfer = TransferConfig {
            tcp: TcpConfig { connections: w.transfer_connections.max(1), timeouts, ..TcpConfig::default() },
            rdma: ferry_transfer::rdma::RdmaConfig { timeouts, ..Default::default() },
            // The data plane runs under the daemons' mutual TLS unless --insecure-internal.
            security: config.internal_tls.as_ref().map_or_else(Default::default, |t| data_plane::data_plane(t)),
        };
        let pull = TransferConfig {
            security: config.internal_tls.as_ref().map_or_else(Default::default, |t| data_plane::pull_plane(t)),
            ..transfer.clone()
        };
        tracing::info!(device = model.backend().name(), pages, mirrored = host.mirrored(), "KV pool allocated");
        Ok(Self { model, pool, kv: Arc::new(host), pages, layout, backend, timeouts, transfer, pull })
    }
}

/// A daemon's start on a compute backend ([`start_on_device`] picks which).
pub trait StartOn {
    /// The running daemon.
    type Running;
    /// Starts on `compute`.
    fn start_on<B: Backend>(self, compute: B) -> impl Future<Output = Result<Self::Running, StartError>>;
}

/// Starts `daemon` on the backend `--device` names. `cuda` fails with the reason (a build
/// without the `cuda` feature, no driver, no CUDA libraries, no such GPU) on a machine that
/// cannot run it.
pub async fn start_on_device<S: StartOn>(w: &WorkerConfig, daemon: S) -> Result<S::Running, StartError> {
    match w.args.device {
        Device::Cpu => daemon.start_on(ferry_kernels::cpu::CpuBackend::new(w.args.cpu_math)).await,
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            let gpu = ferry_kernels::cuda::CudaBackend::new(n).map_err(|e| StartError::Config(e.to_string()))?;
            daemon.start_on(gpu).await
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(StartError::Config(NO_CUDA_BUILD.into())),
    }
}

/// Commands an engine thread's channel holds at most ([`EngineLink`]): far more than a
/// healthy engine ever has queued (it takes every waiting command before each pass); a full
/// channel means the engine thread is stuck, and callers are told so instead of piling up.
pub const ENGINE_COMMANDS: usize = 16_384;

/// A handler's way to the engine thread, over a channel bounded by [`ENGINE_COMMANDS`].
pub struct EngineLink<C> {
    tx: std::sync::mpsc::SyncSender<C>,
    role: &'static str,
}

impl<C> Clone for EngineLink<C> {
    fn clone(&self) -> Self {
        Self { tx: self.tx.clone(), role: self.role }
    }
}

/// The channel of an engine thread of `role`: the link handlers send on, and what the engine
/// receives.
pub fn engine_channel<C>(role: &'static str) -> (EngineLink<C>, std::sync::mpsc::Receiver<C>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(ENGINE_COMMANDS);
    (EngineLink { tx, role }, rx)
}

impl<C: Send + 'static> EngineLink<C> {
    /// Sends a call's command: `UNAVAILABLE` once the engine has stopped, or while its channel
    /// is full (the call is refused, counted as `engine_busy`; nothing else is lost).
    pub fn send(&self, c: C) -> Result<(), Status> {
        match self.tx.try_send(c) {
            Ok(()) => Ok(()),
            Err(std::sync::mpsc::TrySendError::Full(_)) => Err(Refused::new(
                tonic::Code::Unavailable,
                "engine_busy",
                format!("the {} engine has {ENGINE_COMMANDS} commands waiting: try again", self.role),
            )
            .status(self.role)),
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {
                Err(Status::unavailable(format!("the {} engine has stopped", self.role)))
            }
        }
    }

    /// Reports what happened (a transfer's end, a task's report, a client gone), which the
    /// engine must hear however busy it is: while its channel is full, the report waits for
    /// room on a task of its own (the runtime's; without one, this thread waits). Dropped
    /// only once the engine has stopped.
    pub fn report(&self, c: C) {
        let c = match self.tx.try_send(c) {
            Ok(()) | Err(std::sync::mpsc::TrySendError::Disconnected(_)) => return,
            Err(std::sync::mpsc::TrySendError::Full(c)) => c,
        };
        let tx = self.tx.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let mut c = c;
                    loop {
                        match tx.try_send(c) {
                            Ok(()) | Err(std::sync::mpsc::TrySendError::Disconnected(_)) => return,
                            Err(std::sync::mpsc::TrySendError::Full(back)) => c = back,
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    }
                });
            }
            Err(_) => {
                let _ = tx.send(c);
            }
        }
    }

    /// The daemon's role (a metrics label).
    pub fn role(&self) -> &'static str {
        self.role
    }
}

/// Awaits the engine's answer: its value, or its refusal as a counted status.
pub async fn answer<T, E: Into<Refused>>(rx: oneshot::Receiver<Result<T, E>>, role: &'static str) -> Result<T, Status> {
    match rx.await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.into().status(role)),
        Err(_) => Err(Status::unavailable(format!("the {role} engine dropped the call (shutting down?)"))),
    }
}

/// The output constraint of `params`, compiled off the async threads and the engine's
/// (a cache hit after its first request): a guide for the request's sampler, `None` for free
/// text, or a counted `INVALID_ARGUMENT` naming what does not compile.
pub async fn compile_guide(
    grammars: &std::sync::Arc<ferry_engine::Grammars>,
    params: &ferry_engine::SamplingParams,
    role: &'static str,
) -> Result<Option<ferry_engine::Guide>, Status> {
    if params.constraint.is_none() {
        return Ok(None);
    }
    let (g, p) = (std::sync::Arc::clone(grammars), params.clone());
    match tokio::task::spawn_blocking(move || ferry_engine::guide::guide(&g, &p)).await {
        Ok(Ok(guide)) => Ok(guide),
        Ok(Err(e)) => Err(Refused::invalid("invalid_constraint", e.to_string()).status(role)),
        Err(e) => Err(Status::internal(format!("compiling the output constraint: {e}"))),
    }
}
