//! The engine thread: the one owner of the model, the page pool and the queues. gRPC handlers
//! and handshake tasks talk to it through [`Cmd`]s; the transfer receiver writes arriving
//! pages into the pool itself (into pages preallocated for their room), and rooms' outcomes,
//! released pages and clients going away come as commands too ([`crate::wake`]). Between
//! steps the thread blocks on its commands until the queues' next deadline: an idle node, or
//! one waiting for transfers, does not wake to poll.
//!
//! Each step forms one batch: every running request's next token, and chunks of prompts
//! prefilled here. A finished request's pages go back to the pool at once.
//!
//! With a host mirror (a GPU pool), the transfer writes a room's pages into the mirror, and
//! this thread copies them to the device once the room is complete, before the request
//! joins the batch.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::Receiver;

use parking_lot::Mutex;
use std::time::Instant;

use ferry_cluster::metrics as m;
use ferry_cluster::{LayoutDescriptor, Room, RoomKey};
use ferry_engine::{FinishReason, Model, PageAlloc, PagePool, RadixCache, Sampled, Sampler};
use ferry_kernels::Backend;
use ferry_radix::events::KvEvent;
use ferry_transfer::Receiver as KvReceiver;
use ferry_worker::KvHost;
use ferry_worker::engine_loop::EngineThread;
use tokio::sync::broadcast;

use crate::error::DecodeError;
use crate::handshake::Handshakes;
use crate::queues::{Event, Limits, Queues, Stage};
use crate::wake::Wake;

mod act;
mod cache;
mod fork;
mod lifecycle;
mod pull;
mod step;

use crate::cmd::{Cmd, Emit, Generate, Load, Out};

struct Req {
    key: RoomKey,
    incarnation: u64,
    prompt: Vec<u32>,
    sampler: Sampler,
    out: Out,
    pages: Option<PageAlloc>,
    computed: usize,
    generated: Vec<u32>,
    /// Prompt logprobs computed here, sent with the first token (when asked for).
    prompt_logprobs: Vec<Sampled>,
    /// Generated tokens before the last whose KV is not computed yet: tokens a constraint
    /// forced (jump-forward), computed with the last one as one chunk at the next step.
    behind: usize,
    /// The first token, from the prefill node or the local prefill, not yet emitted.
    first: Option<Sampled>,
    bootstrap: Option<String>,
    /// When it was retracted, until it runs again.
    retracted_at: Option<Instant>,
    span: tracing::Span,
    trace: ferry_cluster::TraceContext,
    /// Where its time goes (`ferry_request_phase_seconds{role="decode"}`).
    clock: ferry_cluster::phases::PhaseClock,
    /// Its sequence of the request (0 .. n-1): sequence 0 has the request's room, the
    /// others a room of their own, minted here ([`Engine::fork`]).
    index: u32,
    /// The request's room (the room of its sequence 0): aborts and a client gone reach every
    /// sequence through it.
    family: Room,
    /// Until the request forks: the samplers of its other sequences.
    forks: Vec<Sampler>,
    /// The prefix cache's node whose pages lead its own (locked while it holds them).
    cached: Option<ferry_engine::NodeId>,
    /// Prompt tokens it found in the prefix cache (reported with its first token).
    hit: u32,
    /// Leading prompt pages of a transferred prompt that the prefix cache supplied: neither
    /// sent by the prefill node nor copied in.
    held: usize,
    /// Pulls of its held pages under way ([`Cmd::Pull`]): spoiled once it lets them go.
    pulls: Vec<u64>,
}

impl Req {
    /// Tokens whose KV must be in the request's pages before its next decode step: the
    /// prompt and every generated token but the last (the next step's input).
    fn kv_target(&self) -> usize {
        self.prompt.len() + self.generated.len().saturating_sub(1)
    }

    /// The pages its prompt's KV goes into, the prefill node's transfer writes (a fork's
    /// other sequences' pages follow them, written here).
    fn prompt_pages(&self, page_size: usize) -> &[u32] {
        let pages = self.pages.as_ref().map_or(&[][..], PageAlloc::pages);
        &pages[..self.prompt.len().div_ceil(page_size.max(1)).min(pages.len())]
    }

    /// The token at position `i` of the sequence (prompt, then generated tokens).
    fn token_at(&self, i: usize) -> u32 {
        match i.checked_sub(self.prompt.len()) {
            None => self.prompt[i],
            Some(g) => self.generated[g],
        }
    }
}

/// Engine settings.
pub struct EngineConfig {
    /// Worker id (metrics label).
    pub worker: ferry_cluster::WorkerId,
    /// Queue limits, the admission estimate among them.
    pub limits: Limits,
    /// Prompt tokens computed per step for local prefill.
    pub chunk_size: usize,
    /// Our KV layout, sent in handshakes.
    pub layout: LayoutDescriptor,
    /// The data-plane endpoint prefill nodes send to.
    pub data_endpoint: String,
    /// The transfer backend's name.
    pub backend: &'static str,
    /// Append the tokens an output constraint forces in one step (jump-forward).
    pub jump_forward: bool,
    /// Keep finished requests' pages in a prefix cache and prefill only what it lacks.
    pub decode_cache: bool,
    /// How long a stopping engine lets its running requests go on (`--drain-grace`) before
    /// it ends them for the router to move.
    pub drain_grace: std::time::Duration,
    /// The cache's KV events, published for the router (which places a conversation's next
    /// turn where its history is).
    pub events: broadcast::Sender<Vec<KvEvent>>,
}

/// The engine thread's state.
pub struct Engine<B: Backend> {
    model: Model<B>,
    pool: PagePool<B>,
    /// Finished and retracted requests' pages, evictable (`--disable-decode-cache`: empty).
    cache: RadixCache,
    kv: Arc<KvHost>,
    queues: Queues,
    reqs: HashMap<Room, Req>,
    receiver: Arc<KvReceiver>,
    /// Pages of closed rooms that a connection may still be writing, with the cached prefix
    /// each read (locked until then: the queues count it among the room's pages).
    draining: Vec<(Room, PageAlloc, Option<ferry_engine::NodeId>)>,
    handshakes: Handshakes,
    wake: Wake,
    cfg: EngineConfig,
    load: Arc<Mutex<Load>>,
    eos: Vec<u32>,
    stopping: bool,
    /// When a stopping engine ends the requests still running ([`EngineConfig::drain_grace`]
    /// after [`Cmd::Shutdown`]); None once it has (or before).
    drain_until: Option<Instant>,
    /// Pulls whose pages are still their room's (ids from `next_pull`).
    pulls: std::collections::HashSet<u64>,
    next_pull: u64,
}

impl<B: Backend> Engine<B> {
    /// An engine over a loaded model, its pool and the transfer receiver writing into its
    /// pages (in place, or into their host mirror `kv`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Model<B>,
        pool: PagePool<B>,
        kv: Arc<KvHost>,
        receiver: Arc<KvReceiver>,
        handshakes: Handshakes,
        wake: Wake,
        cfg: EngineConfig,
        load: Arc<Mutex<Load>>,
    ) -> Self {
        let eos = model.tokenizer().eos_ids().to_vec();
        let queues = Queues::new(cfg.limits, pool.num_pages());
        // A new epoch per start: a router that followed an earlier incarnation resyncs.
        let epoch =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        let cache = RadixCache::new(pool.layout().page_size, epoch);
        Self {
            model,
            pool,
            cache,
            kv,
            queues,
            reqs: HashMap::new(),
            receiver,
            draining: Vec::new(),
            handshakes,
            wake,
            cfg,
            load,
            eos,
            stopping: false,
            drain_until: None,
            pulls: Default::default(),
            next_pull: 0,
        }
    }

    /// Runs until [`Cmd::Shutdown`] and everything is freed.
    pub fn run(self, rx: Receiver<Cmd>) {
        ferry_worker::engine_loop::run(self, rx);
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Generate(g) => {
                let r = self.accept(g);
                if let Err((why, accepted)) = r {
                    let _ = accepted.send(Err(why));
                }
            }
            Cmd::Abort { room, secret, reason, sequence, reply } => {
                let members = self.family(room, |r| sequence.is_none_or(|s| r.index == s));
                let r = if members.is_empty() {
                    Ok(false)
                } else if members.iter().any(|m| self.reqs.get(m).is_some_and(|r| r.key.secret != secret)) {
                    Err(DecodeError::WrongSecret(room))
                } else {
                    let why = DecodeError::Aborted(reason);
                    for (i, m) in members.into_iter().enumerate() {
                        // One error ends the client's stream; a single sequence ends quietly.
                        self.close(m, Err(why.clone()), sequence.is_none() && i == 0);
                    }
                    Ok(true)
                };
                let _ = reply.send(r);
            }
            Cmd::Gone { room, incarnation } => {
                let why = DecodeError::ClientGone;
                for m in self.family(room, |r| r.incarnation == incarnation) {
                    self.end(m, Err(why.clone()));
                }
            }
            Cmd::Transferred { room, incarnation, outcome } => {
                if self.reqs.get(&room).is_some_and(|r| r.incarnation == incarnation) {
                    self.transferred(room, outcome, Instant::now());
                }
            }
            Cmd::Released { room } => {
                for a in self.queues.on(Event::Released(room), Instant::now()) {
                    self.act(a, Instant::now());
                }
            }
            Cmd::HandshakeFailed { room, why } => self.handshake_failed(room, why, Instant::now()),
            Cmd::Pull { room, secret, first, n, reply } => {
                let _ = reply.send(self.lend(room, secret, first, n));
            }
            Cmd::PullDone { id, reply } => {
                let _ = reply.send(self.pulls.remove(&id));
            }
            Cmd::Snapshot { reply } => {
                let _ = reply.send(self.cache.snapshot());
            }
            Cmd::Shutdown => {
                // Nothing new is admitted from now on. Requests generating go on for the drain
                // grace; the rest end now, and the router places them elsewhere (before their
                // first token: a retry; after it: a migration).
                self.stopping = true;
                let now = Instant::now();
                self.drain_until = Some(now + self.cfg.drain_grace);
                let running: Vec<Room> = self.reqs.keys().copied().collect();
                let (keep, end): (Vec<Room>, Vec<Room>) = running
                    .into_iter()
                    .partition(|&r| !self.cfg.drain_grace.is_zero() && self.queues.stage(r) == Some(Stage::Running));
                tracing::info!(
                    worker = %self.cfg.worker,
                    generating = keep.len(),
                    ending = end.len(),
                    grace = ?self.cfg.drain_grace,
                    "draining: admitting nothing new"
                );
                for room in end {
                    self.end(room, Err(shutting_down()));
                }
                self.drained(now);
            }
        }
    }

    /// [`emit`](Self::emit)s `s`, then, unless that ended the request, the tokens its output
    /// constraint forces next (jump-forward): they go out now, logprob 0 (certain under the
    /// constraint), and their KV is computed with the next step's input as one chunk (at most
    /// `--chunked-prefill-size` tokens a step: a longer forced text goes on at the next).
    /// `Some` when the request ends: how, or the error that ends it.
    fn emit_and_jump(&mut self, room: Room, s: Sampled) -> Option<Result<FinishReason, DecodeError>> {
        let finish = self.emit(room, s, false);
        if finish.is_some() || !self.cfg.jump_forward {
            return finish;
        }
        let ctx = self.model.config().max_position_embeddings;
        let forced = {
            let r = self.reqs.get_mut(&room)?;
            let room_left = (r.sampler.params().max_new_tokens as usize)
                .min(ctx.saturating_sub(r.prompt.len()))
                .saturating_sub(r.generated.len())
                .min(self.cfg.chunk_size.max(1));
            r.sampler.jump(room_left)
        };
        if forced.is_empty() {
            return None;
        }
        metrics::counter!(m::JUMP_FORWARD_TOKENS, "worker" => self.cfg.worker.clone()).increment(forced.len() as u64);
        let n = forced.len();
        for (i, token) in forced.into_iter().enumerate() {
            if let Some(r) = self.reqs.get_mut(&room) {
                r.behind += 1;
            }
            // The matcher is past all of them: only the last can complete the constraint.
            if let Some(f) = self.emit(room, Sampled { token, logprob: 0.0, top: Vec::new() }, i + 1 < n) {
                return Some(f);
            }
        }
        None
    }

    /// Sends `s` to the client and says whether the request ends with it (`more_forced`: more
    /// tokens the constraint forced follow it). A token the output constraint refused (a
    /// prefill node that sampled without it) is not sent: the request ends with an error.
    fn emit(&mut self, room: Room, s: Sampled, more_forced: bool) -> Option<Result<FinishReason, DecodeError>> {
        let r = self.reqs.get_mut(&room)?;
        if let Some(e) = r.sampler.guide_error() {
            let why = format!("the output constraint failed: {e}");
            return Some(Err(DecodeError::internal("constraint_failed", why)));
        }
        let tok = s.token;
        r.generated.push(tok);
        if r.generated.len() == 1 {
            let phase = if r.bootstrap.is_none() { "local_prefill" } else { "first_token" };
            r.clock.lap(phase, Instant::now());
        }
        self.queues.on(Event::Token(room), Instant::now());
        let p = r.sampler.params();
        let ctx = self.model.config().max_position_embeddings;
        // A complete output constraint ends the request as an end-of-sequence token would.
        let finish = if !p.ignore_eos && self.eos.contains(&tok)
            || p.stop_token_ids.contains(&tok)
            || !more_forced && r.sampler.complete()
        {
            Some(FinishReason::Stop)
        } else if r.generated.len() >= p.max_new_tokens as usize || r.prompt.len() + r.generated.len() >= ctx {
            Some(FinishReason::Length)
        } else {
            None
        };
        metrics::counter!(m::GENERATED_TOKENS).increment(1);
        // The laps go with the first token (a router that finds a stop string drops the
        // stream before the last) and, all of them, with the last.
        let phases = match finish {
            Some(_) => {
                r.clock.lap("decode", Instant::now());
                r.clock.laps().to_vec()
            }
            None if r.generated.len() == 1 => r.clock.laps().to_vec(),
            None => Vec::new(),
        };
        let prompt = if r.generated.len() == 1 { std::mem::take(&mut r.prompt_logprobs) } else { Vec::new() };
        let cached = if r.generated.len() == 1 { r.hit } else { 0 };
        let _ = r.out.send(Ok(Emit { sampled: s, finish, phases, prompt, index: r.index, cached }));
        finish.map(Ok)
    }

    /// The rooms of the live sequences of the request whose room is `room` that `keep` keeps,
    /// in sequence order.
    fn family(&self, room: Room, keep: impl Fn(&Req) -> bool) -> Vec<Room> {
        let mut m: Vec<(u32, Room)> =
            self.reqs.iter().filter(|(_, r)| r.family == room && keep(r)).map(|(&k, r)| (r.index, k)).collect();
        m.sort_unstable();
        m.into_iter().map(|(_, k)| k).collect()
    }

    fn publish(&mut self) {
        let depth = self.queues.depth();
        let w = self.cfg.worker.clone();
        let mut d: Vec<(&'static str, usize)> = Stage::ALL.iter().map(|s| (s.label(), depth[s])).collect();
        d.sort_unstable();
        for &(state, n) in &d {
            metrics::gauge!(m::QUEUE_DEPTH, "role" => "decode", "worker" => w.clone(), "state" => state).set(n as f64);
        }
        let events = self.cache.drain_events();
        if !events.is_empty() {
            let _ = self.cfg.events.send(events);
        }
        // Device mirroring is a prefill node's concern: kept from growing.
        self.cache.drain_dirty();
        let (free, evictable) = (self.pool.free_pages(), self.cache.evictable_pages());
        let total = self.pool.num_pages();
        let used = total - free - evictable;
        for (kind, n) in [("free", free), ("evictable", evictable), ("used", used), ("total", total)] {
            metrics::gauge!(m::PAGES, "role" => "decode", "worker" => w.clone(), "kind" => kind).set(n as f64);
        }
        metrics::gauge!(m::NEW_TOKEN_RATIO, "worker" => w.clone()).set(self.queues.ratio());
        // The queues count a cached prefix once per request reading it: their free pages
        // are the safe figure.
        let available = (free + evictable).min(self.queues.free_pages());
        let load = Load {
            depth: d,
            free_pages: free + evictable,
            evictable_pages: evictable,
            admissible_pages: available.saturating_sub(self.queues.promised()),
            total_pages: total,
        };
        *self.load.lock() = load;
    }
}

impl<B: Backend> EngineThread for Engine<B> {
    type Cmd = Cmd;

    fn labels(&self) -> (&'static str, ferry_cluster::WorkerId) {
        ("decode", self.cfg.worker.clone())
    }

    fn busy(&self) -> bool {
        self.queues.computing()
    }

    fn next_deadline(&self) -> Option<Instant> {
        match (self.queues.next_deadline(), self.drain_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn handle(&mut self, c: Cmd) {
        Engine::handle(self, c);
    }

    fn disconnected(&mut self) -> bool {
        // Every sender gone: nothing can free what is left once stopping.
        if self.stopping {
            return true;
        }
        Engine::handle(self, Cmd::Shutdown);
        false
    }

    fn turn(&mut self, now: Instant) {
        // Admission before timeouts: a request admissible when its deadline comes runs.
        self.admit(now);
        self.expire(now);
        self.drained(now);
        if let Err(e) = self.step() {
            tracing::error!(error = %e, "decode step failed; failing its requests");
            let rooms: Vec<Room> = self.reqs.keys().copied().collect();
            for room in rooms {
                self.end(room, Err(DecodeError::internal("engine_error", e.to_string())));
            }
        }
        // The step may have ended the requests holding the pool: admit who waited for their
        // pages now. Nothing else would wake this thread before the waiting ones' deadline
        // when no command comes (a forked request's stream stays open while any of its
        // sequences waits, so no client-gone command follows its others' ends).
        self.admit(Instant::now());
        self.publish();
        // The queues count a page a request reads from the cache as its own, once per reader:
        // the pool has at least what they count free, exactly that when no one reads it.
        let available = self.pool.free_pages() + self.cache.evictable_pages();
        debug_assert!(
            available >= self.queues.free_pages()
                && (self.cache.protected_pages() > 0 || available == self.queues.free_pages()),
            "the pool ({} free, {} evictable, {} locked) and the queues ({} free) disagree",
            self.pool.free_pages(),
            self.cache.evictable_pages(),
            self.cache.protected_pages(),
            self.queues.free_pages()
        );
    }

    fn finished(&self) -> bool {
        self.stopping && self.reqs.is_empty() && self.draining.is_empty()
    }
}

impl<B: Backend> Engine<B> {
    /// Once a stopping engine's drain grace has passed, ends the requests still here: their
    /// streams end with `UNAVAILABLE` (`shutting_down`), and the router moves them to another
    /// decode worker with what they had generated.
    fn drained(&mut self, now: Instant) {
        if self.drain_until.is_none_or(|t| now < t) {
            return;
        }
        self.drain_until = None;
        let rooms: Vec<Room> = self.reqs.keys().copied().collect();
        if !rooms.is_empty() {
            tracing::info!(worker = %self.cfg.worker, requests = rooms.len(), "drain grace over: ending what still runs");
        }
        for room in rooms {
            self.end(room, Err(shutting_down()));
        }
    }
}

/// The refusal of anything arriving while the worker shuts down.
fn shutting_down() -> DecodeError {
    DecodeError::ShuttingDown
}
