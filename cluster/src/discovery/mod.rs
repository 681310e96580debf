//! Discovery: who the cluster's workers are.
//!
//! - Static: the workers named on the command line or in a file, for one machine or a fixed
//!   fleet. Each entry is `ADDR` or `ID=ADDR`, where `ADDR` is the worker's gRPC `host:port`; a
//!   file holds one `prefill ENTRY` or `decode ENTRY` per line (`#` starts a comment).
//! - [`etcd`]: workers register under a lease they keep alive; routers watch. [`etcd_access`]:
//!   TLS and authentication towards etcd.

pub mod etcd;
pub mod etcd_access;

use std::collections::HashSet;

/// A worker's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prefill worker.
    Prefill,
    /// Decode worker.
    Decode,
}

impl Role {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// The role named `s` (`prefill` or `decode`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            _ => None,
        }
    }
}

/// One worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    /// Its id (given, or `<role>-<addr>`).
    pub id: crate::WorkerId,
    /// Its role.
    pub role: Role,
    /// Its gRPC address, `host:port`.
    pub addr: String,
}

/// A bad entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("discovery: {0}")]
pub struct DiscoveryError(pub String);

/// A fixed list of workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StaticDiscovery {
    workers: Vec<Worker>,
}

/// One `ADDR` or `ID=ADDR` entry of `role`.
pub fn parse_entry(role: Role, s: &str) -> Result<Worker, DiscoveryError> {
    let s = s.trim();
    let (id, addr) = match s.split_once('=') {
        Some((id, addr)) => (id.trim().to_string(), addr.trim()),
        None => (format!("{}-{s}", role.as_str()), s),
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| DiscoveryError(format!("{s:?}: expected host:port")))?;
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(DiscoveryError(format!("{s:?}: expected host:port with a port in 1..=65535")));
    }
    let id = id.parse().map_err(|e| DiscoveryError(format!("{s:?}: {e}")))?;
    Ok(Worker { id, role, addr: addr.to_string() })
}

impl StaticDiscovery {
    /// Workers from `--prefill` and `--decode` entries.
    pub fn from_flags(prefill: &[String], decode: &[String]) -> Result<Self, DiscoveryError> {
        let mut workers = Vec::new();
        for p in prefill {
            workers.push(parse_entry(Role::Prefill, p)?);
        }
        for d in decode {
            workers.push(parse_entry(Role::Decode, d)?);
        }
        Self::checked(workers)
    }

    /// Workers from a file's text (`prefill ENTRY` / `decode ENTRY` lines).
    pub fn parse(text: &str) -> Result<Self, DiscoveryError> {
        let mut workers = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let (role, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
            let role =
                Role::parse(role).ok_or_else(|| DiscoveryError(format!("line {}: unknown role {role:?}", n + 1)))?;
            workers.push(parse_entry(role, rest).map_err(|e| DiscoveryError(format!("line {}: {}", n + 1, e.0)))?);
        }
        Self::checked(workers)
    }

    fn checked(workers: Vec<Worker>) -> Result<Self, DiscoveryError> {
        let mut ids = HashSet::new();
        for w in &workers {
            if !ids.insert(&w.id) {
                return Err(DiscoveryError(format!("worker id {:?} appears twice", w.id.as_str())));
            }
        }
        Ok(Self { workers })
    }

    /// The workers of `role`.
    pub fn workers(&self, role: Role) -> impl Iterator<Item = &Worker> {
        self.workers.iter().filter(move |w| w.role == role)
    }

    /// Every worker.
    pub fn all(&self) -> &[Worker] {
        &self.workers
    }

    /// These workers and `more`'s (ids must stay unique).
    pub fn merged(&self, more: &Self) -> Result<Self, DiscoveryError> {
        Self::checked(self.workers.iter().chain(&more.workers).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_files_name_the_same_workers() {
        let f = StaticDiscovery::from_flags(
            &["p0=10.0.0.1:7000".into(), "10.0.0.2:7000".into()],
            &["d0=[::1]:7100".into()],
        )
        .expect("valid");
        let text = "# a fleet\nprefill p0=10.0.0.1:7000\nprefill 10.0.0.2:7000  # second\n\ndecode d0=[::1]:7100\n";
        assert_eq!(StaticDiscovery::parse(text).expect("valid"), f);
        assert_eq!(
            f.workers(Role::Prefill).map(|w| w.id.as_str()).collect::<Vec<_>>(),
            ["p0", "prefill-10.0.0.2:7000"]
        );
        assert_eq!(f.workers(Role::Decode).next().map(|w| w.addr.as_str()), Some("[::1]:7100"));
    }

    #[test]
    fn bad_entries_say_what_is_wrong() {
        for (bad, why) in
            [("localhost", "host:port"), ("h:0", "port"), (":80", "host:port"), ("=h:1", "1 to 128 bytes")]
        {
            let e = StaticDiscovery::from_flags(&[bad.into()], &[]).expect_err(bad);
            assert!(e.0.contains(why), "{bad}: {e}");
        }
        let e = StaticDiscovery::parse("router r=h:1").expect_err("role");
        assert!(e.0.contains("line 1: unknown role"), "{e}");
        let e = StaticDiscovery::from_flags(&["a=h:1".into()], &["a=h:2".into()]).expect_err("dup");
        assert!(e.0.contains("twice"), "{e}");
    }
}
