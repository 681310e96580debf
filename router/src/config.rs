//! The router's flags, checked before anything is loaded or bound ([`RouterArgs::check`]):
//! the workers named, etcd's settings, times as durations, the certificates read.

use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::daemon::StartError;
use ferry_cluster::discovery::etcd::EtcdConfig;
use ferry_cluster::discovery::{Role, StaticDiscovery};
use ferry_cluster::mtls::InternalTls;

use crate::RouterArgs;
use crate::tls::Tls;

/// A router's flags, checked: [`crate::run`] and [`crate::start_checked`] take this.
#[derive(Clone)]
pub struct RouterConfig {
    /// The flags as given (each value in range).
    pub args: RouterArgs,
    /// The workers `--prefill`, `--decode` and `--workers-file` name.
    pub workers: StaticDiscovery,
    /// Where to discover workers (None: no `--etcd`).
    pub etcd: Option<EtcdConfig>,
    /// `--queue-timeout`.
    pub queue_timeout: Duration,
    /// `--load-poll`.
    pub load_poll: Duration,
    /// The public endpoints' TLS (`--tls-cert`, `--tls-key`).
    pub(crate) tls: Option<Tls>,
    /// Mutual TLS towards the workers (None: `--insecure-internal`).
    pub internal_tls: Option<Arc<InternalTls>>,
}

impl std::fmt::Debug for RouterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterConfig")
            .field("args", &self.args)
            .field("workers", &self.workers)
            .field("etcd", &self.etcd)
            .field("queue_timeout", &self.queue_timeout)
            .field("load_poll", &self.load_poll)
            .field("tls", &self.tls.is_some())
            .field("mutual_tls", &self.internal_tls.is_some())
            .finish()
    }
}

impl RouterArgs {
    /// Checks every flag before anything is loaded or bound: the config the router starts
    /// from, or an error naming the flag.
    pub fn check(&self) -> Result<RouterConfig, StartError> {
        let mut workers = StaticDiscovery::from_flags(&self.prefill, &self.decode).map_err(StartError::config)?;
        if let Some(f) = &self.workers_file {
            let text = std::fs::read_to_string(f).map_err(|source| StartError::Io { what: "workers file", source })?;
            let more = StaticDiscovery::parse(&text).map_err(StartError::config)?;
            workers = workers.merged(&more).map_err(StartError::config)?;
        }
        let etcd = self.etcd.config()?;
        if etcd.is_none() && workers.workers(Role::Decode).next().is_none() {
            return Err(StartError::Config("no decode worker: pass --decode ADDR (or --etcd)".into()));
        }
        let seconds = |flag, v| ferry_cluster::args::seconds(flag, v).map_err(StartError::from);
        let (queue_timeout, load_poll) =
            (seconds("queue-timeout", self.queue_timeout)?, seconds("load-poll", self.load_poll)?);
        let rate = self.load_polls_per_second;
        if !(rate.is_finite() && rate > 0.0) {
            return Err(StartError::Config(format!("--load-polls-per-second {rate}: give a number above 0")));
        }
        let cost = self.decode_request_tokens;
        if !(cost.is_finite() && cost >= 0.0) {
            return Err(StartError::Config(format!(
                "--decode-request-tokens {cost}: give a number of tokens, 0 or more"
            )));
        }
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some(Tls::load(c, k).map_err(|e| StartError::Config(format!("TLS: {e}")))?),
            (None, None) => None,
            _ => return Err(StartError::Config("--tls-cert and --tls-key go together".into())),
        };
        let internal_tls = InternalTls::load(&self.internal_tls).map_err(StartError::config)?;
        Ok(RouterConfig { args: self.clone(), workers, etcd, queue_timeout, load_poll, tls, internal_tls })
    }
}
