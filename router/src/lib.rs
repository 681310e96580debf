//! `ferry-router`: the cluster's front door (DESIGN.md §6).
//!
//! - [`index`]: the prefix index — a radix tree over token ids whose pages record which
//!   prefill workers hold them, fed by the workers' KV events and by provisional marks for the
//!   router's own placements;
//! - [`placement`]: least estimated time to first token (cached prefix against queue and
//!   measured rate) with a jitter against herding; round-robin and least-load for comparison;
//!   decode by admissible room; conditional disaggregation;
//! - [`workers`]: channels, load polls and circuit breakers, KV event subscriptions;
//! - [`generate`]: one request through the cluster (detokenizing, stop strings, usage; a
//!   prefill failing before the first token is retried once elsewhere);
//! - the public gRPC `ferry.v1.Router` service and gRPC health;
//! - [`openai`]: the OpenAI-compatible HTTP API; optional API keys on both;
//! - [`tls`]: optional TLS on both; gRPC server reflection.
//!
//! Workers are named statically or discovered through etcd (they join and leave at any time).

pub mod admission;
mod config;
pub mod error;
pub mod generate;
pub mod h2_calls;
pub mod index;
pub mod limits;
mod logprobs;
pub mod offload;
pub mod openai;
mod output;
pub mod placement;
mod service;
#[cfg(test)]
mod testing;
pub mod tls;
pub mod workers;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::args::EtcdArgs;
use ferry_cluster::daemon::{StartError, bind_grpc};
use ferry_cluster::mtls::InternalTlsArgs;
use ferry_cluster::{Shutdown, ShutdownTrigger};
use ferry_proto::v1 as pb;
use ferry_tokenize::ServedModel;
use tokio::task::JoinHandle;

use crate::admission::{Admission, Limits};
pub use crate::config::RouterConfig;
use crate::generate::Ctx;
use crate::index::SharedIndex;
use crate::placement::{Placer, Policy};
use crate::service::RouterSvc;
use crate::workers::Registry;

/// The router's flags.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "ferry-router", version, about = "Ferry router")]
pub struct RouterArgs {
    /// The served model (HF directory or GGUF file): its tokenizer, chat template and limits
    /// are read from it; the weights are not loaded.
    #[arg(long, env = ferry_cluster::env::MODEL, help_heading = "Model")]
    pub model: PathBuf,
    /// The model name clients send (`model` in the OpenAI API). Default: the model file's or
    /// directory's name without extension.
    #[arg(long, env = ferry_cluster::env::SERVED_MODEL_NAME, help_heading = "Model")]
    pub served_model_name: Option<String>,
    /// MiB of tokenized prompt heads kept for reuse: the segments of a chat between special
    /// tokens (system prompt, earlier turns) are tokenized once and their ids reused by later
    /// requests that start with them; 0 tokenizes every prompt in full.
    #[arg(long, env = ferry_cluster::env::TOKENIZER_CACHE_MIB, default_value_t = 64, help_heading = "Model")]
    pub tokenizer_cache_mib: usize,
    /// A prefill worker, `ADDR` or `ID=ADDR` (gRPC `host:port`); repeat for more.
    #[arg(long = "prefill", env = ferry_cluster::env::PREFILL, value_delimiter = ',', help_heading = "Discovery")]
    pub prefill: Vec<String>,
    /// A decode worker, `ADDR` or `ID=ADDR`; repeat for more.
    #[arg(long = "decode", env = ferry_cluster::env::DECODE, value_delimiter = ',', help_heading = "Discovery")]
    pub decode: Vec<String>,
    /// A file of workers, one `prefill ENTRY` or `decode ENTRY` per line (added to the flags).
    #[arg(long, env = ferry_cluster::env::WORKERS_FILE, help_heading = "Discovery")]
    pub workers_file: Option<PathBuf>,
    /// gRPC listen address of the public `ferry.v1.Router` service.
    #[arg(long, env = ferry_cluster::env::GRPC_ADDR, default_value = "127.0.0.1:0", help_heading = "Endpoints")]
    pub grpc_addr: SocketAddr,
    /// OpenAI-compatible HTTP API listen address (`/v1/completions`, `/v1/chat/completions`,
    /// `/v1/models`, `/v1/models/{id}`, `/health`, `/metrics`).
    #[arg(long, env = ferry_cluster::env::HTTP_ADDR, default_value = "127.0.0.1:0", help_heading = "Endpoints")]
    pub http_addr: SocketAddr,
    /// Prometheus `/metrics` listen address.
    #[arg(long, env = ferry_cluster::env::METRICS_ADDR, default_value = "127.0.0.1:0", help_heading = "Observability")]
    pub metrics_addr: SocketAddr,
    /// Prefill placement: `cache-aware`, `round-robin` or `least-load`.
    #[arg(long, env = ferry_cluster::env::POLICY, value_enum, default_value_t = Policy::CacheAware, help_heading = "Placement")]
    pub policy: Policy,
    /// Prompts that the chosen decode worker lacks fewer tokens of than this (its prefix cache
    /// counted) are prefilled on it (0: never for their length alone).
    #[arg(long, env = ferry_cluster::env::LOCAL_PREFILL_BELOW, default_value_t = 0, help_heading = "Placement")]
    pub local_prefill_below: usize,
    /// Prompts whose decode worker holds a prefix of them (a conversation's earlier turns and
    /// answers) and lacks at most this many tokens are prefilled on it when that is estimated
    /// sooner than a prefill worker's queue, compute and transfer (0: never by estimate). It
    /// bounds the prompt work a decode worker takes between its decode steps.
    #[arg(long, env = ferry_cluster::env::LOCAL_PREFILL_MAX, default_value_t = 512, help_heading = "Placement")]
    pub local_prefill_max: usize,
    /// What one more request in a decode worker's batch costs the requests placed there, in
    /// prompt tokens computed: a request goes to the decode worker, among those with room
    /// for it now, where the prompt tokens it lacks (its prefix cache holds the rest) plus
    /// this for each request it serves are fewest. Larger spreads load sooner; 0 follows
    /// the decode caches alone (load breaks ties).
    #[arg(long, env = ferry_cluster::env::DECODE_REQUEST_TOKENS, default_value_t = crate::placement::DECODE_REQUEST_TOKENS, help_heading = "Placement")]
    pub decode_request_tokens: f64,
    /// Never let a prefill worker pull the prompt pages that the request's decode worker holds
    /// and it lacks (a conversation's earlier answers): it computes them instead. By default
    /// placement chooses the pull whenever moving those pages is estimated sooner than
    /// computing them.
    #[arg(long, env = ferry_cluster::env::DISABLE_PULL, help_heading = "Placement")]
    pub disable_pull: bool,
    /// Tokens per KV page; must match the workers' `--page-size`.
    #[arg(long, env = ferry_cluster::env::PAGE_SIZE, default_value_t = 16, help_heading = "Placement")]
    pub page_size: usize,
    /// Most pages a prefix index holds (memory bound; the router keeps one for prefill
    /// workers' caches and one for decode workers', each with its workers' KV events in two
    /// copies and its own placements apart, each part within this bound).
    #[arg(long, env = ferry_cluster::env::MAX_INDEX_PAGES, default_value_t = 1 << 20, help_heading = "Placement")]
    pub max_index_pages: usize,
    /// API keys the public endpoints accept (`Authorization: Bearer <key>` over HTTP, the
    /// same as `authorization` metadata over gRPC); none: the endpoints are open.
    #[arg(long = "api-key", env = ferry_cluster::env::API_KEYS, value_delimiter = ',', help_heading = "Endpoints")]
    pub api_keys: Vec<String>,
    /// Requests running through the router at once; more wait in the admission queue
    /// (0: no bound).
    #[arg(long, env = ferry_cluster::env::ROUTER_MAX_RUNNING_REQUESTS, default_value_t = 256, help_heading = "Admission")]
    pub max_running_requests: usize,
    /// Requests waiting for a slot beyond --max-running-requests; more are refused at once
    /// (429 / RESOURCE_EXHAUSTED with a retry-after hint).
    #[arg(long, env = ferry_cluster::env::MAX_QUEUED_REQUESTS, default_value_t = 1024, help_heading = "Admission")]
    pub max_queued_requests: usize,
    /// Seconds a request waits in the admission queue at most before it is refused (like
    /// every Ferry timeout, in seconds; fractions allowed).
    #[arg(long, env = ferry_cluster::env::QUEUE_TIMEOUT, default_value_t = 30.0, help_heading = "Admission")]
    pub queue_timeout: f64,
    /// How many times one request's stream may move to another decode worker when its own
    /// fails after tokens went out (killed, cut off, or out of placement and silent): the
    /// prompt and the tokens already streamed are computed again there and the stream goes
    /// on with the next token. 0: such a stream ends with a retriable UNAVAILABLE.
    #[arg(long, env = ferry_cluster::env::MIGRATION_LIMIT, default_value_t = 3, help_heading = "Admission")]
    pub migration_limit: u32,
    /// Most stop strings one request may carry (more: 400 / INVALID_ARGUMENT naming `stop`).
    #[arg(long, env = ferry_cluster::env::MAX_STOP_STRINGS, default_value_t = limits::DEFAULT_MAX_STOP_STRINGS, help_heading = "Admission")]
    pub max_stop_strings: usize,
    /// Most bytes of one stop string (longer: 400 / INVALID_ARGUMENT naming it).
    #[arg(long, env = ferry_cluster::env::MAX_STOP_STRING_BYTES, default_value_t = limits::DEFAULT_MAX_STOP_BYTES, help_heading = "Admission")]
    pub max_stop_string_bytes: usize,
    /// Seconds between active checks (gRPC health and load report) of every worker.
    #[arg(long, env = ferry_cluster::env::LOAD_POLL, default_value_t = 0.1, help_heading = "Discovery")]
    pub load_poll: f64,
    /// Most active checks per second over all workers (each is two calls): with more workers
    /// than --load-poll allows at this rate, every worker is checked every workers / this
    /// seconds instead (at most an hour), so that polling a thousand workers does not take
    /// the router's cores. A joining worker is checked at once.
    #[arg(long, env = ferry_cluster::env::LOAD_POLLS_PER_SECOND, default_value_t = 1000.0, help_heading = "Discovery")]
    pub load_polls_per_second: f64,
    /// etcd discovery: workers registered under `/ferry/<cluster>/` join and leave as they
    /// come and go (in addition to any named by flags or file).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Mutual TLS to the workers.
    #[command(flatten)]
    pub internal_tls: InternalTlsArgs,
    /// Span export (OTLP).
    #[command(flatten)]
    pub telemetry: ferry_cluster::telemetry::TelemetryArgs,
    /// PEM certificate chain for TLS on the public gRPC and HTTP endpoints (with --tls-key);
    /// unset: plaintext.
    #[arg(long, env = ferry_cluster::env::TLS_CERT, requires = "tls_key", help_heading = "TLS")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = ferry_cluster::env::TLS_KEY, requires = "tls_cert", help_heading = "TLS")]
    pub tls_key: Option<PathBuf>,
}

impl RouterArgs {
    /// Defaults for `model` and the given workers: the flags' own defaults, with plaintext
    /// gRPC to the workers (`--insecure-internal`; set `internal_tls` for mutual TLS).
    pub fn new(model: impl Into<PathBuf>, prefill: Vec<String>, decode: Vec<String>) -> Self {
        let mut a: Self = ferry_cluster::args::defaults(&[
            "--model".into(),
            model.into().into_os_string(),
            "--insecure-internal".into(),
        ]);
        a.prefill = prefill;
        a.decode = decode;
        a
    }
}

/// A running router.
pub struct Running {
    /// gRPC address.
    pub grpc_addr: SocketAddr,
    /// OpenAI HTTP address.
    pub http_addr: SocketAddr,
    /// `/metrics` address.
    pub metrics_addr: SocketAddr,
    ctx: Arc<Ctx>,
    trigger: ShutdownTrigger,
    tasks: Vec<JoinHandle<()>>,
    background: Vec<JoinHandle<()>>,
}

impl Running {
    /// Pages in the prefix index.
    pub fn index_pages(&self) -> usize {
        self.ctx.index.pages()
    }

    /// What the prefill workers' caches hold, by their slot.
    pub fn prefill_index(&self) -> &SharedIndex {
        &self.ctx.index
    }

    /// The workers.
    pub fn workers(&self) -> &Registry {
        &self.ctx.workers
    }

    /// Whether it knows `prefill` prefill and `decode` decode workers, all healthy.
    pub fn ready(&self, prefill: usize, decode: usize) -> bool {
        let s = self.ctx.workers.snapshot();
        s.prefill.iter().flatten().count() == prefill && s.decode.len() == decode && s.all().all(|w| w.healthy())
    }

    /// Whether it knows at least `prefill` prefill and `decode` decode workers, all healthy
    /// (with discovery, more may join).
    pub fn ready_at_least(&self, prefill: usize, decode: usize) -> bool {
        let s = self.ctx.workers.snapshot();
        s.prefill.iter().flatten().count() >= prefill && s.decode.len() >= decode && s.all().all(|w| w.healthy())
    }

    /// Stops serving; open streams get 5 s.
    pub async fn stop(self) {
        self.trigger.trigger();
        for t in self.background {
            t.abort();
        }
        for t in self.tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), t).await.is_err() {
                abort.abort();
            }
        }
    }
}

/// Checks `args` and starts ([`start_checked`]).
pub async fn start(args: RouterArgs) -> Result<Running, StartError> {
    start_checked(args.check()?).await
}

/// Reads the model's metadata, connects to the workers and starts serving.
pub async fn start_checked(config: RouterConfig) -> Result<Running, StartError> {
    let RouterConfig { args, workers: d, etcd, queue_timeout, load_poll, tls, internal_tls } = config;
    ferry_cluster::mtls::warn_plaintext(internal_tls.as_ref());
    let policy = args.policy;
    let path = args.model.clone();
    let mut model = tokio::task::spawn_blocking(move || ServedModel::load(&path))
        .await
        .map_err(|e| StartError::Config(format!("model reader panicked: {e}")))?
        .map_err(|e| StartError::Model(e.to_string()))?;
    if let Some(n) = &args.served_model_name {
        model.name = n.clone();
    }
    model.tokenizer = model.tokenizer.clone().with_head_cache(args.tokenizer_cache_mib.saturating_mul(1 << 20));
    let index = Arc::new(SharedIndex::new(args.page_size, args.max_index_pages));
    let registry = Arc::new(Registry::new(Arc::clone(&index)).with_tls(internal_tls));
    for w in d.all() {
        registry.upsert(w).map_err(|e| StartError::Config(e.to_string()))?;
    }
    let mut placer = Placer::new(policy, 1000.0, 0.0, 2.5e9);
    placer.pull = !args.disable_pull;
    placer.decode_request_tokens = args.decode_request_tokens;
    let grammars = Arc::new(ferry_grammar::Grammars::new(model.tokenizer.clone()));
    grammars.prepare_in_background();
    let ctx = Arc::new(Ctx {
        grammars,
        model,
        workers: Arc::clone(&registry),
        index: Arc::clone(&index),
        placer: parking_lot::Mutex::new(placer),
        local_prefill_below: args.local_prefill_below,
        local_prefill_max: args.local_prefill_max,
        page_size: args.page_size,
        api_keys: args.api_keys.clone(),
        migration_limit: args.migration_limit,
        limits: crate::limits::Limits {
            max_stop_strings: args.max_stop_strings,
            max_stop_bytes: args.max_stop_string_bytes,
        },
        admission: Admission::new(Limits {
            max_running: args.max_running_requests,
            max_queued: args.max_queued_requests,
            timeout: queue_timeout,
        }),
    });
    let mut background = vec![tokio::spawn(Arc::clone(&registry).poll_loads(load_poll, args.load_polls_per_second))];
    if let Some(etcd) = etcd {
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        background.push(tokio::spawn(ferry_cluster::discovery::etcd::watch(etcd, tx)));
        background.push(tokio::spawn(Arc::clone(&registry).follow(rx)));
    }
    let (listener, grpc_addr) = bind_grpc(args.grpc_addr).await?;
    let (trigger, shutdown) = Shutdown::new();
    let shutdown_http = shutdown.clone();
    let (metrics_addr, metrics_task) = ferry_cluster::exporter::serve(args.metrics_addr, shutdown.clone())
        .await
        .map_err(|source| StartError::Io { what: "metrics address", source })?;
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<pb::router_server::RouterServer<RouterSvc>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ferry_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(StartError::config)?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ferry_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(StartError::config)?;
    let mut server = tonic::transport::Server::builder();
    if let Some(t) = &tls {
        server = server.tls_config(t.grpc()).map_err(|e| StartError::Config(format!("TLS: {e}")))?;
    }
    let router = server.add_service(health_svc).add_service(reflection).add_service(reflection_alpha).add_service(
        pb::router_server::RouterServer::with_interceptor(RouterSvc(Arc::clone(&ctx)), {
            let ctx = Arc::clone(&ctx);
            move |req: tonic::Request<()>| {
                let h = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
                if ctx.authorized(h) {
                    Ok(req)
                } else {
                    Err(tonic::Status::unauthenticated("a valid API key is required: authorization: Bearer <key>"))
                }
            }
        }),
    );
    let grpc_task = tokio::spawn(async move {
        let incoming = ferry_cluster::accept::incoming(listener);
        if let Err(e) = router.serve_with_incoming_shutdown(incoming, shutdown.wait()).await {
            tracing::error!(error = %e, "router gRPC server failed");
        }
    });
    let http = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|source| StartError::Io { what: "HTTP address", source })?;
    let http_addr = http.local_addr().map_err(|source| StartError::Io { what: "HTTP address", source })?;
    let app = openai::routes(Arc::clone(&ctx));
    let stop = shutdown_http;
    let http_task = match &tls {
        None => tokio::spawn(async move {
            let http = axum::serve::ListenerExt::tap_io(http, |tcp| ferry_cluster::accept::nodelay(tcp));
            if let Err(e) = axum::serve(http, app).with_graceful_shutdown(stop.wait()).await {
                tracing::error!(error = %e, "router HTTP server failed");
            }
        }),
        Some(t) => {
            let l = t.http_listener(http).map_err(|e| StartError::Config(format!("TLS: {e}")))?;
            tokio::spawn(async move {
                if let Err(e) = axum::serve(l, app).with_graceful_shutdown(stop.wait()).await {
                    tracing::error!(error = %e, "router HTTPS server failed");
                }
            })
        }
    };
    tracing::info!(%grpc_addr, %http_addr, %metrics_addr, tls = tls.is_some(), ?registry, "router up");
    Ok(Running {
        grpc_addr,
        http_addr,
        metrics_addr,
        ctx,
        trigger,
        tasks: vec![grpc_task, http_task, metrics_task],
        background,
    })
}

/// Runs the router until `shutdown` resolves.
pub async fn run(config: RouterConfig, shutdown: impl std::future::Future<Output = ()>) -> Result<(), StartError> {
    ferry_cluster::daemon::serve_until(start_checked(config).await?, shutdown, Running::stop).await;
    Ok(())
}
