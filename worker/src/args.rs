//! The flags both worker daemons share (each also reads an environment variable), checked
//! into the [`WorkerConfig`] a worker starts from. Worker binaries flatten [`WorkerArgs`] into
//! their own flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use ferry_cluster::args::{Announce, EtcdArgs, FlagError, defaults, seconds};
use ferry_cluster::discovery::Role;
use ferry_cluster::discovery::etcd::EtcdConfig;
use ferry_cluster::mtls::{InternalTls, InternalTlsArgs};
use ferry_transfer::BackendKind;

use crate::Device;

/// A worker's flags, checked ([`WorkerArgs::check`]): every value in range, the internal
/// certificates read, times as durations, etcd's settings parsed. A worker daemon starts from
/// this, never from unchecked flags.
#[derive(Clone)]
pub struct WorkerConfig {
    /// The flags as given (each value in range).
    pub args: WorkerArgs,
    /// Room timeouts.
    pub timeouts: ferry_transfer::room::Timeouts,
    /// Mutual TLS between the daemons (None: `--insecure-internal`).
    pub internal_tls: Option<std::sync::Arc<InternalTls>>,
    /// Where to register (None: no `--etcd`).
    pub etcd: Option<EtcdConfig>,
}

impl std::fmt::Debug for WorkerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerConfig")
            .field("args", &self.args)
            .field("timeouts", &self.timeouts)
            .field("mutual_tls", &self.internal_tls.is_some())
            .field("etcd", &self.etcd)
            .finish()
    }
}

impl WorkerConfig {
    /// What to register in etcd for this worker (None without --etcd).
    pub fn announce(
        &self,
        role: Role,
        id: &ferry_cluster::WorkerId,
        grpc_addr: SocketAddr,
    ) -> Result<Option<Announce>, FlagError> {
        let Some(etcd) = self.etcd.clone() else { return Ok(None) };
        let addr = match &self.args.advertise_addr {
            Some(a) => a.clone(),
            None if grpc_addr.ip().is_unspecified() => {
                return Err(FlagError(format!(
                    "--grpc-addr {grpc_addr} is a wildcard: pass --advertise-addr for etcd"
                )));
            }
            None => grpc_addr.to_string(),
        };
        let worker =
            ferry_cluster::discovery::parse_entry(role, &format!("{id}={addr}")).map_err(|e| FlagError(e.0))?;
        Ok(Some(Announce { etcd, worker, ttl: self.args.etcd_lease_ttl }))
    }
}

/// Element type of KV pages (`--dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Dtype {
    /// 32-bit floats: every backend's KV pages today.
    F32,
}

impl Dtype {
    /// The name in flags and in the KV layout both sides of a transfer compare.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
        }
    }
}

/// Flags shared by the prefill and decode daemons.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The model: a Hugging Face directory (config.json, safetensors, tokenizer.json) or a
    /// GGUF file.
    #[arg(long, env = ferry_cluster::env::MODEL, help_heading = "Model")]
    pub model: PathBuf,
    /// Compute device: `cpu`, `cuda` (GPU 0) or `cuda:N`. CUDA needs a build with
    /// `--features cuda` and the NVIDIA driver and CUDA 12 libraries at run time; its KV pool
    /// lives on the GPU and travels through a pinned host mirror (see --kv-host-mirror).
    #[arg(long, env = ferry_cluster::env::DEVICE, default_value = "cpu", help_heading = "Model")]
    pub device: Device,
    /// How the CPU backend multiplies activations by quantized weights (Q4_0, Q4_1, Q8_0,
    /// Q4_K, Q6_K; kept quantized in memory): `exact` (f32 activations against the weights
    /// dequantized in registers: the model's values up to summation order) or `fast`
    /// (activations quantized to 8 bits per 32-value block, integer dot products as llama.cpp
    /// does: faster decode, results within that rounding). F16/BF16 weights multiply alike in
    /// both. Prefill and decode daemons may differ. Ignored with `--device cuda`.
    #[arg(long, env = ferry_cluster::env::CPU_MATH, default_value = "exact", help_heading = "Model")]
    pub cpu_math: ferry_kernels::cpu::CpuMath,
    /// Keep a host mirror of the KV pool and copy pages across (device → host before sending,
    /// host → device once a room arrived). Always on with `--device cuda`; on the CPU it
    /// exercises that path (the pool is otherwise shared with the transfer in place).
    #[arg(long, env = ferry_cluster::env::KV_HOST_MIRROR, help_heading = "Pool")]
    pub kv_host_mirror: bool,
    /// Element type of KV pages, which must match between prefill and decode: `f32` on every
    /// backend (the CUDA backend keeps weights in bf16 and computes its GEMMs in bf16).
    #[arg(long, env = ferry_cluster::env::DTYPE, value_enum, default_value_t = Dtype::F32, help_heading = "Pool")]
    pub dtype: Dtype,
    /// Tokens per KV page. Prefill and decode nodes must agree (checked at the handshake).
    #[arg(long, env = ferry_cluster::env::PAGE_SIZE, default_value_t = 16, help_heading = "Pool")]
    pub page_size: usize,
    /// KV pages in the pool. 0: size the pool from --mem-fraction.
    #[arg(long, env = ferry_cluster::env::POOL_PAGES, default_value_t = 0, help_heading = "Pool")]
    pub pool_pages: usize,
    /// Fraction of memory given to the KV pool when --pool-pages is 0: of this machine's
    /// memory on the CPU, of the GPU's memory with `--device cuda`.
    #[arg(long, env = ferry_cluster::env::MEM_FRACTION, default_value_t = 0.1, help_heading = "Pool")]
    pub mem_fraction: f64,
    /// Prompt tokens computed per forward pass (chunked prefill); long prompts take several.
    #[arg(long, env = ferry_cluster::env::CHUNKED_PREFILL_SIZE, default_value_t = 512, help_heading = "Scheduling")]
    pub chunked_prefill_size: usize,
    /// This worker's id, in metrics, load reports and KV events. Default: `<role>-<gRPC port>`.
    #[arg(long, env = ferry_cluster::env::WORKER_ID, help_heading = "Discovery")]
    pub worker_id: Option<ferry_cluster::WorkerId>,
    /// gRPC listen address (port 0: any free port).
    #[arg(long, env = ferry_cluster::env::GRPC_ADDR, default_value = "127.0.0.1:0", help_heading = "Discovery")]
    pub grpc_addr: SocketAddr,
    /// Prometheus `/metrics` listen address (port 0: any free port).
    #[arg(long, env = ferry_cluster::env::METRICS_ADDR, default_value = "127.0.0.1:0", help_heading = "Observability")]
    pub metrics_addr: SocketAddr,
    /// KV transfer backend: `tcp`, `rdma` (needs a build with `--features rdma` and a device),
    /// `fake` (moves nothing; scheduling tests, one process only) or `auto` (rdma when a
    /// device is present, else tcp).
    #[arg(long, env = ferry_cluster::env::TRANSFER, value_enum, default_value_t = BackendKind::Tcp, help_heading = "Transfer")]
    pub transfer: BackendKind,
    /// The data-plane listen address for incoming KV pages (port 0: any): on decode nodes,
    /// prefill nodes' pages; on prefill nodes (tcp), the held pages they pull from decode nodes.
    #[arg(long, env = ferry_cluster::env::TRANSFER_ADDR, default_value = "127.0.0.1:0", help_heading = "Transfer")]
    pub transfer_addr: SocketAddr,
    /// tcp backend: connections per peer (1 to 64).
    #[arg(long, env = ferry_cluster::env::TRANSFER_CONNECTIONS, default_value_t = 4, help_heading = "Transfer",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub transfer_connections: usize,
    /// Seconds a room may wait for its other half (the request or the handshake).
    #[arg(long, env = ferry_cluster::env::BOOTSTRAP_TIMEOUT, default_value_t = 30.0, help_heading = "Timeouts")]
    pub bootstrap_timeout: f64,
    /// Seconds a room may wait for prefill to start sending (queueing and compute).
    #[arg(long, env = ferry_cluster::env::WAITING_TIMEOUT, default_value_t = 300.0, help_heading = "Timeouts")]
    pub waiting_timeout: f64,
    /// Seconds a transfer may go without progress.
    #[arg(long, env = ferry_cluster::env::TRANSFER_TIMEOUT, default_value_t = 30.0, help_heading = "Timeouts")]
    pub transfer_timeout: f64,
    /// etcd discovery: where etcd is and the cluster's name.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The gRPC `host:port` routers reach this worker at, registered in etcd. Default: the
    /// bound --grpc-addr (required when that is a wildcard such as 0.0.0.0).
    #[arg(long, env = ferry_cluster::env::ADVERTISE_ADDR, help_heading = "Discovery")]
    pub advertise_addr: Option<String>,
    /// The data-plane `host:port` peers connect to (decode nodes: sent in the handshake;
    /// prefill nodes: sent in pulls). Default: the bound --transfer-addr; when that is a wildcard, the
    /// --advertise-addr host with the bound port.
    #[arg(long, env = ferry_cluster::env::TRANSFER_ADVERTISE_ADDR, help_heading = "Transfer")]
    pub transfer_advertise_addr: Option<String>,
    /// Seconds of the worker's etcd lease: a worker that stops renewing it (killed, cut off)
    /// leaves the cluster after this long.
    #[arg(long, env = ferry_cluster::env::ETCD_LEASE_TTL, default_value_t = 5, help_heading = "Discovery")]
    pub etcd_lease_ttl: i64,
    /// Mutual TLS between daemons.
    #[command(flatten)]
    pub internal_tls: InternalTlsArgs,
    /// Span export (OTLP).
    #[command(flatten)]
    pub telemetry: ferry_cluster::telemetry::TelemetryArgs,
}

impl WorkerArgs {
    /// Defaults for `model` (tests and `ferry up` start from here): the flags' own defaults.
    pub fn for_model(model: impl Into<PathBuf>) -> Self {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            w: WorkerArgs,
        }
        defaults::<Only>(&["--model".into(), model.into().into_os_string()]).w
    }

    /// The data-plane endpoint to advertise for a receiver bound at `bound` (see
    /// --transfer-advertise-addr). Endpoints that are not socket addresses (the fake backend's)
    /// are kept.
    pub fn data_endpoint(&self, bound: &str) -> Result<String, FlagError> {
        if let Some(a) = &self.transfer_advertise_addr {
            return Ok(a.clone());
        }
        let Ok(addr) = bound.parse::<SocketAddr>() else { return Ok(bound.to_string()) };
        if !addr.ip().is_unspecified() {
            return Ok(bound.to_string());
        }
        let host = self.advertise_addr.as_deref().and_then(|a| a.rsplit_once(':')).map(|(h, _)| h);
        match host {
            Some(h) => Ok(format!("{h}:{}", addr.port())),
            None => Err(FlagError(format!(
                "--transfer-addr {bound} is a wildcard: pass --transfer-advertise-addr (or --advertise-addr)"
            ))),
        }
    }

    /// Checks every flag before anything is loaded or bound: the config a worker starts from,
    /// or an error naming the flag.
    pub fn check(&self) -> Result<WorkerConfig, FlagError> {
        let timeouts = ferry_transfer::room::Timeouts {
            bootstrap: seconds("bootstrap-timeout", self.bootstrap_timeout)?,
            waiting: seconds("waiting-timeout", self.waiting_timeout)?,
            transferring: seconds("transfer-timeout", self.transfer_timeout)?,
        };
        if self.page_size == 0 || self.chunked_prefill_size == 0 {
            return Err(FlagError("--page-size and --chunked-prefill-size must be positive".into()));
        }
        let etcd = self.etcd.config()?;
        if self.etcd_lease_ttl < 2 {
            return Err(FlagError(format!("--etcd-lease-ttl {}: at least 2 seconds", self.etcd_lease_ttl)));
        }
        if self.pool_pages == 0 && !(self.mem_fraction > 0.0 && self.mem_fraction < 1.0) {
            return Err(FlagError(format!("--mem-fraction {} must be in (0, 1)", self.mem_fraction)));
        }
        let internal_tls = InternalTls::load(&self.internal_tls).map_err(|e| FlagError(e.to_string()))?;
        Ok(WorkerConfig { args: self.clone(), timeouts, internal_tls, etcd })
    }

    /// KV pages for the pool: --pool-pages, or --mem-fraction of `device_bytes` (a GPU's
    /// memory) or, when None, of this machine's memory.
    pub fn pool_pages(&self, page_bytes: usize, device_bytes: Option<usize>) -> usize {
        if self.pool_pages > 0 {
            return self.pool_pages;
        }
        let total = device_bytes
            .map(|b| b as u64)
            .or_else(|| {
                std::fs::read_to_string("/proc/meminfo")
                    .ok()
                    .and_then(|m| {
                        m.lines()
                            .find(|l| l.starts_with("MemTotal:"))
                            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    })
                    .map(|kib| kib * 1024)
            })
            .unwrap_or(8 << 30);
        ((total as f64 * self.mem_fraction) as usize / page_bytes.max(1)).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_infinite_timeout_flag_is_refused_by_name() {
        let mut w = WorkerArgs::for_model("m.gguf");
        w.transfer_timeout = f64::INFINITY;
        assert!(w.check().expect_err("inf refused").0.contains("--transfer-timeout inf"));
    }

    #[test]
    fn advertised_addresses_replace_wildcards() {
        let mut a = WorkerArgs::for_model("m");
        assert_eq!(a.data_endpoint("127.0.0.1:7101").as_deref(), Ok("127.0.0.1:7101"));
        assert_eq!(a.data_endpoint("fake-3").as_deref(), Ok("fake-3"));
        assert!(a.data_endpoint("0.0.0.0:7101").expect_err("wildcard").0.contains("--transfer-advertise-addr"));
        a.advertise_addr = Some("10.1.2.3:7001".into());
        assert_eq!(a.data_endpoint("0.0.0.0:7101").as_deref(), Ok("10.1.2.3:7101"));
        a.transfer_advertise_addr = Some("10.9.9.9:9000".into());
        assert_eq!(a.data_endpoint("0.0.0.0:7101").as_deref(), Ok("10.9.9.9:9000"));

        let wild: SocketAddr = "0.0.0.0:7001".parse().expect("addr");
        let p0: ferry_cluster::WorkerId = "p0".parse().expect("an id");
        let mut b = WorkerArgs::for_model("m");
        b.internal_tls = InternalTlsArgs::insecure();
        assert!(b.check().expect("valid flags").announce(Role::Prefill, &p0, wild).expect("no etcd").is_none());
        b.etcd.endpoints = vec!["127.0.0.1:2379".into()];
        assert!(
            b.check()
                .expect("valid flags")
                .announce(Role::Prefill, &p0, wild)
                .expect_err("wildcard")
                .0
                .contains("--advertise-addr")
        );
        b.advertise_addr = Some("10.1.2.3:7001".into());
        let a = b.check().expect("valid flags").announce(Role::Prefill, &p0, wild).expect("valid").expect("etcd");
        assert_eq!(
            (a.worker.addr.as_str(), a.etcd.key(a.worker.role, a.worker.id.as_str())),
            ("10.1.2.3:7001", "/ferry/default/prefill/p0".to_string())
        );
    }

    #[derive(clap::Parser)]
    struct Only {
        #[command(flatten)]
        w: WorkerArgs,
    }

    /// Issue 18: a choice flag with a value it does not know fails as the flags are parsed,
    /// naming the flag and listing the choices (before: a string, refused at start or not at
    /// all).
    #[test]
    fn choice_flags_refuse_unknown_values_at_parse_time_listing_the_choices() {
        use clap::Parser as _;
        let parse = |extra: &[&str]| {
            let argv = ["ferry", "--model", "m.gguf"].iter().chain(extra).copied().collect::<Vec<_>>();
            Only::try_parse_from(argv).map(|o| o.w)
        };
        let e = parse(&["--transfer", "quic"]).expect_err("unknown backend").to_string();
        assert!(e.contains("--transfer") && e.contains("tcp, rdma, fake, auto"), "{e}");
        let e = parse(&["--dtype", "bf16"]).expect_err("unknown dtype").to_string();
        assert!(e.contains("--dtype") && e.contains("f32"), "{e}");
        let e = parse(&["--device", "tpu"]).expect_err("unknown device").to_string();
        assert!(e.contains("--device") && e.contains("use cpu, cuda or cuda:N"), "{e}");
        let w = parse(&["--transfer", "rdma", "--device", "cuda:1"]).expect("valid");
        assert_eq!((w.transfer, w.device), (BackendKind::Rdma, Device::Cuda(1)));
        // The defaults are the attributes' own.
        let d = WorkerArgs::for_model("m.gguf");
        assert_eq!((d.transfer, d.device, d.dtype, d.page_size), (BackendKind::Tcp, Device::Cpu, Dtype::F32, 16));
    }
}
