//! The engine thread: the one owner of the model, the page pool, the prefix cache, the
//! scheduler and the room queue. gRPC handlers and room tasks talk to it through [`Cmd`]s;
//! forward passes run here, never on the async runtime.
//!
//! After every pass each computed chunk's finished pages go to the room's task (cached prefix
//! pages first, the partial last page with the last chunk, together with the first sampled
//! token). A room's pages stay locked until its task reports the transfer ended.
//!
//! With a host mirror (a GPU pool), a chunk's pages are copied to the mirror right before
//! they go to the task, except pages already on the wire for another room: those are cached
//! prefix pages, locked and unchanged since they were copied, and their mirror page may be
//! being read.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender as CmdSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_cluster::metrics as m;
use ferry_cluster::{Refused, Room, RoomSecret};
use ferry_engine::scheduler::{Prefilled, Scheduler};
use ferry_engine::{Model, PagePool, RadixCache, Sampler, SamplingParams};
use ferry_kernels::Backend;
use ferry_radix::events::KvEvent;
use ferry_transfer::Sender;
use ferry_transfer::room::Timeouts;
use ferry_worker::KvHost;
use tokio::sync::{broadcast, mpsc, oneshot};
use tonic::Code;

use crate::room_task::ChunkMsg;
use crate::rooms::{Expired, Phase, PhaseTimeouts, Rooms};
use crate::service::SenderPool;

mod admit;
mod step;

/// What the Prefill call gets back.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillDone {
    /// Prompt tokens found in the cache.
    pub cached_tokens: u32,
    /// The first sampled token.
    pub first_token: u32,
    /// Its logprob.
    pub logprob: f32,
    /// Its most likely alternatives, when asked for.
    pub top: Vec<(u32, f32)>,
    /// The room's phases here, in order.
    pub phases: Vec<ferry_cluster::phases::Lap>,
}

/// Replies to a Prefill call.
pub type PrefillReply = oneshot::Sender<Result<PrefillDone, Refused>>;

/// A request for the engine.
pub struct NewRequest {
    /// Prompt.
    pub tokens: Vec<u32>,
    /// Sampling of the first token.
    pub sampling: SamplingParams,
    /// Scheduling priority.
    pub priority: i32,
    /// Where the outcome goes.
    pub reply: PrefillReply,
    /// The request's span (request id, room, trace id): lines about it are written in it.
    pub span: tracing::Span,
}

/// A decode node's handshake, its sender already connected.
pub struct Handshake {
    /// Destination pages, in prompt order.
    pub dest: Vec<u32>,
    /// The data-plane sender to that decode node.
    pub sender: Arc<Sender>,
}

/// Commands to the engine thread.
pub enum Cmd {
    /// A Prefill call.
    Request { room: Room, secret: RoomSecret, req: NewRequest },
    /// A Bootstrap.Handshake call.
    Handshake { room: Room, secret: RoomSecret, hs: Handshake, reply: oneshot::Sender<Result<(), Refused>> },
    /// An Abort call; replies whether the room was known.
    Abort { room: Room, secret: RoomSecret, reason: String, reply: oneshot::Sender<Result<bool, Refused>> },
    /// A room task sent a chunk (the inflight timeout counts from the last one).
    Progress { room: Room },
    /// A room task finished: its transfer succeeded or failed.
    Sent { room: Room, result: Result<(), String> },
    /// A snapshot of the prefix cache for a KV event subscriber.
    Snapshot { reply: oneshot::Sender<KvEvent> },
    /// Stop admitting, abort what is in flight, free everything, exit.
    Shutdown,
}

/// What the Load service and the metrics report.
#[derive(Debug, Clone, Default)]
pub struct Load {
    /// Rooms per phase (bootstrap, waiting, inflight).
    pub depth: (usize, usize, usize),
    /// Free pages.
    pub free_pages: usize,
    /// Evictable cached pages.
    pub evictable_pages: usize,
    /// All pages.
    pub total_pages: usize,
    /// Prompt tokens still to compute.
    pub queued_tokens: usize,
    /// Measured prefill rate (tokens per second, moving average).
    pub tokens_per_second: f64,
}

/// A room the scheduler knows.
struct Live {
    tokens: Vec<u32>,
    sampler: Sampler,
    reply: Option<PrefillReply>,
    chunks: Option<mpsc::UnboundedSender<ChunkMsg>>,
    /// Destination slots handed to the room task so far.
    sent: usize,
    /// Pages handed to the room task so far (on the wire until the task reports); kept only
    /// with a host mirror.
    wire: Vec<u32>,
    cached: usize,
    first: Option<ferry_engine::Sampled>,
    prefilled: Option<Prefilled>,
    /// Aborted while pages were possibly on the wire: freed when the task reports.
    aborting: Option<String>,
    span: tracing::Span,
    /// Where its time goes (`ferry_request_phase_seconds{role="prefill"}`); whether its first
    /// chunk was scheduled.
    clock: ferry_cluster::phases::PhaseClock,
    started: bool,
}

/// Engine settings.
pub struct EngineConfig {
    /// Worker id (metrics label).
    pub worker: ferry_cluster::WorkerId,
    /// Room timeouts (bootstrap, waiting, transfer).
    pub timeouts: Timeouts,
    /// Senders to decode nodes (a broken one is evicted).
    pub senders: Arc<SenderPool>,
}

/// The engine thread's state.
pub struct Engine<B: Backend> {
    model: Model<B>,
    pool: PagePool<B>,
    cache: RadixCache,
    sched: Scheduler,
    rooms: Rooms<NewRequest, Handshake>,
    live: HashMap<Room, Live>,
    kv: Arc<KvHost>,
    /// Per page: how many room tasks may be sending it from its mirror page (with a mirror).
    on_wire: HashMap<u32, u32>,
    rt: tokio::runtime::Handle,
    cmds: CmdSender<Cmd>,
    cfg: EngineConfig,
    events: broadcast::Sender<Vec<KvEvent>>,
    load: Arc<Mutex<Load>>,
    rate: f64,
    draining: bool,
}

impl<B: Backend> Engine<B> {
    /// An engine over a loaded model and its pool.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Model<B>,
        pool: PagePool<B>,
        sched: Scheduler,
        kv: Arc<KvHost>,
        rt: tokio::runtime::Handle,
        cmds: CmdSender<Cmd>,
        cfg: EngineConfig,
        events: broadcast::Sender<Vec<KvEvent>>,
        load: Arc<Mutex<Load>>,
    ) -> Self {
        let t = cfg.timeouts;
        let epoch =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        let page_size = pool.layout().page_size;
        let phase_t = PhaseTimeouts { bootstrap: t.bootstrap, waiting: t.waiting, inflight: t.transferring };
        Self {
            model,
            cache: RadixCache::new(page_size, epoch),
            pool,
            sched,
            rooms: Rooms::new(phase_t),
            live: HashMap::new(),
            kv,
            on_wire: HashMap::new(),
            rt,
            cmds,
            cfg,
            events,
            load,
            rate: 0.0,
            draining: false,
        }
    }

    /// Runs until [`Cmd::Shutdown`] (or every command sender is gone) and everything is freed.
    pub fn run(mut self, rx: Receiver<Cmd>) {
        loop {
            // With prompts to compute, take what came and go on; else sleep until a command
            // or the rooms' next deadline.
            let busy = self.sched.waiting_len() + self.sched.prefilling_len() > 0;
            let first = if busy {
                rx.try_recv().ok()
            } else {
                let wait = self.rooms.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
                match wait.map_or_else(|| rx.recv().map_err(|_| RecvTimeoutError::Disconnected), |w| rx.recv_timeout(w))
                {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    // Every sender gone (the engine keeps one for its room tasks, so only
                    // after it was dropped): nothing can report what is left.
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            };
            metrics::counter!(m::ENGINE_WAKEUPS, "role" => "prefill", "worker" => self.cfg.worker.clone()).increment(1);
            if let Some(c) = first {
                self.handle(c);
                while let Ok(c) = rx.try_recv() {
                    self.handle(c);
                }
            }
            self.expire(Instant::now());
            if let Err(e) = self.step() {
                tracing::error!(error = %e, "prefill pass failed; failing its rooms");
                let rooms: Vec<Room> = self.live.keys().copied().collect();
                for room in rooms {
                    self.fail(room, Refused::new(Code::Internal, "engine_error", e.to_string()));
                }
            }
            self.publish();
            if self.draining && self.rooms.is_empty() && self.live.is_empty() {
                return;
            }
        }
    }

    fn handle(&mut self, c: Cmd) {
        let now = Instant::now();
        match c {
            Cmd::Request { room, secret, req } => {
                if self.draining {
                    let _ = req.reply.send(Err(shutting_down()));
                    return;
                }
                if let Err(e) = self.check_prompt(&req.tokens, &req.sampling) {
                    let _ = req.reply.send(Err(e));
                    return;
                }
                match self.rooms.request(room, secret, req, now) {
                    Ok(Some((r, h))) => self.admit(room, secret, r, h),
                    Ok(None) => {}
                    Err((e, req)) => {
                        let _ = req.reply.send(Err(e));
                    }
                }
            }
            Cmd::Handshake { room, secret, hs, reply } => {
                if self.draining {
                    let _ = reply.send(Err(shutting_down()));
                    return;
                }
                match self.rooms.handshake(room, secret, hs, now) {
                    Ok(pair) => {
                        let _ = reply.send(Ok(()));
                        if let Some((r, h)) = pair {
                            self.admit(room, secret, r, h);
                        }
                    }
                    Err((e, _)) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Cmd::Abort { room, secret, reason, reply } => {
                let r = match self.rooms.abort(room, Some(secret), now) {
                    Err(e) => Err(e),
                    Ok(None) => Ok(false),
                    Ok(Some(gone)) => {
                        self.abandon(gone, Refused::new(Code::Aborted, "aborted", format!("aborted: {reason}")));
                        Ok(true)
                    }
                };
                let _ = reply.send(r);
            }
            Cmd::Progress { room } => self.rooms.progress(room, now),
            Cmd::Sent { room, result } => self.sent(room, result),
            Cmd::Snapshot { reply } => {
                let _ = reply.send(self.cache.snapshot());
            }
            Cmd::Shutdown => {
                self.draining = true;
                let all: Vec<Room> = self.live.keys().copied().collect();
                for room in all {
                    if let Ok(Some(gone)) = self.rooms.abort(room, None, now) {
                        self.abandon(gone, shutting_down());
                    }
                }
                for gone in self.rooms.expired(now + Duration::from_secs(1 << 30)) {
                    self.abandon(gone, shutting_down());
                }
            }
        }
    }

    /// A room task ended.
    fn sent(&mut self, room: Room, result: Result<(), String>) {
        let Some(mut l) = self.live.remove(&room) else { return };
        self.rooms.finish(room);
        let reply = l.reply.take();
        match (&l.aborting, result) {
            (None, Ok(())) => {
                l.clock.lap("transfer", Instant::now());
                metrics::counter!(m::REQUESTS, "role" => "prefill", "outcome" => "sent").increment(1);
                if let (Some(tx), Some(s)) = (reply, l.first.take()) {
                    let done = PrefillDone {
                        cached_tokens: l.cached as u32,
                        first_token: s.token,
                        logprob: s.logprob,
                        top: s.top,
                        phases: l.clock.laps().to_vec(),
                    };
                    let _ = tx.send(Ok(done));
                }
            }
            (aborting, result) => {
                let why = match (aborting, result) {
                    (Some(a), _) => a.clone(),
                    (None, Err(e)) => format!("transfer failed: {e}"),
                    (None, Ok(())) => "transfer ended early".into(),
                };
                metrics::counter!(m::REQUESTS, "role" => "prefill", "outcome" => "error").increment(1);
                let _in = l.span.enter();
                if aborting.is_none() {
                    tracing::warn!(room = %room, reason = %why, "room failed");
                } else {
                    tracing::debug!(room = %room, reason = %why, "room ended");
                }
                if let Some(tx) = reply {
                    let _ = tx.send(Err(Refused::new(Code::Unavailable, "transfer_failed", why)));
                }
            }
        }
        self.release(room, l);
    }

    /// Frees what a room holds: its scheduler entry (queued or computing) or its computed
    /// pages (unlocking the cache node).
    fn release(&mut self, room: Room, l: Live) {
        for p in &l.wire {
            if let Some(n) = self.on_wire.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    self.on_wire.remove(p);
                }
            }
        }
        if let Some(p) = l.prefilled {
            self.cache.unlock(p.node);
            drop(p.tail);
            drop(p.duplicates);
        } else {
            self.sched.abort(room.get(), &mut self.cache);
        }
    }

    /// Fails a live room: tells the caller, stops the room task; frees now when no page is on
    /// the wire, else when the task reports.
    fn fail(&mut self, room: Room, why: Refused) {
        // The id stays taken until the room task reports (`sent`).
        self.rooms.close(room, Instant::now());
        let Some(l) = self.live.get_mut(&room) else { return };
        if let Some(tx) = l.reply.take() {
            let _ = tx.send(Err(why.clone()));
        }
        l.aborting = Some(why.message.clone());
        // Dropping the chunk channel makes the task abort the room and report.
        l.chunks = None;
    }

    /// A room left the queue by abort or timeout.
    fn abandon(&mut self, gone: Expired<NewRequest, Handshake>, why: Refused) {
        if let Some(r) = gone.request {
            let _ = r.reply.send(Err(why.clone()));
        }
        if let Some(h) = gone.handshake {
            let (room, secret, reason) = (gone.room, gone.secret, why.message.clone());
            self.rt.spawn(async move {
                let _ = h.sender.abort(room, secret, &reason).await;
            });
        }
        if gone.phase != Phase::Bootstrap {
            self.fail(gone.room, why);
        }
    }

    fn expire(&mut self, now: Instant) {
        for gone in self.rooms.expired(now) {
            let why =
                Refused::new(Code::DeadlineExceeded, "timeout", format!("room timed out in {}", gone.phase.label()));
            let span = self.live.get(&gone.room).map(|l| l.span.clone());
            let span =
                span.or_else(|| gone.request.as_ref().map(|r| r.span.clone())).unwrap_or_else(tracing::Span::none);
            tracing::warn!(parent: &span, room = %gone.room, phase = gone.phase.label(), "room timed out");
            self.abandon(gone, why);
        }
    }

    fn publish(&mut self) {
        let events = self.cache.drain_events();
        if !events.is_empty() {
            let _ = self.events.send(events);
        }
        let depth = self.rooms.depth();
        let load = Load {
            depth,
            free_pages: self.pool.free_pages(),
            evictable_pages: self.cache.evictable_pages(),
            total_pages: self.pool.num_pages(),
            queued_tokens: self.sched.queued_tokens(),
            tokens_per_second: self.rate,
        };
        let w = self.cfg.worker.clone();
        for (state, n) in [("bootstrap", depth.0), ("waiting", depth.1), ("inflight", depth.2)] {
            metrics::gauge!(m::QUEUE_DEPTH, "role" => "prefill", "worker" => w.clone(), "state" => state).set(n as f64);
        }
        for (kind, n) in [
            ("free", load.free_pages),
            ("evictable", load.evictable_pages),
            ("total", load.total_pages),
            ("used", load.total_pages - load.free_pages),
        ] {
            metrics::gauge!(m::PAGES, "role" => "prefill", "worker" => w.clone(), "kind" => kind).set(n as f64);
        }
        if let Ok(mut l) = self.load.lock() {
            *l = load;
        }
    }
}

/// The refusal of anything arriving while the worker shuts down.
fn shutting_down() -> Refused {
    Refused::new(Code::Unavailable, "shutting_down", "the worker is shutting down")
}
