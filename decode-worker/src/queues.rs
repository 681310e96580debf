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
//!   The ratio starts at `init` and falls in equal parts over `steps` decode steps to `min`; a
//!   retraction sets it to what the running requests have shown, `(Σ generated + 20 ×
//!   running) / Σ max tokens`, at most 1, from where it falls to `min` over `steps` again. Memory is used, not held idle for tokens most requests never
//!   generate;
//! - `Reserved`: a fixed number of tokens (capped by what the request may generate), promised
//!   at admission and kept until taken.
//!
//! **Retraction** keeps the promise "an admitted request is never cut" whatever the estimate:
//! before each forward pass ([`Event::MakeRoom`]) every running request gets the pages its
//! next token needs; when the pool is short the queues retract a victim ([`victim`]: least
//! decoded progress first, then the newest) and tell the engine to drop its pages
//! ([`Action::Retract`]) until it is not. The victim goes to the *front* of the prealloc
//! queue with the context it must recompute (its prompt and all but its last generated
//! token), prefills locally when admitted again, and resumes where it was.
//!
//! **Forks** (`n` > 1): a request for `n` sequences is admitted with the pages of its context
//! and one more page for each other sequence, and an estimate for `n` decodings. Once its
//! prompt's KV is complete ([`Event::Fork`]) the other sequences join as requests of their
//! own, prefilling here only the prompt's last token (into their own copy of its last,
//! partial page); the prompt's full pages become a *group* the sequences share, returned when
//! the last of them ends or is retracted (a retracted sequence leaves the group and
//! recomputes its whole context alone).
//!
//! **Waiting for pages** is bounded by progress, not by age: a request in prealloc times out
//! only when the node has run no forward pass for `prealloc_timeout` ([`Event::Stepped`]).
//! While the node computes, the requests holding the pool finish within their token limits
//! and the queue moves, first come first served; under memory pressure a request waits
//! longer, it does not fail.
//!
//! **Refusals** are the queues' too: a request that could never run here whole (more sequences
//! than the node runs, more pages than the pool), whose constraints do not match its
//! sequences, or whose room id is taken is refused before anything is held ([`Refusal`]); a
//! transfer's end or a failed handshake counts only while the request is still in Transfer.
//!
//! **One entry point**: [`Queues::on`] takes an [`Event`] and returns the [`Action`]s the
//! engine carries out. The queues count the pages of every request they admit, grow, retract
//! and end, and the pages of ended requests whose receiver room is still being written
//! (*draining*): `free + held + draining = pool` at every step, and the engine checks that the
//! pool agrees ([`Queues::free_pages`]).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use ferry_cluster::Room;

mod admission;
mod event;
pub use admission::victim;
pub use event::{Action, Event, Refusal};

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
        /// Decode steps without a retraction for it to fall to `min` (from `init`, or from
        /// where a retraction set it), in equal steps.
        steps: u32,
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
    /// Prompt tokens.
    prompt: usize,
    /// Pages it holds.
    held: usize,
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
    /// Sequences it stands for: `n` until it forks, then 1 (each sequence an entry).
    n: usize,
    /// Pages at the front of its context read from its group, not held.
    shared: usize,
    /// The fork group whose pages it shares (the room of its first sequence).
    group: Option<Room>,
}

impl Entry {
    /// Tokens whose KV it holds once admitted: its prompt and all but its last generated
    /// token (the next step's input).
    fn context(&self) -> usize {
        self.prompt + self.generated.saturating_sub(1)
    }

    /// Tokens it may still generate.
    fn remaining(&self) -> usize {
        self.limit.saturating_sub(self.generated)
    }
}

/// The pages sequences forked from one prompt share.
struct Group {
    /// Pages.
    pages: usize,
    /// Sequences still reading them.
    members: usize,
}

/// The decode node's requests.
pub struct Queues {
    entries: HashMap<Room, Entry>,
    prealloc: VecDeque<Room>,
    limits: Limits,
    /// Pages in the pool.
    pool: usize,
    /// Pages held by requests and by draining ones.
    used: usize,
    /// Ended requests whose pages a closed receiver room may still write: their pages.
    draining: HashMap<Room, usize>,
    /// Fork groups, by the room of their first sequence.
    groups: HashMap<Room, Group>,
    /// Whether the last [`Event::MakeRoom`] retracted a request.
    retracted: bool,
    /// The adaptive estimate's ratio.
    ratio: f64,
    /// How much it falls per decode step without a retraction.
    fall: f64,
    admissions: u64,
    /// The node's last forward pass.
    progress: Option<Instant>,
}

impl Queues {
    /// Empty queues over a pool of `pool` pages.
    pub fn new(limits: Limits, pool: usize) -> Self {
        let (ratio, fall) = match limits.admission {
            Admission::Adaptive { init, min, steps } => (init, admission::fall(init, min, steps)),
            Admission::Reserved { .. } => (1.0, 0.0),
        };
        Self {
            entries: HashMap::new(),
            prealloc: VecDeque::new(),
            limits,
            pool,
            used: 0,
            draining: HashMap::new(),
            groups: HashMap::new(),
            retracted: false,
            ratio,
            fall,
            admissions: 0,
            progress: None,
        }
    }

    /// What follows from `ev` at `now`, for the engine to carry out in order.
    pub fn on(&mut self, ev: Event, now: Instant) -> Vec<Action> {
        match ev {
            Event::Request { room, prompt, limit, local, n, forks } => self
                .push(room, prompt, limit, local, (n.max(1), forks), now)
                .err()
                .map(Action::Refuse)
                .into_iter()
                .collect(),
            Event::Fork { room, children } => {
                self.fork(room, &children, now);
                Vec::new()
            }
            Event::Admit => self.admit(now),
            Event::TransferEnded { room, ok } => match self.stage(room) {
                Some(Stage::Transfer) if ok => vec![Action::Land(room)],
                Some(Stage::Transfer) => vec![Action::Fail(room)],
                _ => Vec::new(),
            },
            Event::Transferred(room) => {
                self.advance(room, Stage::Transfer, Stage::Waiting, now);
                Vec::new()
            }
            Event::Computed(room) => {
                self.advance(room, Stage::Prefill, Stage::Running, now);
                Vec::new()
            }
            Event::Joined(room) => {
                self.advance(room, Stage::Waiting, Stage::Running, now);
                Vec::new()
            }
            Event::Token(room) => {
                if let Some(e) = self.entries.get_mut(&room) {
                    e.generated += 1;
                }
                Vec::new()
            }
            Event::GrowFailed { room, pages } => {
                if let Some(e) = self.entries.get_mut(&room) {
                    let pages = pages.min(e.held);
                    e.held -= pages;
                    e.grown = e.grown.saturating_sub(pages);
                    self.used -= pages;
                }
                Vec::new()
            }
            Event::MakeRoom => self.make_room(now),
            Event::Stepped { decoding } => {
                self.progress = Some(now);
                if decoding && !std::mem::take(&mut self.retracted) {
                    self.decoded();
                }
                Vec::new()
            }
            Event::End { room, writing } => self.end(room, writing),
            Event::Released(room) => match self.draining.remove(&room) {
                Some(pages) => {
                    self.used -= pages;
                    vec![Action::Free { room, pages }]
                }
                None => Vec::new(),
            },
            Event::Tick => self.expired(now).into_iter().map(|(room, stage)| Action::Expired { room, stage }).collect(),
        }
    }

    /// Pages neither held by a request nor draining: what the pool must have free.
    pub fn free_pages(&self) -> usize {
        self.pool - self.used
    }

    /// Pages held by `room` (0 when unknown or waiting for pages).
    pub fn held(&self, room: Room) -> usize {
        self.entries.get(&room).map_or(0, |e| e.held)
    }

    /// Pages of ended requests that may still be written.
    pub fn draining(&self) -> usize {
        self.draining.values().sum()
    }

    /// Whether `room` names a fork group (the room of a request whose sequences live on).
    pub fn is_grouped(&self, room: Room) -> bool {
        self.groups.contains_key(&room)
    }

    /// Pages fork groups share.
    pub fn shared(&self) -> usize {
        self.groups.values().map(|g| g.pages).sum()
    }

    /// Whether an ended request of `room` still has pages draining.
    pub fn is_draining(&self, room: Room) -> bool {
        self.draining.contains_key(&room)
    }

    /// Rooms in `stage`.
    pub fn in_stage(&self, stage: Stage) -> Vec<Room> {
        let mut rooms: Vec<Room> = self.entries.iter().filter(|(_, e)| e.stage == stage).map(|(&r, _)| r).collect();
        rooms.sort_unstable();
        rooms
    }

    fn pages(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.limits.page_size.max(1))
    }

    /// A new request for `n` sequences of a prompt of `prompt` tokens that may each generate
    /// `limit` tokens, with `forks` constraints for its other sequences. Refused, before
    /// anything is held, when it could never run here whole (more sequences than the node
    /// runs at once, or more pages than the pool), when its constraints do not match its
    /// sequences, or when its room id is taken.
    fn push(
        &mut self,
        room: Room,
        prompt: usize,
        limit: usize,
        local: bool,
        (n, forks): (usize, usize),
        now: Instant,
    ) -> Result<(), Refusal> {
        let max = self.limits.max_running;
        if n > max {
            return Err(Refusal::NOverBatch { n, max });
        }
        // Whole, never half way: a request that cannot fit the pool even alone is refused
        // now; any other is admitted in time and never cut. Forked sequences share the
        // prompt's full pages.
        let need = ferry_cluster::fork_pages(prompt, prompt + limit, n, self.limits.page_size);
        if !Self::could_fit(self.pool, need) {
            return Err(Refusal::OverPool { prompt, limit, n, need, pool: self.pool });
        }
        if forks != n - 1 {
            return Err(Refusal::ForkConstraints { given: forks, n });
        }
        if self.entries.contains_key(&room) || self.groups.contains_key(&room) {
            return Err(Refusal::DuplicateRoom);
        }
        if self.draining.contains_key(&room) {
            // An earlier request of this room id still has a page run being written: the id
            // is not free until that write ends (issue 21's stale write).
            return Err(Refusal::RoomClosing);
        }
        let e = Entry {
            stage: Stage::Prealloc,
            since: now,
            local,
            prompt,
            held: 0,
            limit,
            generated: 0,
            reserve: 0,
            grown: 0,
            order: 0,
            n,
            shared: 0,
            group: None,
        };
        self.entries.insert(room, e);
        self.prealloc.push_back(room);
        Ok(())
    }

    /// Admission order of `room` (for [`victim`]); 0 before admission.
    pub fn order(&self, room: Room) -> u64 {
        self.entries.get(&room).map_or(0, |e| e.order)
    }

    /// Moves `room` from `from` to `to` (nothing when it is elsewhere).
    fn advance(&mut self, room: Room, from: Stage, to: Stage, now: Instant) {
        if let Some(e) = self.entries.get_mut(&room).filter(|e| e.stage == from) {
            e.stage = to;
            e.since = now;
        }
    }

    /// The stage of `room`.
    pub fn stage(&self, room: Room) -> Option<Stage> {
        self.entries.get(&room).map(|e| e.stage)
    }

    /// `room`'s prompt KV is complete: its other sequences (`children`, one fewer than it
    /// stands for) join, each holding a page of the pages it was admitted with and reading
    /// the prompt's full pages with it (see the module). Nothing when it stands for one.
    fn fork(&mut self, room: Room, children: &[Room], now: Instant) {
        let Some(e) = self.entries.get(&room) else { return };
        if e.n != children.len() + 1 || e.n < 2 || matches!(e.stage, Stage::Prealloc | Stage::Transfer) {
            return;
        }
        let taken =
            |c: &Room| self.entries.contains_key(c) || self.draining.contains_key(c) || self.groups.contains_key(c);
        if children.iter().any(taken) {
            return;
        }
        let (n, shared) = (e.n, ferry_cluster::fork_shared_pages(e.prompt, self.limits.page_size));
        let Some(e) = self.entries.get_mut(&room) else { return };
        let Some(own) = e.held.checked_sub(shared + n - 1) else { return };
        let reserve = e.reserve / n;
        *e = Entry { n: 1, shared, group: Some(room), held: own, reserve, grown: 0, ..*e };
        let child = Entry { stage: Stage::Prefill, since: now, local: true, held: 1, generated: 0, ..*e };
        for &c in children {
            self.entries.insert(c, Entry { ..child });
        }
        self.groups.insert(room, Group { pages: shared, members: n });
    }

    /// `room` stops reading its group's pages: the pages that go back with it (the group's,
    /// when it was the last member).
    fn leave(&mut self, room: Room) -> usize {
        let Some(e) = self.entries.get_mut(&room) else { return 0 };
        let Some(g) = e.group.take() else { return 0 };
        e.shared = 0;
        let Some(group) = self.groups.get_mut(&g) else { return 0 };
        group.members -= 1;
        if group.members > 0 {
            return 0;
        }
        let pages = group.pages;
        self.groups.remove(&g);
        self.used -= pages;
        pages
    }

    /// Forgets `room`: its pages go back, or aside while a write may land in them.
    fn end(&mut self, room: Room, writing: bool) -> Vec<Action> {
        // A sequence of a fork is never written by a transfer: its group's pages go now.
        let group = self.leave(room);
        let Some(e) = self.entries.remove(&room) else { return Vec::new() };
        if e.stage == Stage::Prealloc {
            self.prealloc.retain(|&r| r != room);
        }
        if group > 0 {
            self.used -= e.held;
            return vec![Action::Free { room, pages: e.held + group }];
        }
        match (e.held, writing) {
            (0, _) => Vec::new(),
            (pages, true) => {
                self.draining.insert(room, pages);
                vec![Action::Drain { room, pages }]
            }
            (pages, false) => {
                self.used -= pages;
                vec![Action::Free { room, pages }]
            }
        }
    }

    /// Requests past their stage's timeout (prealloc: counted from its arrival or the node's
    /// last forward pass, whichever is later; waiting; transfers time out in the transfer
    /// receiver, local prefill and running do not time out).
    fn expired(&self, now: Instant) -> Vec<(Room, Stage)> {
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
mod props;
#[cfg(test)]
mod table;
#[cfg(test)]
mod tests;
