//! etcd discovery (DESIGN.md §7).
//!
//! A worker registers `/ferry/<cluster>/<role>/<id>` → `{"addr":"host:port"}` under a lease of
//! a few seconds and keeps the lease alive; a graceful stop deletes the key and revokes the
//! lease (the worker leaves at once), a killed worker's lease expires (it leaves after the TTL). If the lease is lost — etcd
//! was unreachable for longer than the TTL — the worker grants a new one and registers again.
//!
//! A router lists the prefix, learns the store's revision, and watches the prefix from the next
//! revision. When the watch breaks (etcd restarted, a network cut) it resumes from the revision
//! after the last event it applied, so no change is missed; if that revision was compacted away
//! it lists again. Each (re)list is delivered as one [`Change::Reset`] with the whole set.

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::etcd_access::EtcdAccess;
use super::{Role, Worker};

/// How often an etcd connection with a stream open is pinged: well above etcd's default
/// `--grpc-keepalive-min-time` of 5 s.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Where etcd is and which cluster's keys to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client endpoints, `http://host:port` or `host:port`.
    pub endpoints: Vec<String>,
    /// The cluster's name: its keys live under `/ferry/<cluster>/`.
    pub cluster: String,
    /// TLS and authentication (default: plaintext, none).
    pub access: EtcdAccess,
}

/// An etcd failure or a bad key.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The client failed (unreachable, refused, timed out).
    #[error("etcd: {0}")]
    Client(#[from] etcd_client::Error),
    /// The client failed in a way that points at the access flags: which, and etcd's words.
    #[error("etcd: {hint}: {source}")]
    Access {
        /// What the failure likely means, naming the flags to look at.
        hint: &'static str,
        /// The client's error.
        source: etcd_client::Error,
    },
    /// A bad configuration or an unreadable entry.
    #[error("etcd: {0}")]
    Invalid(String),
}

impl EtcdConfig {
    /// Checks the cluster name (it becomes part of every key).
    pub fn new(endpoints: Vec<String>, cluster: impl Into<String>) -> Result<Self, EtcdError> {
        let cluster = cluster.into();
        let ok = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
        if cluster.is_empty() || !cluster.chars().all(ok) {
            return Err(EtcdError::Invalid(format!("cluster name {cluster:?}: use letters, digits, '-', '_', '.'")));
        }
        if endpoints.is_empty() {
            return Err(EtcdError::Invalid("no etcd endpoint".into()));
        }
        Ok(Self { endpoints, cluster, access: EtcdAccess::default() })
    }

    /// With TLS and authentication `access`: every endpoint's scheme must match its TLS mode.
    pub fn with_access(mut self, access: EtcdAccess) -> Result<Self, EtcdError> {
        for e in &self.endpoints {
            access.check_endpoint(e)?;
        }
        access.check_password_route(&self.endpoints)?;
        self.access = access;
        Ok(self)
    }

    /// The prefix under which this cluster's workers register.
    pub fn prefix(&self) -> String {
        format!("/ferry/{}/", self.cluster)
    }

    /// A worker's key.
    pub fn key(&self, role: Role, id: &str) -> String {
        format!("{}{}/{id}", self.prefix(), role.as_str())
    }

    async fn connect(&self) -> Result<Client, EtcdError> {
        // HTTP/2 pings find a silently dead connection (a partition; a killed etcd resets it).
        // etcd refuses pings closer than `--grpc-keepalive-min-time` (5 s by default), and any
        // ping on a connection with no stream open: after three it closes the connection
        // ("too_many_pings"). Pinging every 2 s, even while idle, broke a router's quiet watch
        // stream every few seconds (a lease stream, busy with renewals, was spared: etcd's
        // answers reset its count).
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(KEEP_ALIVE_INTERVAL, Duration::from_secs(5))
            .with_keep_alive_while_idle(false);
        Ok(Client::connect(&self.endpoints, Some(self.access.apply(opts))).await?)
    }

    /// The worker a key and value describe.
    fn parse(&self, key: &[u8], value: &[u8]) -> Result<Worker, EtcdError> {
        let (role, id) = self.parse_key(key)?;
        let v: serde_json::Value = serde_json::from_slice(value)
            .map_err(|e| EtcdError::Invalid(format!("{}: value is not JSON: {e}", String::from_utf8_lossy(key))))?;
        let addr = v
            .get("addr")
            .and_then(|a| a.as_str())
            .ok_or_else(|| EtcdError::Invalid(format!("{}: value has no \"addr\"", String::from_utf8_lossy(key))))?;
        let w = super::parse_entry(role, &format!("{id}={addr}")).map_err(|e| EtcdError::Invalid(e.to_string()))?;
        Ok(w)
    }

    fn parse_key(&self, key: &[u8]) -> Result<(Role, crate::WorkerId), EtcdError> {
        let k = std::str::from_utf8(key).map_err(|_| EtcdError::Invalid("a key is not UTF-8".into()))?;
        let bad = || EtcdError::Invalid(format!("{k}: expected {}<role>/<id>", self.prefix()));
        let rest = k.strip_prefix(&self.prefix()).ok_or_else(bad)?;
        let (role, id) = rest.split_once('/').ok_or_else(bad)?;
        let role = Role::parse(role).ok_or_else(bad)?;
        if id.contains('/') {
            return Err(bad());
        }
        Ok((role, id.parse().map_err(|_| bad())?))
    }
}

/// A worker's registration: kept alive until [`leave`](Self::leave) or drop.
#[derive(Debug)]
pub struct Registration {
    key: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Registration {
    /// The registered key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Deletes the key and revokes the lease (the worker leaves at once), and stops keeping it
    /// alive.
    pub async fn leave(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let abort = self.task.abort_handle();
        if tokio::time::timeout(Duration::from_secs(3), &mut self.task).await.is_err() {
            abort.abort();
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Not left: stop renewing; the lease expires after its TTL.
        self.task.abort();
    }
}

/// Registers `w` under a lease of `ttl` seconds and keeps it alive in the background. Fails
/// when etcd cannot be reached now.
pub async fn register(cfg: &EtcdConfig, w: &Worker, ttl: i64) -> Result<Registration, EtcdError> {
    let ttl = ttl.max(2);
    let key = cfg.key(w.role, w.id.as_str());
    let value = serde_json::json!({ "addr": w.addr }).to_string();
    let first = async {
        let mut client = cfg.connect().await?;
        let lease = put_leased(&mut client, &key, &value, ttl).await?;
        Ok((client, lease))
    };
    let (client, lease) = first.await.map_err(|e| cfg.access.explain(e))?;
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(keep_alive(cfg.clone(), key.clone(), value, ttl, client, lease, stopped));
    tracing::info!(%key, lease, ttl, "registered in etcd");
    Ok(Registration { key, stop: Some(stop), task })
}

async fn put_leased(client: &mut Client, key: &str, value: &str, ttl: i64) -> Result<i64, EtcdError> {
    let lease = client.lease_grant(ttl, None).await?.id();
    client.put(key, value, Some(PutOptions::new().with_lease(lease))).await?;
    Ok(lease)
}

/// Renews `lease` every third of its TTL until `stopped`, then revokes it. A lost lease or
/// connection is replaced: reconnect, grant, put again.
async fn keep_alive(
    cfg: EtcdConfig,
    key: String,
    value: String,
    ttl: i64,
    mut client: Client,
    mut lease: i64,
    mut stopped: oneshot::Receiver<()>,
) {
    let every = Duration::from_millis((ttl as u64 * 1000 / 3).max(300));
    loop {
        let mut renewer = client.clone();
        let renewing = async move {
            let (mut keeper, mut acks) = match renewer.lease_keep_alive(lease).await {
                Ok(k) => k,
                Err(e) => return EtcdError::from(e),
            };
            loop {
                if let Err(e) = keeper.keep_alive().await {
                    return e.into();
                }
                match acks.message().await {
                    Ok(Some(a)) if a.ttl() > 0 => {}
                    Ok(_) => return EtcdError::Invalid(format!("lease {lease:x} expired")),
                    Err(e) => return e.into(),
                }
                tokio::time::sleep(every).await;
            }
        };
        let why = tokio::select! {
            _ = &mut stopped => {
                match leave_now(&mut client, &key, lease).await {
                    Ok(()) => tracing::info!(%key, "left etcd"),
                    Err(e) => tracing::warn!(%key, error = %e, "could not leave etcd; the lease will expire"),
                }
                return;
            }
            e = renewing => e,
        };
        metrics::counter!(crate::metrics::ETCD_RECONNECTS, "stream" => "lease").increment(1);
        tracing::warn!(%key, error = %why, "etcd lease lost; registering again");
        loop {
            tokio::select! {
                _ = &mut stopped => return,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            let again = async {
                let mut c = cfg.connect().await?;
                let l = put_leased(&mut c, &key, &value, ttl).await?;
                Ok::<_, EtcdError>((c, l))
            };
            match again.await {
                Ok((c, l)) => {
                    (client, lease) = (c, l);
                    tracing::info!(%key, lease, "registered in etcd again");
                    break;
                }
                Err(e) => tracing::debug!(%key, error = %e, "etcd still unreachable"),
            }
        }
    }
}

/// Deletes `key` if `lease` still holds it (another registration under the same id keeps
/// its key), then revokes `lease`. The key goes first, by a KV call: etcd-client sends Lease
/// calls without the auth token, so under etcd's authentication `LeaseRevoke` is refused
/// ("user name is empty") and the worker would stay listed until the lease expired. An
/// expired token (etcd's simple tokens lapse; the keep-alive stream does not renew one) is
/// renewed once. The revoke is then best effort.
async fn leave_now(client: &mut Client, key: &str, lease: i64) -> Result<(), EtcdError> {
    let ours = || Txn::new().when([Compare::lease(key, CompareOp::Equal, lease)]).and_then([TxnOp::delete(key, None)]);
    if client.txn(ours()).await.is_err() {
        client.refresh_token().await?;
        client.txn(ours()).await?;
    }
    let _ = client.lease_revoke(lease).await;
    Ok(())
}

/// A change in the set of workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The whole set, after a (re)list.
    Reset(Vec<Worker>),
    /// A worker joined or changed its address.
    Put(Worker),
    /// A worker left (or its lease expired).
    Delete {
        /// Its role.
        role: Role,
        /// Its id.
        id: crate::WorkerId,
    },
}

/// Watches `cfg`'s workers forever, sending every change to `tx`; returns when `tx` closes.
pub async fn watch(cfg: EtcdConfig, tx: mpsc::Sender<Change>) {
    let mut next: Option<i64> = None;
    let mut backoff = Duration::from_millis(200);
    loop {
        match watch_once(&cfg, &tx, &mut next).await {
            Ok(()) => return,
            Err(e) => {
                metrics::counter!(crate::metrics::ETCD_RECONNECTS, "stream" => "watch").increment(1);
                tracing::warn!(error = %e, resume_at = ?next, "etcd watch broke; resuming");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// One connection's worth of watching. `next` is the first revision not yet applied (None:
/// list first). Ok: `tx` closed.
async fn watch_once(cfg: &EtcdConfig, tx: &mpsc::Sender<Change>, next: &mut Option<i64>) -> Result<(), EtcdError> {
    let mut client = cfg.connect().await?;
    let prefix = cfg.prefix();
    let from = match *next {
        Some(r) => r,
        None => {
            let listed = client.get(prefix.as_str(), Some(GetOptions::new().with_prefix())).await?;
            let revision = listed.header().map_or(0, |h| h.revision());
            let mut all = Vec::new();
            for kv in listed.kvs() {
                match cfg.parse(kv.key(), kv.value()) {
                    Ok(w) => all.push(w),
                    Err(e) => tracing::warn!(error = %e, "ignoring an etcd entry"),
                }
            }
            if tx.send(Change::Reset(all)).await.is_err() {
                return Ok(());
            }
            *next = Some(revision + 1);
            revision + 1
        }
    };
    let opts = WatchOptions::new().with_prefix().with_start_revision(from).with_progress_notify();
    let mut stream = client.watch(prefix.as_str(), Some(opts)).await?;
    while let Some(resp) = stream.message().await? {
        if resp.compact_revision() > 0 {
            *next = None;
            return Err(EtcdError::Invalid(format!("revision {from} was compacted; listing again")));
        }
        if resp.canceled() {
            return Err(EtcdError::Invalid(format!("watch canceled: {}", resp.cancel_reason())));
        }
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            let change = match ev.event_type() {
                EventType::Put => match cfg.parse(kv.key(), kv.value()) {
                    Ok(w) => Change::Put(w),
                    Err(e) => {
                        tracing::warn!(error = %e, "ignoring an etcd entry");
                        *next = Some(kv.mod_revision() + 1);
                        continue;
                    }
                },
                EventType::Delete => match cfg.parse_key(kv.key()) {
                    Ok((role, id)) => Change::Delete { role, id },
                    Err(_) => continue,
                },
            };
            if tx.send(change).await.is_err() {
                return Ok(());
            }
            *next = Some(kv.mod_revision() + 1);
        }
    }
    Err(EtcdError::Invalid("watch stream closed".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_bad_entries_are_named() {
        let c = EtcdConfig::new(vec!["127.0.0.1:2379".into()], "prod-1").expect("valid");
        let k = c.key(Role::Decode, "d0");
        assert_eq!(k, "/ferry/prod-1/decode/d0");
        let w = c.parse(k.as_bytes(), br#"{"addr":"10.0.0.1:7000"}"#).expect("valid");
        assert_eq!(w, Worker { id: "d0".parse().expect("an id"), role: Role::Decode, addr: "10.0.0.1:7000".into() });
        for (key, value, why) in [
            ("/ferry/other/decode/d0", &br#"{"addr":"h:1"}"#[..], "expected /ferry/prod-1/"),
            ("/ferry/prod-1/router/r0", br#"{"addr":"h:1"}"#, "<role>/<id>"),
            ("/ferry/prod-1/decode/", br#"{"addr":"h:1"}"#, "<role>/<id>"),
            ("/ferry/prod-1/decode/d0", b"h:1", "not JSON"),
            ("/ferry/prod-1/decode/d0", br#"{"address":"h:1"}"#, "no \"addr\""),
            ("/ferry/prod-1/decode/d0", br#"{"addr":"h"}"#, "host:port"),
        ] {
            let e = c.parse(key.as_bytes(), value).expect_err(key);
            assert!(e.to_string().contains(why), "{key}: {e}");
        }
        assert!(EtcdConfig::new(vec!["h:1".into()], "a/b").is_err());
        assert!(EtcdConfig::new(vec![], "a").is_err());
    }
}
