//! The workers a router knows — static or discovered through etcd, joining and leaving at any
//! time — with their gRPC channels, health (a circuit breaker fed by active checks and by
//! calls) and last load report; and the tasks that keep them current: an active check every
//! poll interval (gRPC health and the load report) and, for each worker, a KV event
//! subscription feeding its role's prefix index (resubscribing with a snapshot after any gap,
//! epoch change or error): prefill workers' caches feed the prefill placement, decode
//! workers' (finished conversations, answers included) the decode placement.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::h2_calls::Calls;
use ferry_cluster::WorkerId;
use ferry_cluster::discovery::etcd::Change;
use ferry_cluster::discovery::{self, Role};
use ferry_cluster::metrics as M;
use ferry_cluster::mtls::{BadAddress, InternalTls};
use ferry_cluster::roles::PeerRole;
use ferry_proto::v1 as pb;
use tonic::transport::Channel;

use crate::index::SharedIndex;
use crate::placement::PrefillBoard;

mod board;
mod events;
mod health;
mod pending;
mod view;
mod worker;

pub use board::Board;
pub use pending::{Pending, PrefillPending};
pub use view::Placed;
pub use worker::Worker;

use events::follow_events;
pub use events::{MAX_EVENT_BATCH_BYTES, apply_batch};
use health::Health;

/// The workers at one moment: prefill workers by index slot (None: a free slot).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Prefill workers; a worker's position is its slot in the prefix index.
    pub prefill: Vec<Option<Arc<Worker>>>,
    /// Decode workers.
    pub decode: Vec<Arc<Worker>>,
}

impl Snapshot {
    /// Every worker, prefill first.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Worker>> {
        self.prefill.iter().flatten().chain(&self.decode)
    }

    /// The prefill worker in `slot` whose numbers `board` has (read apart from this
    /// snapshot): None when the slot changed hands between the two reads, or is free (or its
    /// worker publishes to no board: a registry's always do).
    pub fn prefill_scored(&self, board: &PrefillBoard, slot: usize) -> Option<&Arc<Worker>> {
        let w = self.prefill.get(slot)?.as_ref()?;
        (w.board.as_ref().map(|(_, serial)| *serial) == Some(board.holder(slot))).then_some(w)
    }
}

struct Member {
    worker: Arc<Worker>,
    /// The task following its KV events.
    events: tokio::task::JoinHandle<()>,
}

/// The workers a router knows, which discovery may change at any time. A worker holds a
/// slot in its role's prefix index while it is a member; leaving frees the slot and the index
/// entries in it.
pub struct Registry {
    index: Arc<SharedIndex>,
    decode_index: Arc<SharedIndex>,
    tls: Option<Arc<InternalTls>>,
    members: Mutex<(Vec<Option<Member>>, Vec<Member>)>,
    /// The members as every placement reads them: replaced whole (under `members`' lock)
    /// when one joins or leaves, read without waiting.
    current: arc_swap::ArcSwap<Snapshot>,
    /// What placement scores of every prefill slot, published by the workers.
    board: Arc<Board>,
    /// Prompt tokens this router has sent each prefill worker, not yet computed.
    pending: Arc<PrefillPending>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.snapshot();
        f.debug_struct("Registry")
            .field("prefill", &s.prefill.iter().flatten().count())
            .field("decode", &s.decode.len())
            .finish()
    }
}

/// How long connecting to a worker may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a call may wait for the head of its answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

/// A channel to the worker of `role` at `addr`, and the connection for the calls on a
/// request's path; under mutual TLS its certificate must name that role
/// ([`ferry_cluster::dial`]).
fn channel(addr: &str, role: Role, tls: Option<&InternalTls>) -> Result<(Channel, Calls), BadAddress> {
    let expect = match role {
        Role::Prefill => PeerRole::Prefill,
        Role::Decode => PeerRole::Decode,
    };
    let channel = ferry_cluster::dial::channel(addr, tls, expect, |ep| {
        ep.connect_timeout(CONNECT_TIMEOUT).timeout(CALL_TIMEOUT)
    })?;
    Ok((channel, Calls::new(addr, tls, expect, CONNECT_TIMEOUT, CALL_TIMEOUT)?))
}

impl Registry {
    /// No workers yet; prefill workers' KV events will feed `index`, decode workers' an
    /// index of the same page size and budget ([`Self::decode_index`]).
    pub fn new(index: Arc<SharedIndex>) -> Self {
        let decode_index = Arc::new(SharedIndex::new(index.page_size(), index.max_pages()));
        Self {
            index,
            decode_index,
            tls: None,
            members: Mutex::new((Vec::new(), Vec::new())),
            current: arc_swap::ArcSwap::from_pointee(Snapshot::default()),
            board: Arc::default(),
            pending: Arc::default(),
        }
    }

    /// Writes into `out` the prompt tokens this router has pending on each prefill slot of
    /// `board` that has some ([`PrefillPending::by_slot`]).
    pub fn prefill_pending(&self, board: &PrefillBoard, out: &mut Vec<(usize, f64)>) {
        self.pending.by_slot(board, out);
    }

    /// Counts `tokens` of a prompt pending on prefill worker `w` while the guard lives (None:
    /// `w` is not a prefill worker).
    pub fn prefill_started(&self, w: &Worker, tokens: u64) -> Option<Pending> {
        let (_, serial) = w.board.as_ref()?;
        Some(self.pending.add(w.slot, *serial, tokens))
    }

    /// What placement scores of every prefill slot (a free slot: unhealthy), by slot: one
    /// atomic load.
    pub fn prefill_board(&self) -> Arc<PrefillBoard> {
        self.board.load()
    }

    /// What decode workers' caches hold, by their [`Worker::slot`].
    pub fn decode_index(&self) -> &SharedIndex {
        &self.decode_index
    }

    /// The index of `role`'s workers.
    fn index_of(&self, role: Role) -> &Arc<SharedIndex> {
        match role {
            Role::Prefill => &self.index,
            Role::Decode => &self.decode_index,
        }
    }

    /// Calls workers over mutual TLS.
    pub fn with_tls(mut self, tls: Option<Arc<InternalTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// The workers now: one atomic load, whatever their number.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Publishes the members `m` (its lock held) as the snapshot placements read.
    fn publish(&self, m: &(Vec<Option<Member>>, Vec<Member>)) {
        self.current.store(Arc::new(Snapshot {
            prefill: m.0.iter().map(|s| s.as_ref().map(|m| Arc::clone(&m.worker))).collect(),
            decode: m.1.iter().map(|m| Arc::clone(&m.worker)).collect(),
        }));
    }

    /// Adds `w`, or replaces the worker of the same role and id when its address changed.
    /// Needs a Tokio runtime (the worker's KV event subscription starts here).
    pub fn upsert(&self, w: &discovery::Worker) -> Result<(), BadAddress> {
        let mut m = self.members.lock();
        let same = |x: &Member| x.worker.id == w.id;
        let existing = match w.role {
            Role::Prefill => m.0.iter().flatten().find(|x| same(x)).map(|x| x.worker.addr.clone()),
            Role::Decode => m.1.iter().find(|x| same(x)).map(|x| x.worker.addr.clone()),
        };
        if existing.as_deref() == Some(w.addr.as_str()) {
            return Ok(());
        }
        let channel = channel(&w.addr, w.role, self.tls.as_deref())?;
        if existing.is_some() {
            self.remove_locked(&mut m, w.role, &w.id);
        }
        let slot = match w.role {
            Role::Prefill => match m.0.iter().position(Option::is_none) {
                Some(s) => s,
                None => {
                    m.0.push(None);
                    m.0.len() - 1
                }
            },
            // The lowest slot no decode member holds.
            Role::Decode => (0..).find(|s| !m.1.iter().any(|x| x.worker.slot == *s)).unwrap_or(0),
        };
        let board = (w.role == Role::Prefill).then_some(&self.board);
        let worker = Arc::new(Worker::new(w.id.clone(), w.role, w.addr.clone(), channel, slot, board));
        let events = tokio::spawn(follow_events(Arc::clone(&worker), slot, Arc::clone(self.index_of(w.role))));
        // A new worker is out of placement until a check passes: checked now, not at the next
        // round (a second or more away with a thousand workers).
        tokio::spawn(first_check(Arc::clone(&worker)));
        let member = Member { worker, events };
        match w.role {
            Role::Decode => m.1.push(member),
            Role::Prefill => m.0[slot] = Some(member),
        }
        self.publish(&m);
        tracing::info!(worker = %w.id, role = w.role.as_str(), addr = %w.addr, "worker joined");
        Ok(())
    }

    /// Removes the worker of `role` named `id`; false when there is none.
    pub fn remove(&self, role: Role, id: &WorkerId) -> bool {
        let mut m = self.members.lock();
        self.remove_locked(&mut m, role, id)
    }

    fn remove_locked(&self, m: &mut (Vec<Option<Member>>, Vec<Member>), role: Role, id: &WorkerId) -> bool {
        let gone = match role {
            Role::Decode => m.1.iter().position(|x| x.worker.id == *id).map(|i| m.1.remove(i)),
            Role::Prefill => {
                m.0.iter().position(|x| x.as_ref().is_some_and(|x| x.worker.id == *id)).and_then(|s| m.0[s].take())
            }
        };
        let Some(member) = gone else { return false };
        self.publish(m);
        if let Some((board, serial)) = &member.worker.board {
            board.release(member.worker.slot, *serial);
        }
        member.worker.member.store(false, std::sync::atomic::Ordering::SeqCst);
        member.worker.out.notify_waiters();
        member.events.abort();
        let _ = self.index_of(role).clear_worker(member.worker.slot, || true);
        tracing::info!(worker = %id, role = role.as_str(), "worker left");
        true
    }

    /// Makes the members exactly `all` (after a discovery relist).
    pub fn reset(&self, all: &[discovery::Worker]) {
        let s = self.snapshot();
        for w in s.all() {
            if !all.iter().any(|x| x.role == w.role && x.id == w.id) {
                self.remove(w.role, &w.id);
            }
        }
        for w in all {
            if let Err(e) = self.upsert(w) {
                refused_worker(&e);
            }
        }
    }

    /// Follows etcd discovery `changes` until the channel closes.
    pub async fn follow(self: Arc<Self>, mut changes: tokio::sync::mpsc::Receiver<Change>) {
        while let Some(c) = changes.recv().await {
            let r = match c {
                Change::Reset(all) => {
                    self.reset(&all);
                    Ok(())
                }
                Change::Put(w) => self.upsert(&w),
                Change::Delete { role, id } => {
                    self.remove(role, &id);
                    Ok(())
                }
            };
            if let Err(e) = r {
                refused_worker(&e);
            }
        }
    }

    /// Actively checks every worker every `every` ([`poll_period`]: less often past
    /// `per_second` checks a second), forever: its gRPC health must say SERVING and its load
    /// report must come back, within a second. A worker whose circuit opens
    /// loses its entries in its role's index (its event stream resyncs them when it is back).
    pub async fn poll_loads(self: Arc<Self>, every: Duration, per_second: f64) {
        loop {
            let snap = self.snapshot();
            let due = tokio::time::Instant::now() + poll_period(every, per_second, snap.all().count());
            let polls = snap.all().map(|w| {
                let (w, index) = (Arc::clone(w), Arc::clone(self.index_of(w.role)));
                async move {
                    match check(&w).await {
                        Some(r) => w.succeeded(true, "checks", |h| h.check_ok(r)),
                        None => {
                            let opened = w.tripped("unreachable or not serving", |h| h.check_failed(Instant::now()));
                            if opened {
                                w.out.notify_waiters();
                                // Checked with ingestion shut out, as ingestion checks: a worker
                                // that left meanwhile may have handed its slot to a newcomer.
                                let member = || w.member.load(std::sync::atomic::Ordering::SeqCst);
                                let _ = index.clear_worker(w.slot, member);
                            }
                        }
                    }
                }
            });
            futures::future::join_all(polls).await;
            self.report_health(&snap);
            // Not held while waiting: workers that left meanwhile go now.
            drop(snap);
            tokio::time::sleep_until(due).await;
        }
    }

    /// The workers' and the indexes' gauges, after a round of checks.
    fn report_health(&self, snap: &Snapshot) {
        let count = |ws: &mut dyn Iterator<Item = &Arc<Worker>>| {
            let (mut up, mut down) = (0usize, 0usize);
            for w in ws {
                if w.healthy() { up += 1 } else { down += 1 }
            }
            (up as f64, down as f64)
        };
        for (role, (up, down)) in
            [("prefill", count(&mut snap.prefill.iter().flatten())), ("decode", count(&mut snap.decode.iter()))]
        {
            metrics::gauge!(M::ROUTER_WORKERS, "role" => role, "state" => "healthy").set(up);
            metrics::gauge!(M::ROUTER_WORKERS, "role" => role, "state" => "unhealthy").set(down);
        }
        for (role, index) in [("prefill", &self.index), ("decode", &self.decode_index)] {
            // An idle router forgets lapsed placements too.
            index.expire(Instant::now());
            let s = index.stats();
            metrics::gauge!(M::ROUTER_INDEX_PAGES, "role" => role, "state" => "confirmed").set(s.confirmed as f64);
            metrics::gauge!(M::ROUTER_INDEX_PAGES, "role" => role, "state" => "provisional").set(s.provisional as f64);
            metrics::counter!(M::ROUTER_INDEX_EVICTED, "role" => role).absolute(s.evicted);
            metrics::counter!(M::ROUTER_INDEX_DROPPED, "role" => role).absolute(s.dropped);
            metrics::counter!(M::ROUTER_INDEX_DIVERGED, "role" => role).absolute(s.diverged);
        }
    }
}

/// From one round of active checks of `workers` workers to the next: `every`, or longer when
/// that would check more than `per_second` workers a second (at most an hour).
fn poll_period(every: Duration, per_second: f64, workers: usize) -> Duration {
    let secs = workers as f64 / per_second;
    every.max(Duration::from_secs_f64(if secs.is_finite() { secs.clamp(0.0, 3600.0) } else { 3600.0 }))
}

/// A discovered worker that could not be added (a bad address, a scheme that contradicts
/// the internal TLS mode, no prefix-index slot left): logged and counted.
fn refused_worker(e: &BadAddress) {
    tracing::warn!(error = %e, "worker not added");
    metrics::counter!(M::BAD_REQUESTS, "role" => "router", "reason" => "worker_refused").increment(1);
}

/// A joining worker's first check; a failure waits for the rounds, which count it.
async fn first_check(w: Arc<Worker>) {
    if let Some(r) = check(&w).await {
        w.update(true, |h| h.check_ok(r));
    }
}

/// One active check, within a second: gRPC health, then the load report; None when the
/// worker does not answer in time, answers an error or is not serving.
async fn check(w: &Worker) -> Option<pb::LoadReport> {
    tokio::time::timeout(Duration::from_secs(1), check_unbounded(w)).await.ok()?
}

async fn check_unbounded(w: &Worker) -> Option<pb::LoadReport> {
    let mut h = tonic_health::pb::health_client::HealthClient::new(w.channel.clone());
    let status = h.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.ok()?;
    if status.into_inner().status != tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
        return None;
    }
    let mut c = pb::load_client::LoadClient::new(w.channel.clone());
    Some(c.report(pb::LoadRequest {}).await.ok()?.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 17: a router polling 1,024 workers every 100 ms spent a core on it (two calls
    /// each: 20 k calls a second); past `--load-polls-per-second` the rounds spread out.
    #[test]
    fn polls_spread_out_past_their_rate() {
        let ms = Duration::from_millis;
        assert_eq!(poll_period(ms(100), 1000.0, 64), ms(100));
        assert_eq!(poll_period(ms(100), 1000.0, 1024), ms(1024));
        assert_eq!(poll_period(ms(100), 1e-300, 1024), Duration::from_secs(3600), "capped, no overflow");
        assert_eq!(poll_period(ms(100), f64::NAN, 1024), Duration::from_secs(3600));
    }

    /// Placement reads the board and the members apart: when a slot changes hands between
    /// the two reads, the request does not go to the member it was not scored for.
    #[tokio::test]
    async fn a_slot_that_changed_hands_is_not_sent_to() {
        let r = Registry::new(Arc::new(SharedIndex::new(16, 1000)));
        let join = |id: &str, port: u16| {
            let w = discovery::Worker {
                id: WorkerId::new(id).expect("id"),
                role: Role::Prefill,
                addr: format!("http://127.0.0.1:{port}"),
            };
            r.upsert(&w).expect("joined");
        };
        join("a", 1);
        let (snap, board) = (r.snapshot(), r.prefill_board());
        assert_eq!(snap.prefill_scored(&board, 0).map(|w| w.id.as_str()), Some("a"));
        assert!(r.remove(Role::Prefill, &WorkerId::new("a").expect("id")));
        join("b", 2);
        let board = r.prefill_board();
        assert!(snap.prefill_scored(&board, 0).is_none(), "scored b, sent to a");
        assert_eq!(r.snapshot().prefill_scored(&board, 0).map(|w| w.id.as_str()), Some("b"));
        assert!(snap.prefill_scored(&board, 1).is_none(), "no slot");
    }

    /// Issue 61: a decode worker's requests, as placement counts them, are the ones this
    /// router streams from it, counted at once, plus those its last report counted beyond
    /// them (another router's).
    #[tokio::test]
    async fn a_decode_workers_requests_count_this_routers_at_once_and_others_by_report() {
        let r = Registry::new(Arc::new(SharedIndex::new(16, 1000)));
        let id = WorkerId::new("d").expect("id");
        r.upsert(&discovery::Worker { id: id.clone(), role: Role::Decode, addr: "http://127.0.0.1:1".into() })
            .expect("joined");
        let w = Arc::clone(&r.snapshot().decode[0]);
        let requests = || w.decode_state(Instant::now(), false, 0).requests;
        let report = |n: u32| {
            let depth = [("running".to_string(), n), ("waiting".to_string(), 1)].into_iter().collect();
            w.update(true, |h| {
                h.check_ok(pb::LoadReport { queue_depth: depth, total_pages: 99, ..Default::default() })
            });
        };
        assert_eq!(requests(), 0);
        let (a, b) = (w.placed(), w.placed());
        assert_eq!(requests(), 2, "before any report");
        // Its report counts 4 (3 running, 1 waiting): 2 are another router's.
        report(3);
        assert_eq!(requests(), 4);
        drop(a);
        assert_eq!(requests(), 3, "one of ours ended: the next report is not awaited");
        drop(b);
        report(0);
        assert_eq!(requests(), 1);
    }
}
