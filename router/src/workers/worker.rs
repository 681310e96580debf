//! One worker as the router knows it: its address and channels, its health (a circuit
//! breaker fed by active checks and by calls), its last load report, and the requests this
//! router streams from it.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::h2_calls::Calls;
use ferry_cluster::WorkerId;
use ferry_cluster::discovery::Role;
use ferry_cluster::mtls::BadAddress;
use ferry_proto::v1 as pb;
use tonic::transport::Channel;

use super::health::Health;
use super::{Board, Placed, board, channel, view};
use crate::placement::DecodeState;

/// One worker.
#[derive(Debug)]
pub struct Worker {
    /// Its id.
    pub id: WorkerId,
    /// Its role.
    pub role: Role,
    /// Its gRPC address.
    pub addr: String,
    /// A lazily connected channel.
    pub channel: Channel,
    /// The calls on a request's path (`Prefill`, `Generate`), each request in one write, over
    /// a lazily connected connection of their own ([`crate::h2_calls`]).
    pub calls: Calls,
    /// Its slot in its role's prefix index (a prefill worker's is also its position in
    /// [`Snapshot::prefill`]).
    pub slot: usize,
    pub(super) health: Mutex<Health>,
    /// Its health and load as placement reads them, without the lock.
    pub(super) view: view::View,
    /// A prefill worker's place on its registry's board, and its serial there (a slot's
    /// later holder has another).
    pub(super) board: Option<(Arc<Board>, u64)>,
    /// Still a member of the registry (events for its slot are applied only while it is).
    pub(super) member: std::sync::atomic::AtomicBool,
    /// Wakes the calls waiting on it when its active checks take it out of placement or it
    /// leaves ([`Self::taken_out`]).
    pub(super) out: tokio::sync::Notify,
}

impl Worker {
    /// Reachable recently and not tripped.
    pub fn healthy(&self) -> bool {
        self.view.healthy(Instant::now())
    }

    /// A worker in slot `slot` that no registry lists: nothing checks it or follows its
    /// events, and its channel connects on first use (benches that place on real workers'
    /// published state; call within a tokio runtime), publishing to `board` when given. Out
    /// of placement until [`Self::ok`].
    pub fn standalone(
        id: WorkerId,
        role: Role,
        addr: &str,
        slot: usize,
        board: Option<&Arc<Board>>,
    ) -> Result<Self, BadAddress> {
        Ok(Self::new(id, role, addr.to_string(), channel(addr, role, None)?, slot, board))
    }

    /// In `slot`, claiming it on `board` when given.
    pub(super) fn new(
        id: WorkerId,
        role: Role,
        addr: String,
        (channel, calls): (Channel, Calls),
        slot: usize,
        board: Option<&Arc<Board>>,
    ) -> Self {
        let board = board.map(|b| {
            let serial = board::serial();
            b.claim(slot, serial);
            (Arc::clone(b), serial)
        });
        Self {
            id,
            role,
            addr,
            channel,
            calls,
            slot,
            health: Mutex::new(Health::default()),
            view: view::View::default(),
            board,
            member: std::sync::atomic::AtomicBool::new(true),
            out: tokio::sync::Notify::new(),
        }
    }

    /// Completes when its active checks next take it out of placement, or it leaves the
    /// registry (its etcd lease expired, say; counted from this call, even before the future
    /// is first polled). A call waiting on a worker that stopped answering — a frozen process
    /// keeps its TCP connections up and its kernel acknowledges, so only the HTTP/2 pings
    /// notice, after `KEEPALIVE_INTERVAL` + `KEEPALIVE_TIMEOUT` — ends with it and is retried
    /// elsewhere. (A worker stopping gracefully leaves first, then ends its calls itself.)
    pub fn taken_out(&self) -> tokio::sync::futures::Notified<'_> {
        self.out.notified()
    }

    /// Whether a health check to it ends within a second, whatever the outcome: a worker
    /// draining on its way out says NOT_SERVING, or refuses new calls at once (its server
    /// shuts down gracefully: open streams go on, new calls fail); a frozen one says nothing.
    pub async fn answers(&self) -> bool {
        let mut h = tonic_health::pb::health_client::HealthClient::new(self.channel.clone());
        let ask = h.check(tonic_health::pb::HealthCheckRequest { service: String::new() });
        tokio::time::timeout(Duration::from_secs(1), ask).await.is_ok()
    }

    /// Its circuit is open or it left the registry: what [`Self::taken_out`] waits for,
    /// checked once the future is taken (it may have happened before).
    pub fn out_of_service(&self) -> bool {
        !self.member.load(std::sync::atomic::Ordering::SeqCst) || !self.healthy()
    }

    /// Changes its health with `f` and publishes the result to placement (its load report
    /// too when `load`: `f` brought a new one).
    pub(super) fn update<R>(&self, load: bool, f: impl FnOnce(&mut Health) -> R) -> R {
        let mut h = self.health.lock();
        let r = f(&mut h);
        self.view.publish(&h, load);
        if let Some((board, serial)) = &self.board {
            board.publish(self.slot, *serial, h.ready_at(), &h.prefill_state());
        }
        r
    }

    /// Its last load report.
    pub fn load(&self) -> Option<pb::LoadReport> {
        self.health.lock().load.clone()
    }

    /// What placement reads of a decode worker holding `cached_tokens` of the prompt
    /// (unhealthy as well when `excluded`).
    pub fn decode_state(&self, now: Instant, excluded: bool, cached_tokens: usize) -> DecodeState {
        self.view.decode_state(now, excluded, cached_tokens)
    }

    /// Counts a request this router streams from it (a decode worker) until the guard drops.
    pub fn placed(self: &Arc<Self>) -> Placed {
        Placed::new(Arc::clone(self))
    }

    /// A call to it succeeded.
    pub fn ok(&self) {
        self.succeeded(false, "calls", Health::call_ok);
    }

    /// A call to it failed; returns true when this opened its circuit.
    pub fn failed(&self) -> bool {
        self.tripped("calls failing", |h| h.call_failed(Instant::now()))
    }

    /// Applies a success `f` (a report with it when `load`); tells the operator when it closed
    /// the circuit, `by` what.
    pub(super) fn succeeded(&self, load: bool, by: &str, f: impl FnOnce(&mut Health)) {
        let back = self.update(load, |h| {
            let was_out = h.out;
            f(h);
            was_out && !h.out
        });
        if back {
            tracing::info!(worker = %self.id, "worker answers its {by} again: back in placement");
        }
    }

    /// Applies a failure `f` (true when it opened the circuit) and returns its answer; tells
    /// the operator once per outage (`why`), not every time the circuit reopens.
    pub(super) fn tripped(&self, why: &str, f: impl FnOnce(&mut Health) -> bool) -> bool {
        let (opened, first) = self.update(false, |h| {
            let was_out = h.out;
            let opened = f(h);
            (opened, opened && !was_out)
        });
        if first {
            tracing::warn!(worker = %self.id, "worker {why}: taken out of placement");
        } else if opened {
            tracing::debug!(worker = %self.id, "worker still {why}");
        }
        opened
    }
}
