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

use std::sync::mpsc::Receiver;

use ferry_worker::EngineLink;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use ferry_cluster::metrics as m;
use ferry_engine::scheduler::{Prefilled, Scheduler};
use ferry_engine::{Model, PagePool, RadixCache, Sampler};
use ferry_kernels::Backend;
use ferry_radix::events::KvEvent;
use ferry_transfer::room::Timeouts;
use ferry_worker::KvHost;
use ferry_worker::engine_loop::EngineThread;
use tokio::sync::{broadcast, mpsc};

use crate::error::PrefillError;
use crate::room_task::ChunkMsg;
use crate::rooms::{Action, Event, PhaseTimeouts, Rooms};
use crate::service::SenderPool;

mod admit;
mod lifecycle;
mod pull;
mod step;

use crate::cmd::{Cmd, Handshake, Load, NewRequest, PrefillDone, PrefillReply};

/// A room the scheduler knows.
struct Live {
    tokens: Vec<u32>,
    sampler: Sampler,
    reply: Option<PrefillReply>,
    chunks: Option<mpsc::UnboundedSender<ChunkMsg>>,
    /// Destination slots handed to the room task so far.
    sent: usize,
    cached: usize,
    first: Option<ferry_engine::Sampled>,
    /// Prompt logprobs computed so far (when the sampling asks for them).
    prompt_logprobs: Vec<ferry_engine::Sampled>,
    prefilled: Option<Prefilled>,
    /// Waiting for a pull of held pages: the pull's ticket, and the priority to queue it with
    /// once that pull ends (a room that pulls reads the cache).
    pulling: Option<(u64, i32)>,
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
    /// Pulls of held pages from decode nodes (None: this node cannot pull — rdma).
    pub puller: Option<Arc<crate::pull::Puller>>,
}

/// The engine thread's state.
pub struct Engine<B: Backend> {
    model: Model<B>,
    pool: PagePool<B>,
    cache: RadixCache,
    sched: Scheduler,
    /// The rooms, each with the engine's record of it once started ([`Live`]).
    rooms: Rooms<NewRequest, Handshake, Live>,
    kv: Arc<KvHost>,
    rt: tokio::runtime::Handle,
    cmds: EngineLink<Cmd>,
    cfg: EngineConfig,
    events: broadcast::Sender<Vec<KvEvent>>,
    load: Arc<Mutex<Load>>,
    rate: f64,
    draining: bool,
    /// Pulls under way (their pages are theirs until they end).
    pulls: usize,
    /// The last pull's ticket: a pull's end queues only the room that started it, not a later
    /// room with the same id.
    pull_tickets: u64,
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
        cmds: EngineLink<Cmd>,
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
            kv,
            rt,
            cmds,
            cfg,
            events,
            load,
            rate: 0.0,
            draining: false,
            pulls: 0,
            pull_tickets: 0,
        }
    }

    /// Runs until [`Cmd::Shutdown`] (or every command sender is gone) and everything is freed.
    pub fn run(self, rx: Receiver<Cmd>) {
        ferry_worker::engine_loop::run(self, rx);
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
                for a in self.rooms.on(Event::Request { room, secret, request: req }, now) {
                    self.act(a, None);
                }
            }
            Cmd::Handshake { room, secret, hs, reply } => {
                if self.draining {
                    let _ = reply.send(Err(shutting_down()));
                    return;
                }
                let actions = self.rooms.on(Event::Handshake { room, secret, handshake: hs }, now);
                let refused = actions.iter().find_map(|a| match a {
                    Action::RefuseHandshake { why, .. } => Some(PrefillError::Refused { why: *why, room }),
                    _ => None,
                });
                let _ = reply.send(refused.map_or(Ok(()), Err));
                for a in actions {
                    self.act(a, None);
                }
            }
            Cmd::Abort { room, secret, reason, reply } => {
                let why = PrefillError::Aborted(reason);
                let mut reply = Some(reply);
                for a in self.rooms.on(Event::Abort { room, secret: Some(secret) }, now) {
                    match a {
                        Action::Aborted(r) => {
                            if let Some(reply) = reply.take() {
                                let _ = reply.send(r.map_err(|why| PrefillError::Refused { why, room }));
                            }
                        }
                        other => self.act(other, Some(why.clone())),
                    }
                }
            }
            Cmd::Progress { room } => {
                self.rooms.on(Event::Progress(room), now);
            }
            Cmd::Sent { room, result } => self.sent(room, result),
            Cmd::Pulled(p) => self.pulled(*p),
            Cmd::Snapshot { reply } => {
                let _ = reply.send(self.cache.snapshot());
            }
            Cmd::Shutdown => {
                self.draining = true;
                let all = self.rooms.live_rooms();
                for room in all {
                    for a in self.rooms.on(Event::Abort { room, secret: None }, now) {
                        self.act(a, Some(shutting_down()));
                    }
                }
                // Every room still bootstrapping leaves as if its time were up.
                for a in self.rooms.on(Event::Tick, now + Duration::from_secs(1 << 30)) {
                    self.act(a, Some(shutting_down()));
                }
            }
        }
    }

    /// Carries out one action of the rooms; `why`: the reason a room that leaves is given (a
    /// timeout's when None).
    fn act(&mut self, a: Action<NewRequest, Handshake, Live>, why: Option<PrefillError>) {
        match a {
            Action::RefuseRequest { room, request, why } => {
                let _ = request.reply.send(Err(PrefillError::Refused { why, room }));
            }
            // Answered (or copied) where the event was raised.
            Action::RefuseHandshake { .. } | Action::Aborted(_) | Action::Mirror { .. } => {}
            Action::Pair { room, secret, request, handshake } => self.admit(room, secret, request, handshake),
            Action::Gone(gone) => match why {
                Some(why) => self.abandon(gone, why),
                None => self.timed_out(gone),
            },
            Action::Finished { room, live: Some(l), .. } => self.release(room, l),
            Action::Finished { live: None, .. } => {}
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
        *self.load.lock() = load;
    }
}

impl<B: Backend> EngineThread for Engine<B> {
    type Cmd = Cmd;

    fn labels(&self) -> (&'static str, ferry_cluster::WorkerId) {
        ("prefill", self.cfg.worker.clone())
    }

    fn busy(&self) -> bool {
        self.sched.waiting_len() + self.sched.prefilling_len() > 0
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.rooms.next_deadline()
    }

    fn handle(&mut self, c: Cmd) {
        Engine::handle(self, c);
    }

    fn disconnected(&mut self) -> bool {
        // The engine keeps a sender for its room tasks, so only after it was dropped: nothing
        // can report what is left.
        true
    }

    fn turn(&mut self, now: Instant) {
        self.expire(now);
        if let Err(e) = self.step() {
            tracing::error!(error = %e, "prefill pass failed; failing its rooms");
            let rooms = self.rooms.live_rooms();
            for room in rooms {
                self.fail(room, PrefillError::Internal { reason: "engine_error", message: e.to_string() });
            }
        }
        self.publish();
        // With no room here, every page is free or cached and none is locked: a page held
        // by nobody would be a leak (every test run checks it).
        if self.rooms.is_empty() && !self.busy() && self.pulls == 0 {
            debug_assert_eq!(
                (self.pool.free_pages() + self.cache.cached_pages(), self.cache.protected_pages()),
                (self.pool.num_pages(), 0),
                "prefill pages held by no room (free + cached, locked)"
            );
        }
    }

    fn finished(&self) -> bool {
        self.draining && self.rooms.is_empty() && self.pulls == 0
    }
}

/// The refusal of anything arriving while the worker shuts down.
fn shutting_down() -> PrefillError {
    PrefillError::ShuttingDown
}
