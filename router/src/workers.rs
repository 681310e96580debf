//! The workers a router knows: their gRPC channels, health (a circuit breaker fed by load
//! polls and calls), last load report; and the tasks that keep them current — a load poll
//! every `poll` interval and, for each prefill worker, a KV event subscription feeding the
//! prefix index (resubscribing with a snapshot after any gap, epoch change or error).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_cluster::discovery::{Role, StaticDiscovery};
use ferry_proto::v1 as pb;
use tonic::transport::{Channel, Endpoint};

use crate::index::PrefixIndex;

/// Consecutive failures that open a worker's circuit.
const TRIP_AFTER: u32 = 3;
/// How long an open circuit keeps a worker out of placement.
const OPEN_FOR: Duration = Duration::from_secs(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[derive(Debug, Default)]
struct Health {
    failures: u32,
    open_until: Option<Instant>,
    load: Option<pb::LoadReport>,
    seen: bool,
}

/// One worker.
#[derive(Debug)]
pub struct Worker {
    /// Its id.
    pub id: String,
    /// Its role.
    pub role: Role,
    /// Its gRPC address.
    pub addr: String,
    /// A lazily connected channel.
    pub channel: Channel,
    health: Mutex<Health>,
}

impl Worker {
    /// Reachable recently and not tripped.
    pub fn healthy(&self) -> bool {
        let h = lock(&self.health);
        h.seen && h.open_until.is_none_or(|t| Instant::now() >= t)
    }

    /// Its last load report.
    pub fn load(&self) -> Option<pb::LoadReport> {
        lock(&self.health).load.clone()
    }

    /// A call to it succeeded.
    pub fn ok(&self) {
        let mut h = lock(&self.health);
        h.failures = 0;
        h.open_until = None;
        h.seen = true;
    }

    /// A call to it failed; returns true when this opened its circuit.
    pub fn failed(&self) -> bool {
        let mut h = lock(&self.health);
        h.failures += 1;
        if h.failures >= TRIP_AFTER && h.open_until.is_none_or(|t| Instant::now() >= t) {
            h.open_until = Some(Instant::now() + OPEN_FOR);
            return true;
        }
        false
    }
}

/// All workers, prefill ones in index slot order.
#[derive(Debug)]
pub struct Registry {
    /// Prefill workers; a worker's position is its slot in the prefix index.
    pub prefill: Vec<Arc<Worker>>,
    /// Decode workers.
    pub decode: Vec<Arc<Worker>>,
}

fn channel(addr: &str) -> Result<Channel, String> {
    let uri = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
    let ep = Endpoint::from_shared(uri).map_err(|e| format!("{addr}: {e}"))?;
    Ok(ep.connect_timeout(Duration::from_secs(2)).timeout(Duration::from_secs(600)).connect_lazy())
}

impl Registry {
    /// The workers `d` names (at most [`crate::index::MAX_WORKERS`] prefill workers).
    pub fn new(d: &StaticDiscovery) -> Result<Self, String> {
        let make = |role: Role| -> Result<Vec<Arc<Worker>>, String> {
            d.workers(role)
                .map(|w| {
                    Ok(Arc::new(Worker {
                        id: w.id.clone(),
                        role,
                        addr: w.addr.clone(),
                        channel: channel(&w.addr)?,
                        health: Mutex::new(Health::default()),
                    }))
                })
                .collect()
        };
        let prefill = make(Role::Prefill)?;
        if prefill.len() > crate::index::MAX_WORKERS {
            return Err(format!(
                "{} prefill workers; a router tracks at most {}",
                prefill.len(),
                crate::index::MAX_WORKERS
            ));
        }
        Ok(Self { prefill, decode: make(Role::Decode)? })
    }

    /// Polls every worker's load every `every`, forever. A prefill worker whose circuit opens
    /// loses its entries in `index` (its event stream resyncs them when it is back).
    pub async fn poll_loads(self: Arc<Self>, every: Duration, index: Arc<Mutex<PrefixIndex>>) {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let slots = (0..self.prefill.len()).map(Some).chain(self.decode.iter().map(|_| None));
            let all = self.prefill.iter().chain(&self.decode).cloned().zip(slots);
            let polls = all.map(|(w, slot)| {
                let index = Arc::clone(&index);
                async move {
                    let mut c = pb::load_client::LoadClient::new(w.channel.clone());
                    match tokio::time::timeout(Duration::from_secs(1), c.report(pb::LoadRequest {})).await {
                        Ok(Ok(r)) => {
                            lock(&w.health).load = Some(r.into_inner());
                            w.ok();
                        }
                        _ => {
                            if w.failed() {
                                tracing::warn!(worker = %w.id, "worker unreachable: taken out of placement");
                                if let Some(slot) = slot {
                                    let _ = lock(&index).clear_worker(slot);
                                }
                            }
                        }
                    }
                }
            });
            futures::future::join_all(polls).await;
        }
    }
}

/// Keeps `index` fed with prefill worker `slot`'s KV events, forever: subscribes with a
/// snapshot, applies batches in sequence, and on any gap, epoch change or error forgets the
/// worker's entries and resubscribes.
pub async fn follow_events(w: Arc<Worker>, slot: usize, index: Arc<Mutex<PrefixIndex>>) {
    loop {
        if let Err(why) = follow_once(&w, slot, &index).await {
            tracing::debug!(worker = %w.id, %why, "KV event stream ended; resyncing");
        }
        let _ = lock(&index).clear_worker(slot);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn follow_once(w: &Worker, slot: usize, index: &Mutex<PrefixIndex>) -> Result<(), String> {
    let mut c = pb::kv_events_client::KvEventsClient::new(w.channel.clone());
    let req = pb::SubscribeRequest { epoch: 0, after_sequence: 0, want_snapshot: true };
    let mut stream = c.subscribe(req).await.map_err(|s| s.to_string())?.into_inner();
    let mut at: Option<(u64, u64)> = None; // (epoch, last sequence)
    while let Some(batch) = stream.message().await.map_err(|s| s.to_string())? {
        let mut ix = lock(index);
        for e in batch.events {
            let fresh = match (at, &e.kind) {
                (_, Some(pb::kv_event::Kind::Snapshot(_))) => true,
                (Some((epoch, seq)), _) => epoch == batch.epoch && e.sequence == seq + 1,
                (None, _) => false,
            };
            if !fresh {
                return Err(format!("gap: {:?} then {} in epoch {}", at, e.sequence, batch.epoch));
            }
            at = Some((batch.epoch, e.sequence));
            apply(&mut ix, slot, e.kind).map_err(|x| x.to_string())?;
        }
    }
    Err("stream closed".into())
}

fn apply(ix: &mut PrefixIndex, slot: usize, kind: Option<pb::kv_event::Kind>) -> Result<(), crate::index::IndexError> {
    match kind {
        Some(pb::kv_event::Kind::Stored(s)) => ix.stored(slot, s.parent_hash, &s.page_hashes, &s.token_ids),
        Some(pb::kv_event::Kind::Removed(r)) => ix.removed(slot, &r.page_hashes),
        Some(pb::kv_event::Kind::Snapshot(all)) => {
            ix.clear_worker(slot)?;
            for s in all.pages {
                ix.stored(slot, s.parent_hash, &s.page_hashes, &s.token_ids)?;
            }
            Ok(())
        }
        None => Ok(()),
    }
}
