//! The decode node's queues as a pure state machine (no I/O, the caller's clock):
//! **prealloc** (waiting for pages) → **transfer** (pages arriving from a prefill node) or
//! **prefill** (computed here: local prefill, or the recomputation of a retracted request) →
//! **waiting** (complete, not yet batched) → **running** (continuous batching). A request
//! leaves from any state; its pages go with it.
//!
//! **Admission** is first come, first served: the head of the prealloc queue is admitted when
//! the free pages cover its context (the pages taken at once) plus an *estimate* of the pages
//! its decoding will take, on top of what is promised to requests admitted earlier. A request
//! that cannot be admitted blocks those behind it. The estimate depends on [`Admission`]:
//! - `Adaptive` (the default): `ratio × the tokens it may still generate`, for the new request
//!   and, recomputed at every admission, for every admitted one (SGLang's `new_token_ratio`).
//!   The ratio starts at `init` and decays by `decay` per decode step to `min`; a retraction
//!   sets it to what the running requests have shown, `(Σ generated + 20 × running) /
//!   Σ max tokens`, at most 1. Memory is used, not held idle for tokens most requests never
//!   generate;
//! - `Reserved`: a fixed number of tokens (capped by what the request may generate), promised
//!   at admission and kept until taken.
//!
//! **Retraction** keeps the promise "an admitted request is never cut" whatever the estimate:
//! when the running batch needs pages and none is free, the engine retracts a victim
//! ([`victim`]: least decoded progress first, then the newest), frees its pages and hands it
//! back here ([`Queues::retract`]) with the context it must recompute. It goes to the *front*
//! of the prealloc queue, prefills locally when admitted again, and resumes where it was.
//!
//! **Waiting for pages** is bounded by progress, not by age: a request in prealloc times out
//! only when the node has run no forward pass for `prealloc_timeout` ([`Queues::progress`]).
//! While the node computes, the requests holding the pool finish within their token limits
//! and the queue moves, first come first served; under memory pressure a request waits
//! longer, it does not fail.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use ferry_cluster::{Refused, Room};
use tonic::Code;

/// After a retraction, the estimate covers this many more tokens of every running request
/// than it has generated (SGLang's `retract_decode_steps`).
const RETRACT_DECODE_STEPS: usize = 20;

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Waiting for pages.
    Prealloc,
    /// Pages preallocated; KV arriving from the prefill node.
    Transfer,
    /// Pages preallocated; the prompt (and, after a retraction, the tokens generated so far)
    /// is computed here.
    Prefill,
    /// The prompt's KV is complete; joins the batch at the next step.
    Waiting,
    /// Decoding.
    Running,
}

impl Stage {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Prealloc => "prealloc",
            Self::Transfer => "transfer",
            Self::Prefill => "prefill",
            Self::Waiting => "waiting",
            Self::Running => "running",
        }
    }

    /// Every stage, for reporting.
    pub const ALL: [Stage; 5] = [Self::Prealloc, Self::Transfer, Self::Prefill, Self::Waiting, Self::Running];
}

/// How admission estimates the pages a request's decoding will take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission {
    /// `ratio × remaining tokens`, the ratio adapting between `min` and 1 (see the module).
    Adaptive {
        /// The ratio at start.
        init: f64,
        /// Its floor.
        min: f64,
        /// How much it falls per decode step without a retraction.
        decay: f64,
    },
    /// A fixed number of tokens per request.
    Reserved {
        /// Tokens.
        tokens: usize,
    },
}

/// Limits of the queues.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most admitted requests (transfer, prefill, waiting and running together).
    pub max_running: usize,
    /// How long a request may wait for pages while the node makes no progress.
    pub prealloc_timeout: Duration,
    /// How long a complete request may wait to join the batch.
    pub waiting_timeout: Duration,
    /// Tokens per page.
    pub page_size: usize,
    /// The decode estimate.
    pub admission: Admission,
}

struct Entry {
    stage: Stage,
    since: Instant,
    local: bool,
    /// Tokens whose KV the request holds once admitted (its prompt; after a retraction, the
    /// prompt and all but the last generated token).
    context: usize,
    /// Tokens it may generate in all (its max tokens, within the context length).
    limit: usize,
    /// Tokens it generated so far.
    generated: usize,
    /// `Reserved`: pages promised at admission for decoding beyond the context.
    reserve: usize,
    /// Of those, taken so far.
    grown: usize,
    /// Admission order (larger: newer).
    order: u64,
}

/// The decode node's requests.
pub struct Queues {
    entries: HashMap<Room, Entry>,
    prealloc: VecDeque<Room>,
    limits: Limits,
    /// The adaptive estimate's ratio.
    ratio: f64,
    admissions: u64,
    /// The node's last forward pass.
    progress: Option<Instant>,
}

/// A request admitted by [`Queues::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// The room.
    pub room: Room,
    /// Pages to allocate now (its context's).
    pub pages: usize,
    /// Whether it prefills here.
    pub local: bool,
}

/// The request to retract among `candidates` (room, decoded tokens, admission order): the one
/// with the least decoded progress, the newest among equals. Retracting it loses the least
/// work, and the oldest requests keep going, so some request always finishes.
pub fn victim(candidates: &[(Room, usize, u64)]) -> Option<Room> {
    candidates.iter().min_by_key(|&&(_, progress, order)| (progress, std::cmp::Reverse(order))).map(|c| c.0)
}

impl Queues {
    /// Empty queues.
    pub fn new(limits: Limits) -> Self {
        let ratio = match limits.admission {
            Admission::Adaptive { init, .. } => init,
            Admission::Reserved { .. } => 1.0,
        };
        Self { entries: HashMap::new(), prealloc: VecDeque::new(), limits, ratio, admissions: 0, progress: None }
    }

    fn pages(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.limits.page_size.max(1))
    }

    /// A new request with a prompt of `context` tokens that may generate `limit` tokens.
    pub fn push(&mut self, room: Room, context: usize, limit: usize, local: bool, now: Instant) -> Result<(), Refused> {
        if self.entries.contains_key(&room) {
            return Err(Refused::new(Code::AlreadyExists, "duplicate_room", format!("room {room} is already here")));
        }
        let e = Entry {
            stage: Stage::Prealloc,
            since: now,
            local,
            context,
            limit,
            generated: 0,
            reserve: 0,
            grown: 0,
            order: 0,
        };
        self.entries.insert(room, e);
        self.prealloc.push_back(room);
        Ok(())
    }

    /// Pages set aside for admitted requests' decoding and not yet taken.
    pub fn promised(&self) -> usize {
        let admitted = self.entries.values().filter(|e| e.stage != Stage::Prealloc);
        match self.limits.admission {
            Admission::Adaptive { .. } => admitted.map(|e| self.estimate(e.context, e.limit - e.generated)).sum(),
            Admission::Reserved { .. } => admitted.map(|e| e.reserve.saturating_sub(e.grown)).sum(),
        }
    }

    fn admitted(&self) -> usize {
        self.entries.values().filter(|e| e.stage != Stage::Prealloc).count()
    }

    /// Pages the admission estimate sets aside for decoding `remaining` tokens after `context`.
    fn estimate(&self, context: usize, remaining: usize) -> usize {
        let tokens = match self.limits.admission {
            Admission::Adaptive { .. } => (self.ratio * remaining as f64).ceil() as usize,
            Admission::Reserved { tokens } => tokens,
        };
        self.pages(context + tokens.min(remaining)) - self.pages(context)
    }

    /// Admits from the head of the prealloc queue while `free` pages allow; the caller
    /// allocates their pages right away.
    pub fn admit(&mut self, mut free: usize, now: Instant) -> Vec<Admitted> {
        let mut out = Vec::new();
        let mut promised = self.promised();
        let mut admitted = self.admitted();
        while let Some(&room) = self.prealloc.front() {
            let Some(e) = self.entries.get(&room) else {
                self.prealloc.pop_front();
                continue;
            };
            let need = self.pages(e.context);
            let reserve = self.estimate(e.context, e.limit - e.generated);
            if admitted >= self.limits.max_running || free < promised + need + reserve {
                break;
            }
            self.prealloc.pop_front();
            self.admissions += 1;
            let order = self.admissions;
            let Some(e) = self.entries.get_mut(&room) else { continue };
            e.stage = if e.local { Stage::Prefill } else { Stage::Transfer };
            e.since = now;
            e.reserve = reserve;
            e.grown = 0;
            e.order = order;
            free -= need;
            promised += reserve;
            admitted += 1;
            out.push(Admitted { room, pages: need, local: e.local });
        }
        out
    }

    /// Whether a request whose prompt and generation need `pages` pages could ever be
    /// admitted with `total`.
    pub fn could_fit(total: usize, pages: usize) -> bool {
        pages <= total
    }

    /// `room` took `pages` more pages while decoding.
    pub fn grew(&mut self, room: Room, pages: usize) {
        if let Some(e) = self.entries.get_mut(&room) {
            e.grown += pages;
        }
    }

    /// `room` generated a token.
    pub fn token(&mut self, room: Room) {
        if let Some(e) = self.entries.get_mut(&room) {
            e.generated += 1;
        }
    }

    /// `room` (admitted) was retracted: its pages are gone; it must recompute `context` tokens.
    /// It waits at the front of the prealloc queue and prefills locally when admitted again.
    /// The adaptive estimate becomes what the requests still admitted have shown (see the
    /// module). Returns false (and changes nothing) for a room that is not admitted.
    pub fn retract(&mut self, room: Room, context: usize, now: Instant) -> bool {
        let Some(e) = self.entries.get_mut(&room) else { return false };
        if e.stage == Stage::Prealloc {
            return false;
        }
        *e = Entry { stage: Stage::Prealloc, since: now, local: true, context, reserve: 0, grown: 0, ..*e };
        self.prealloc.push_front(room);
        if let Admission::Adaptive { min, .. } = self.limits.admission {
            let admitted = self.entries.values().filter(|e| e.stage != Stage::Prealloc);
            let (n, generated, limit) =
                admitted.fold((0, 0, 0), |(n, g, l), e| (n + 1, g + e.generated, l + e.limit.max(1)));
            let shown = (generated + RETRACT_DECODE_STEPS * n) as f64 / limit.max(1) as f64;
            self.ratio = shown.clamp(min, 1.0);
        }
        true
    }

    /// One decode step ran without a retraction: the adaptive estimate decays.
    pub fn decoded(&mut self) {
        if let Admission::Adaptive { min, decay, .. } = self.limits.admission {
            self.ratio = (self.ratio - decay).max(min);
        }
    }

    /// The adaptive estimate's ratio (1 with a fixed reservation).
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// Admission order of `room` (for [`victim`]); 0 before admission.
    pub fn order(&self, room: Room) -> u64 {
        self.entries.get(&room).map_or(0, |e| e.order)
    }

    /// The node ran a forward pass at `now`.
    pub fn progress(&mut self, now: Instant) {
        self.progress = Some(now);
    }

    /// Moves `room` to `stage`.
    pub fn advance(&mut self, room: Room, stage: Stage, now: Instant) {
        if let Some(e) = self.entries.get_mut(&room) {
            e.stage = stage;
            e.since = now;
        }
    }

    /// The stage of `room`.
    pub fn stage(&self, room: Room) -> Option<Stage> {
        self.entries.get(&room).map(|e| e.stage)
    }

    /// Forgets `room`; returns the stage it was in.
    pub fn remove(&mut self, room: Room) -> Option<Stage> {
        let e = self.entries.remove(&room)?;
        if e.stage == Stage::Prealloc {
            self.prealloc.retain(|&r| r != room);
        }
        Some(e.stage)
    }

    /// Requests past their stage's timeout (prealloc: counted from its arrival or the node's
    /// last forward pass, whichever is later; waiting; transfers time out in the transfer
    /// receiver, local prefill and running do not time out).
    pub fn expired(&self, now: Instant) -> Vec<(Room, Stage)> {
        self.entries
            .iter()
            .filter(|(_, e)| match e.stage {
                Stage::Prealloc => {
                    let from = self.progress.map_or(e.since, |p| p.max(e.since));
                    now.duration_since(from) >= self.limits.prealloc_timeout
                }
                Stage::Waiting => now.duration_since(e.since) >= self.limits.waiting_timeout,
                _ => false,
            })
            .map(|(&r, e)| (r, e.stage))
            .collect()
    }

    /// When the next request would time out as things stand (a forward pass or a new
    /// command may move it later): the engine sleeps until then at most.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter_map(|e| match e.stage {
                Stage::Prealloc => {
                    Some(self.progress.map_or(e.since, |p| p.max(e.since)) + self.limits.prealloc_timeout)
                }
                Stage::Waiting => Some(e.since + self.limits.waiting_timeout),
                _ => None,
            })
            .min()
    }

    /// Whether a forward pass has work: a request prefilling here, waiting to join the
    /// batch, or running.
    pub fn computing(&self) -> bool {
        self.entries.values().any(|e| matches!(e.stage, Stage::Prefill | Stage::Waiting | Stage::Running))
    }

    /// Requests per stage.
    pub fn depth(&self) -> HashMap<Stage, usize> {
        let mut d: HashMap<Stage, usize> = Stage::ALL.iter().map(|&s| (s, 0)).collect();
        for e in self.entries.values() {
            *d.entry(e.stage).or_default() += 1;
        }
        d
    }

    /// Requests known.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no request is known.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests;
