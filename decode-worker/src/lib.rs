//! `ferry-decode`: the decode daemon (DESIGN.md §2–§3).
//!
//! - [`queues`]: prealloc → transfer (or local prefill) → waiting → running, a pure state
//!   machine; admission sets aside pages for the prompt and an adaptive estimate of its
//!   decoding; when the running batch needs pages the pool lacks, the engine retracts the
//!   request with the least progress and recomputes it later: an admitted request is paused,
//!   never cut;
//! - the engine thread owns the model and the page pool: it preallocates a room's pages,
//!   opens the room on the transfer receiver (which writes arriving pages straight into them),
//!   starts the handshake with the prefill node, and decodes with continuous batching; a
//!   request whose `prefill_bootstrap_addr` is empty is prefilled here (colocated mode);
//! - gRPC `Decode` (Generate stream, Abort), `Load`, `KvEvents` (its prefix cache, which the
//!   router follows to place a conversation's turns where its history is), `Holder` (a
//!   prefill node pulls the prompt pages the cache holds: [`holder`]), and gRPC health.
//!
//! [`start`] brings a daemon up (port 0 works); [`run`] is `start`, wait, graceful stop.

mod cmd;
mod engine;
pub mod error;
mod handshake;
pub mod holder;
pub mod queues;
mod service;
mod wake;

pub use cmd::Load;

use std::sync::Arc;

use parking_lot::Mutex;

use ferry_cluster::args::FlagError;
use ferry_cluster::daemon::{self};
use ferry_cluster::discovery::Role;
use ferry_cluster::roles::PeerRole;
use ferry_cluster::{Shutdown, WorkerId};
use ferry_kernels::Backend;
use ferry_worker::Loaded;
use ferry_worker::WorkerArgs;
use ferry_worker::WorkerConfig;

pub use ferry_cluster::daemon::StartError;
use ferry_proto::v1 as pb;

use crate::cmd::Cmd;
use crate::engine::{Engine, EngineConfig};
use crate::handshake::Handshakes;
use crate::queues::{Admission, Limits};
use crate::service::{DecodeSvc, LoadSvc, Shared};

/// The decode daemon's flags.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "ferry-decode", version, about = "Ferry decode daemon")]
pub struct DecodeArgs {
    /// Flags every worker shares.
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Most requests admitted at once (transferring, prefilling, waiting and running).
    #[arg(long, env = ferry_cluster::env::DECODE_MAX_RUNNING_REQUESTS, default_value_t = 64, help_heading = "Admission")]
    pub max_running_requests: usize,
    /// How admission estimates the KV pages a request's decoding will take: `adaptive` (a
    /// share of its remaining max tokens that falls while no request is retracted and, after
    /// a retraction, becomes what the running requests have shown) or `reserved`
    /// (--num-reserved-decode-tokens each). Either way a request the pool cannot feed is
    /// retracted and resumed, never cut.
    #[arg(long, env = ferry_cluster::env::DECODE_ADMISSION, value_enum, default_value_t = AdmissionKind::Adaptive, help_heading = "Admission")]
    pub decode_admission: AdmissionKind,
    /// `--decode-admission reserved`: decode tokens set aside per request at admission
    /// (capped by its max tokens).
    #[arg(long, env = ferry_cluster::env::NUM_RESERVED_DECODE_TOKENS, default_value_t = 256, help_heading = "Admission")]
    pub num_reserved_decode_tokens: usize,
    /// `--decode-admission adaptive`: the starting share of a request's remaining max tokens
    /// set aside (0 to 1).
    #[arg(long, env = ferry_cluster::env::INIT_NEW_TOKEN_RATIO, default_value_t = 0.3, help_heading = "Admission")]
    pub init_new_token_ratio: f64,
    /// `--decode-admission adaptive`: the share's floor (0 to --init-new-token-ratio).
    #[arg(long, env = ferry_cluster::env::MIN_NEW_TOKEN_RATIO, default_value_t = 0.05, help_heading = "Admission")]
    pub min_new_token_ratio: f64,
    /// `--decode-admission adaptive`: decode steps without a retraction for the share to fall
    /// to --min-new-token-ratio, from --init-new-token-ratio at start and from where the last
    /// retraction set it after one.
    #[arg(long, env = ferry_cluster::env::NEW_TOKEN_RATIO_DECAY_STEPS, default_value_t = 200, help_heading = "Admission")]
    pub new_token_ratio_decay_steps: u32,
    /// Seconds a request may wait for free pages while this worker runs no forward pass (as
    /// long as it computes, the requests ahead finish and the queue moves).
    #[arg(long, env = ferry_cluster::env::PREALLOC_TIMEOUT, default_value_t = 60.0, help_heading = "Admission")]
    pub prealloc_timeout: f64,
    /// Seconds a stopping worker (SIGTERM, Ctrl-C) lets the requests it is generating go on:
    /// it leaves placement at once and admits nothing new (requests without a token yet end
    /// now, and routers place them again); those still generating when the grace is over end
    /// with UNAVAILABLE, and routers move them to another decode worker with what they had
    /// generated (`--migration-limit`). 0: end everything at once.
    #[arg(long, env = ferry_cluster::env::DRAIN_GRACE, default_value_t = 10.0, help_heading = "Admission")]
    pub drain_grace: f64,
    /// Sample every output token, even those an output constraint (structured outputs)
    /// forces. By default a constraint that admits exactly one continuation of one or more
    /// tokens (a schema's fixed keys and punctuation) has them appended in one step, their
    /// KV computed as one chunk with the next step's input (jump-forward decoding).
    #[arg(long, env = ferry_cluster::env::DISABLE_JUMP_FORWARD, help_heading = "Decoding")]
    pub disable_jump_forward: bool,
    /// Keep no prefix cache here. By default the pages of finished (and retracted) requests —
    /// prompt and generated tokens — stay in a radix cache, evictable whenever a request
    /// needs pages, and a prompt prefilled here (colocated, short or retracted) computes only
    /// what the cache lacks.
    #[arg(long, env = ferry_cluster::env::DISABLE_DECODE_CACHE, help_heading = "Decoding")]
    pub disable_decode_cache: bool,
}

/// How decode admission estimates a request's pages (`--decode-admission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AdmissionKind {
    /// A share of the remaining max tokens that adapts to retractions.
    Adaptive,
    /// A fixed number of tokens (--num-reserved-decode-tokens).
    Reserved,
}

impl DecodeArgs {
    /// The admission estimate these flags describe; an error names a flag out of range.
    pub fn admission(&self) -> Result<Admission, FlagError> {
        match self.decode_admission {
            AdmissionKind::Reserved => Ok(Admission::Reserved { tokens: self.num_reserved_decode_tokens }),
            AdmissionKind::Adaptive => {
                let (init, min) = (self.init_new_token_ratio, self.min_new_token_ratio);
                if !(0.0..=1.0).contains(&init) {
                    return Err(FlagError(format!("--init-new-token-ratio {init}: must be between 0 and 1")));
                }
                if !(0.0..=init).contains(&min) {
                    return Err(FlagError(format!(
                        "--min-new-token-ratio {min}: must be between 0 and --init-new-token-ratio"
                    )));
                }
                Ok(Admission::Adaptive { init, min, steps: self.new_token_ratio_decay_steps })
            }
        }
    }
}

impl DecodeArgs {
    /// Defaults for `model`, with plaintext gRPC between the daemons (`--insecure-internal`;
    /// set `worker.internal_tls` for mutual TLS).
    pub fn for_model(model: impl Into<std::path::PathBuf>) -> Self {
        ferry_cluster::args::defaults(&["--model".into(), model.into().into_os_string(), "--insecure-internal".into()])
    }

    /// Checks every flag before anything is loaded or bound: the config [`run`] takes, or an
    /// error naming the flag.
    pub fn check(&self) -> Result<DecodeConfig, StartError> {
        let admission = self.admission()?;
        let prealloc_timeout = ferry_cluster::args::seconds("prealloc-timeout", self.prealloc_timeout)?;
        let drain_grace = if self.drain_grace == 0.0 {
            std::time::Duration::ZERO
        } else {
            ferry_cluster::args::seconds("drain-grace", self.drain_grace)?
        };
        Ok(DecodeConfig {
            worker: self.worker.check()?,
            max_running_requests: self.max_running_requests.max(1),
            admission,
            prealloc_timeout,
            jump_forward: !self.disable_jump_forward,
            decode_cache: !self.disable_decode_cache,
            drain_grace,
        })
    }
}

/// A decode daemon's flags, checked ([`DecodeArgs::check`]).
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// What every worker checks.
    pub worker: WorkerConfig,
    /// `--max-running-requests` (at least 1).
    pub max_running_requests: usize,
    /// The admission estimate (`--decode-admission` and its ratios or reserve).
    pub admission: Admission,
    /// `--prealloc-timeout`.
    pub prealloc_timeout: std::time::Duration,
    /// Not `--disable-jump-forward`.
    pub jump_forward: bool,
    /// Not `--disable-decode-cache`.
    pub decode_cache: bool,
    /// `--drain-grace`.
    pub drain_grace: std::time::Duration,
}

/// A running decode daemon: a worker ([`ferry_worker::Running`], reached through `Deref`)
/// with the address prefill nodes send its KV pages to.
pub struct Running {
    /// The worker.
    pub worker: ferry_worker::Running<Load>,
    /// Where prefill nodes send this node's KV pages.
    pub data_endpoint: String,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").field("worker", &self.worker).field("data_endpoint", &self.data_endpoint).finish()
    }
}

impl std::ops::Deref for Running {
    type Target = ferry_worker::Running<Load>;

    fn deref(&self) -> &Self::Target {
        &self.worker
    }
}

impl Running {
    /// Graceful stop: stop serving, end every request (closing its room), free every page,
    /// wait for the engine thread.
    pub async fn stop(self) {
        self.worker.stop().await;
    }
}

/// Checks `args` and starts ([`start_checked`]).
pub async fn start(args: DecodeArgs) -> Result<Running, StartError> {
    start_checked(args.check()?).await
}

/// Loads the model onto the `--device` backend, allocates the pool, binds the transfer
/// address and starts serving.
pub async fn start_checked(config: DecodeConfig) -> Result<Running, StartError> {
    let worker = config.worker.clone();
    ferry_worker::start_on_device(&worker, config).await
}

impl ferry_worker::StartOn for DecodeConfig {
    type Running = Running;

    fn start_on<B: Backend>(self, compute: B) -> impl Future<Output = Result<Running, StartError>> {
        start_on(self, compute)
    }
}

async fn start_on<B: Backend>(args: DecodeConfig, compute: B) -> Result<Running, StartError> {
    let config = &args.worker;
    let (w, internal_tls) = (&config.args, config.internal_tls.clone());
    let (admission, prealloc_timeout) = (args.admission, args.prealloc_timeout);
    let Loaded { model, pool, kv, pages, layout: descriptor, backend, timeouts, transfer, pull } =
        Loaded::load(config, compute, "decode").await?;
    let kv_mirrored = kv.mirrored();
    let mem = Arc::clone(kv.mem());
    let (link, rx) = ferry_worker::engine_channel("decode");
    let holder = holder::Holder {
        engine: link.clone(),
        backend,
        transfer: pull,
        mem: Arc::clone(&mem),
        senders: Default::default(),
        timeout: timeouts.transferring,
        max_pages: 1 << 16,
    };
    let (receiver, data_endpoint) = ferry_transfer::backend::bind(backend, w.transfer_addr, mem, transfer)
        .await
        .map_err(|source| StartError::Io { what: "transfer address", source })?;
    let data_endpoint = w.data_endpoint(&data_endpoint)?;
    let receiver = Arc::new(receiver);

    let (listener, grpc_addr) = daemon::bind_grpc(w.grpc_addr).await?;
    let worker_id = w.worker_id.clone().unwrap_or_else(|| WorkerId::of("decode", grpc_addr.port()));
    let load = Arc::new(Mutex::new(Load {
        free_pages: pages,
        admissible_pages: pages,
        total_pages: pages,
        ..Load::default()
    }));
    let (events, _) = tokio::sync::broadcast::channel(1024);
    let handshakes =
        Handshakes::new(tokio::runtime::Handle::current(), link.clone(), timeouts.bootstrap, internal_tls.clone());
    let limits = Limits {
        max_running: args.max_running_requests,
        prealloc_timeout,
        waiting_timeout: timeouts.waiting,
        page_size: w.page_size,
        admission,
    };
    let cfg = EngineConfig {
        worker: worker_id.clone(),
        limits,
        chunk_size: w.chunked_prefill_size,
        layout: descriptor.clone(),
        data_endpoint: data_endpoint.clone(),
        backend: backend.as_str(),
        jump_forward: args.jump_forward,
        decode_cache: args.decode_cache,
        drain_grace: args.drain_grace,
        events: events.clone(),
    };
    let wake = wake::Wake::new(tokio::runtime::Handle::current(), link.clone());
    let grammars = Arc::clone(model.grammars());
    grammars.prepare_in_background();
    let engine = Engine::new(model, pool, kv, receiver, handshakes, wake, cfg, Arc::clone(&load));
    let shared =
        Arc::new(Shared { engine: link.clone(), worker: worker_id.clone(), load: Arc::clone(&load), grammars });
    let (trigger, shutdown) = Shutdown::new();
    let kv_events = ferry_worker::kv_events::KvEventsSvc::new(
        events,
        link.clone(),
        |reply| Cmd::Snapshot { reply },
        worker_id.clone(),
        shutdown.clone(),
    );
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<pb::decode_server::DecodeServer<DecodeSvc>>().await;
    // Under mutual TLS only the router may call (ferry_cluster::roles).
    let only = |service| ferry_cluster::roles::only(service, &[PeerRole::Router], internal_tls.is_some(), "decode");
    let services = tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(pb::decode_server::DecodeServer::with_interceptor(DecodeSvc(Arc::clone(&shared)), only("Decode")))
        .add_service(pb::load_server::LoadServer::with_interceptor(LoadSvc(Arc::clone(&shared)), only("Load")))
        .add_service(pb::kv_events_server::KvEventsServer::with_interceptor(kv_events, only("KvEvents")))
        // Prefill nodes pull held pages; nobody else may.
        .add_service(pb::holder_server::HolderServer::with_interceptor(
            holder::HolderSvc(Arc::new(holder)),
            ferry_cluster::roles::only("Holder", &[PeerRole::Prefill], internal_tls.is_some(), "decode"),
        ));
    let serve = ferry_worker::Serve {
        role: Role::Decode,
        listener,
        grpc_addr,
        worker_id: worker_id.clone(),
        engine: Box::new(move || engine.run(rx)),
        drain: Box::new(move || {
            link.report(Cmd::Shutdown);
        }),
        drain_grace: args.drain_grace,
        health,
        services,
        stop: (trigger, shutdown),
        layout: descriptor,
        backend,
        kv_mirrored,
        load,
    };
    let worker = ferry_worker::serve(config, serve).await?;
    let metrics_addr = worker.metrics_addr;
    tracing::info!(%grpc_addr, %metrics_addr, %data_endpoint, worker = %worker_id, backend = %backend, pages, "decode worker up");
    Ok(Running { worker, data_endpoint })
}

/// Runs the daemon until `shutdown` resolves, then stops it gracefully.
pub async fn run(config: DecodeConfig, shutdown: impl std::future::Future<Output = ()>) -> Result<(), StartError> {
    ferry_cluster::daemon::serve_until(start_checked(config).await?, shutdown, Running::stop).await;
    Ok(())
}
