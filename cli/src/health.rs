//! `ferry health`: asks a daemon's gRPC health service whether it serves, over the cluster's
//! mutual TLS when its flags (or `FERRY_INTERNAL_TLS_*`) name certificates. Exits 0 when the
//! answer is SERVING; otherwise it says what it got (NOT_SERVING while the daemon stops, an
//! unknown service, no answer in time, a certificate for another role) and exits 1. Made for
//! the exec probes of pods whose daemons speak mutual TLS, which the kubelet's own gRPC probe
//! cannot.

use std::time::Duration;

use anyhow::{Context, bail};
use ferry_cluster::mtls::{InternalTls, InternalTlsArgs};
use ferry_cluster::roles::PeerRole;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

/// The role of the daemon asked.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Role {
    /// A router.
    Router,
    /// A prefill worker.
    Prefill,
    /// A decode worker.
    Decode,
}

impl From<Role> for PeerRole {
    fn from(r: Role) -> Self {
        match r {
            Role::Router => PeerRole::Router,
            Role::Prefill => PeerRole::Prefill,
            Role::Decode => PeerRole::Decode,
        }
    }
}

/// `ferry health`.
#[derive(Debug, clap::Args)]
pub struct HealthArgs {
    /// The daemon's gRPC address (`host:port`).
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub addr: String,
    /// Its role: under mutual TLS its certificate must name it.
    #[arg(long, value_enum)]
    pub role: Role,
    /// The service asked about (a full gRPC name such as `ferry.v1.Prefill`); empty: the
    /// daemon as a whole.
    #[arg(long, default_value = "")]
    pub service: String,
    /// Seconds to wait for the answer, connecting included.
    #[arg(long, default_value_t = 3.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub tls: InternalTlsArgs,
}

/// Asks; Ok when SERVING.
pub fn run(args: HealthArgs) -> anyhow::Result<()> {
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds, not {}", args.timeout);
    }
    let tls = InternalTls::load(&args.tls).context("the internal TLS flags")?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let limit = Duration::from_secs_f64(args.timeout);
    let status = rt.block_on(async {
        let channel = ferry_cluster::dial::channel(&args.addr, tls.as_deref(), args.role.into(), |ep| {
            ep.connect_timeout(limit).timeout(limit)
        })
        .map_err(anyhow::Error::msg)?;
        let mut client = HealthClient::new(channel);
        let ask = client.check(HealthCheckRequest { service: args.service.clone() });
        match tokio::time::timeout(limit, ask).await {
            Err(_) => bail!("{}: no answer within {:?}", args.addr, limit),
            Ok(Err(s)) => bail!("{}: {} ({:?})", args.addr, s.message(), s.code()),
            Ok(Ok(r)) => Ok(r.into_inner().status),
        }
    })?;
    let name = ServingStatus::try_from(status).map_or("UNKNOWN", |s| s.as_str_name());
    if status != ServingStatus::Serving as i32 {
        bail!("{}: {name}", args.addr);
    }
    println!("{name}");
    Ok(())
}
