//! Flag helpers every daemon shares: timeouts as durations ([`seconds`]), a daemon's flags
//! at their defaults ([`defaults`]), etcd's flags ([`EtcdArgs`]) and a worker's registration
//! ([`Announce`]). The worker daemons' own shared flags are `ferry_worker::WorkerArgs`.

use std::path::PathBuf;
use std::time::Duration;

use crate::discovery::etcd::EtcdConfig;
use crate::discovery::etcd_access::EtcdAccess;

/// A worker's etcd registration, made once it serves.
#[derive(Debug, Clone)]
pub struct Announce {
    /// Where and under which cluster.
    pub etcd: EtcdConfig,
    /// Its id, role and advertised address.
    pub worker: crate::discovery::Worker,
    /// Lease seconds.
    pub ttl: i64,
}

/// A flag whose value a daemon cannot start with; the message names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FlagError(pub String);

/// The longest timeout a flag may set, in seconds (a year: longer ones overflow timers).
pub const MAX_TIMEOUT_SECS: f64 = 365.0 * 86_400.0;

/// A timeout flag's value as a duration: a number of seconds above 0 and at most
/// [`MAX_TIMEOUT_SECS`] (below a millisecond counts as one); an error names `--flag` for
/// anything else (0, negative, `inf`, `nan`: `Duration::from_secs_f64` panics on some).
pub fn seconds(flag: &str, v: f64) -> Result<Duration, FlagError> {
    if !(v > 0.0 && v <= MAX_TIMEOUT_SECS) {
        return Err(FlagError(format!(
            "--{flag} {v}: give a number of seconds above 0 and at most {MAX_TIMEOUT_SECS}"
        )));
    }
    Ok(Duration::from_secs_f64(v.max(0.001)))
}

/// A daemon's flags at their defaults, with only `required` given (`["--model", path]`) and
/// every environment variable ignored: the defaults are written once, in the `#[arg]`
/// attributes, and tests and `ferry up` start from them. Panics when `required` is not enough
/// to parse (a programming error: a new required flag).
pub fn defaults<P: clap::Parser>(required: &[std::ffi::OsString]) -> P {
    let cmd = P::command().mut_args(|a| a.env(None::<&str>));
    let argv = std::iter::once(std::ffi::OsString::from("ferry")).chain(required.iter().cloned());
    let m = cmd.try_get_matches_from(argv).unwrap_or_else(|e| panic!("a daemon's defaults do not parse: {e}"));
    P::from_arg_matches(&m).unwrap_or_else(|e| panic!("a daemon's defaults do not parse: {e}"))
}

/// etcd discovery flags, shared by workers (which register) and routers (which watch).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EtcdArgs {
    /// etcd client endpoints (`host:port` or `http://host:port`, comma-separated). Unset: no
    /// etcd; workers are named statically to the router.
    #[arg(long = "etcd", env = ferry_core::env::ETCD, value_delimiter = ',', help_heading = "Discovery")]
    pub endpoints: Vec<String>,
    /// The cluster's name; its workers register under `/ferry/<cluster>/<role>/<id>`.
    #[arg(long, env = ferry_core::env::CLUSTER, default_value = "default", help_heading = "Discovery")]
    pub cluster: String,
    /// PEM CA certificate(s) etcd's server certificate must chain to: turns on TLS to etcd
    /// (endpoints `host:port` or `https://`; `http://` is refused).
    #[arg(long, env = ferry_core::env::ETCD_CA, help_heading = "Discovery")]
    pub etcd_ca: Option<PathBuf>,
    /// PEM client certificate presented to etcd (its `--client-cert-auth`); needs --etcd-key
    /// and --etcd-ca.
    #[arg(long, env = ferry_core::env::ETCD_CERT, requires_all = ["etcd_key", "etcd_ca"], help_heading = "Discovery")]
    pub etcd_cert: Option<PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, env = ferry_core::env::ETCD_KEY, requires = "etcd_cert", help_heading = "Discovery")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd's role-based access control); its password in --etcd-password-file.
    #[arg(long, env = ferry_core::env::ETCD_USER, requires = "etcd_password_file", help_heading = "Discovery")]
    pub etcd_user: Option<String>,
    /// A file whose first line is --etcd-user's password (a file, so the password shows in
    /// neither `ps` nor the environment).
    #[arg(long, env = ferry_core::env::ETCD_PASSWORD_FILE, requires = "etcd_user", help_heading = "Discovery")]
    pub etcd_password_file: Option<PathBuf>,
}

impl EtcdArgs {
    /// The etcd configuration, when endpoints are given: TLS and user files read, endpoint
    /// schemes checked against the TLS mode.
    pub fn config(&self) -> Result<Option<EtcdConfig>, FlagError> {
        if self.endpoints.is_empty() {
            return Ok(None);
        }
        let access = EtcdAccess::load(
            self.etcd_ca.as_deref(),
            self.etcd_cert.as_deref().zip(self.etcd_key.as_deref()),
            self.etcd_user.as_deref().zip(self.etcd_password_file.as_deref()),
        )
        .map_err(|e| FlagError(e.to_string()))?;
        EtcdConfig::new(self.endpoints.clone(), self.cluster.clone())
            .and_then(|c| c.with_access(access))
            .map(Some)
            .map_err(|e| FlagError(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_flag_is_a_positive_finite_number_of_seconds() {
        assert_eq!(seconds("x-timeout", 1.5), Ok(Duration::from_millis(1500)));
        assert_eq!(seconds("x-timeout", 1e-9), Ok(Duration::from_millis(1)), "below a millisecond counts as one");
        for bad in [0.0, -1.0, f64::INFINITY, f64::NAN, MAX_TIMEOUT_SECS * 2.0] {
            let e = seconds("x-timeout", bad).expect_err("refused").to_string();
            assert!(e.starts_with("--x-timeout "), "{e}");
        }
    }
}
