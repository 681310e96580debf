//! `ferry-prefill`: the prefill daemon (DESIGN.md §2–§3).
//!
//! - [`rooms`]: the bootstrap → waiting → inflight queue, a pure state machine with a timeout
//!   in every state; either the request or the decode node's handshake may come first;
//! - [`engine`]: the thread that owns the model, page pool, prefix cache and scheduler; it
//!   computes prompts in chunks and hands each chunk's finished pages to the room's transfer
//!   task right after the chunk (cached prefix pages first; the first sampled token with the
//!   last chunk);
//! - `pull`: a prompt's leading pages that its decode node holds and this node lacks (a
//!   conversation's earlier answers) pulled from there, when the router allows it, instead
//!   of computed (issue 20);
//! - [`service`]: gRPC `Prefill`, `Bootstrap`, `KvEvents`, `Load`, plus gRPC health.
//!
//! [`start`] brings a daemon up (port 0 works: tests and `ferry up` run several in one
//! process); [`run`] is `start`, wait, then a graceful stop.

mod cmd;
mod engine;
pub mod error;
mod pull;
mod room_task;
pub mod rooms;
mod service;
pub mod tail;

pub use cmd::{Load, PrefillDone};

use std::sync::Arc;

use parking_lot::Mutex;

use ferry_cluster::daemon::{self};
use ferry_cluster::discovery::Role;
use ferry_cluster::roles::PeerRole;
use ferry_cluster::{Shutdown, WorkerId};
use ferry_kernels::Backend;
use ferry_worker::Loaded;
use ferry_worker::WorkerArgs;
use ferry_worker::WorkerConfig;

pub use ferry_cluster::daemon::StartError;
use ferry_engine::scheduler::{Policy, Scheduler, SchedulerConfig};
use ferry_proto::v1 as pb;

use crate::cmd::Cmd;
use crate::engine::{Engine, EngineConfig};
use crate::pull::Puller;
use crate::service::{BootstrapSvc, LoadSvc, PrefillSvc, SenderPool, Shared};
use ferry_transfer::BackendKind;

/// The prefill daemon's flags.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "ferry-prefill", version, about = "Ferry prefill daemon")]
pub struct PrefillArgs {
    /// Flags every worker shares.
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Order of waiting requests: `lpm` (longest cached prefix first), `dfs-weight` (depth
    /// first over the cache tree, heaviest subtree first) or `fcfs`.
    #[arg(long, env = ferry_cluster::env::SCHEDULE_POLICY, value_enum, default_value_t = Policy::Lpm, help_heading = "Scheduling")]
    pub schedule_policy: Policy,
    /// A request sharing at least this many uncached tokens with a prompt being computed
    /// waits for it (the in-queue prefix check); 0 disables the check.
    #[arg(long, env = ferry_cluster::env::IN_QUEUE_THRESHOLD, default_value_t = 32, help_heading = "Scheduling")]
    pub in_queue_threshold: usize,
    /// Longest destination page list one handshake may carry.
    #[arg(long, env = ferry_cluster::env::MAX_DEST_PAGES, default_value_t = 1 << 16, help_heading = "Transfer")]
    pub max_dest_pages: usize,
}

impl PrefillArgs {
    /// Defaults for `model`, with plaintext gRPC between the daemons (`--insecure-internal`;
    /// set `worker.internal_tls` for mutual TLS).
    pub fn for_model(model: impl Into<std::path::PathBuf>) -> Self {
        ferry_cluster::args::defaults(&["--model".into(), model.into().into_os_string(), "--insecure-internal".into()])
    }

    /// Checks every flag before anything is loaded or bound: the config [`run`] takes, or an
    /// error naming the flag.
    pub fn check(&self) -> Result<PrefillConfig, StartError> {
        Ok(PrefillConfig {
            worker: self.worker.check()?,
            schedule_policy: self.schedule_policy,
            in_queue_threshold: self.in_queue_threshold,
            max_dest_pages: self.max_dest_pages,
        })
    }
}

/// A prefill daemon's flags, checked ([`PrefillArgs::check`]).
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    /// What every worker checks.
    pub worker: WorkerConfig,
    /// `--schedule-policy`.
    pub schedule_policy: Policy,
    /// `--in-queue-threshold`.
    pub in_queue_threshold: usize,
    /// `--max-dest-pages`.
    pub max_dest_pages: usize,
}

/// A running prefill daemon.
pub type Running = ferry_worker::Running<Load>;

/// Checks `args` and starts ([`start_checked`]).
pub async fn start(args: PrefillArgs) -> Result<Running, StartError> {
    start_checked(args.check()?).await
}

/// Loads the model onto the `--device` backend, allocates the pool, and starts serving.
pub async fn start_checked(config: PrefillConfig) -> Result<Running, StartError> {
    let worker = config.worker.clone();
    ferry_worker::start_on_device(&worker, config).await
}

impl ferry_worker::StartOn for PrefillConfig {
    type Running = Running;

    fn start_on<B: Backend>(self, compute: B) -> impl Future<Output = Result<Running, StartError>> {
        start_on(self, compute)
    }
}

async fn start_on<B: Backend>(args: PrefillConfig, compute: B) -> Result<Running, StartError> {
    let config = &args.worker;
    let (w, internal_tls) = (&config.args, config.internal_tls.clone());
    let policy = args.schedule_policy;
    let Loaded { model, pool, kv, pages, layout: descriptor, backend, timeouts, transfer, pull } =
        Loaded::load(config, compute, "prefill").await?;
    let kv_mirrored = kv.mirrored();
    // Where decode nodes send the held pages this node pulls (tcp and fake only).
    let pull_receiver = match backend {
        BackendKind::Tcp | BackendKind::Fake => {
            let (r, at) = ferry_transfer::backend::bind(backend, w.transfer_addr, Arc::clone(kv.mem()), pull)
                .await
                .map_err(|source| StartError::Io { what: "transfer address", source })?;
            Some((Arc::new(r), w.data_endpoint(&at)?, backend.as_str()))
        }
        BackendKind::Rdma | BackendKind::Auto => None,
    };
    let (listener, grpc_addr) = daemon::bind_grpc(w.grpc_addr).await?;
    let worker_id = w.worker_id.clone().unwrap_or_else(|| WorkerId::of("prefill", grpc_addr.port()));

    let (events, _) = tokio::sync::broadcast::channel(1024);
    let load = Arc::new(Mutex::new(Load { free_pages: pages, total_pages: pages, ..Load::default() }));
    let senders = Arc::new(SenderPool::default());
    let (link, rx) = ferry_worker::engine_channel("prefill");
    let puller = pull_receiver.map(|r| {
        let rt = tokio::runtime::Handle::current();
        Arc::new(Puller::new(rt, r, internal_tls.clone(), timeouts.transferring, link.clone()))
    });
    let sched_cfg =
        SchedulerConfig { policy, chunk_size: w.chunked_prefill_size, in_queue_threshold: args.in_queue_threshold };
    let grammars = Arc::clone(model.grammars());
    grammars.prepare_in_background();
    let engine = Engine::new(
        model,
        pool,
        Scheduler::new(sched_cfg, w.page_size),
        Arc::clone(&kv),
        tokio::runtime::Handle::current(),
        link.clone(),
        EngineConfig { worker: worker_id.clone(), timeouts, senders: Arc::clone(&senders), puller },
        events.clone(),
        Arc::clone(&load),
    );
    let (trigger, shutdown) = Shutdown::new();
    let shared = Arc::new(Shared {
        engine: link.clone(),
        worker: worker_id.clone(),
        layout: descriptor.clone(),
        backend,
        transfer,
        mem: Arc::clone(kv.mem()),
        senders,
        max_dest_pages: args.max_dest_pages,
        load: Arc::clone(&load),
        grammars,
    });
    let kv_events = ferry_worker::kv_events::KvEventsSvc::new(
        events,
        link.clone(),
        |reply| Cmd::Snapshot { reply },
        worker_id.clone(),
        shutdown.clone(),
    );
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<pb::prefill_server::PrefillServer<PrefillSvc>>().await;
    health.set_serving::<pb::bootstrap_server::BootstrapServer<BootstrapSvc>>().await;
    // Under mutual TLS each service answers only the role that needs it (ferry_cluster::roles).
    let mtls = internal_tls.is_some();
    let only = |service, allowed| ferry_cluster::roles::only(service, allowed, mtls, "prefill");
    let (router_only, decode_only) = (&[PeerRole::Router][..], &[PeerRole::Decode][..]);
    let router = tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(pb::prefill_server::PrefillServer::with_interceptor(
            PrefillSvc(Arc::clone(&shared)),
            only("Prefill", router_only),
        ))
        .add_service(pb::bootstrap_server::BootstrapServer::with_interceptor(
            BootstrapSvc(Arc::clone(&shared)),
            only("Bootstrap", decode_only),
        ))
        .add_service(pb::kv_events_server::KvEventsServer::with_interceptor(kv_events, only("KvEvents", router_only)))
        .add_service(pb::load_server::LoadServer::with_interceptor(
            LoadSvc(Arc::clone(&shared)),
            only("Load", router_only),
        ));
    let serve = ferry_worker::Serve {
        drain_grace: std::time::Duration::ZERO,
        role: Role::Prefill,
        listener,
        grpc_addr,
        worker_id: worker_id.clone(),
        engine: Box::new(move || engine.run(rx)),
        drain: Box::new(move || {
            link.report(Cmd::Shutdown);
        }),
        health,
        services: router,
        stop: (trigger, shutdown),
        layout: descriptor,
        backend,
        kv_mirrored,
        load,
    };
    let running = ferry_worker::serve(config, serve).await?;
    let metrics_addr = running.metrics_addr;
    tracing::info!(%grpc_addr, %metrics_addr, worker = %worker_id, backend = %backend, pages, "prefill worker up");
    Ok(running)
}

/// Runs the daemon until `shutdown` resolves, then stops it gracefully.
pub async fn run(config: PrefillConfig, shutdown: impl std::future::Future<Output = ()>) -> Result<(), StartError> {
    ferry_cluster::daemon::serve_until(start_checked(config).await?, shutdown, Running::stop).await;
    Ok(())
}
