//! The decode node's queues as a pure state machine (no I/O, the caller's clock):
//! **prealloc** (waiting for pages) → **transfer** (pages arriving from a prefill node) or
//! **prefill** (computed here: local prefill) → **waiting** (complete, not yet batched) →
//! **running** (continuous batching). A request leaves from any state; its pages go with it.
//!
//! Admission is first come, first served: the head of the prealloc queue is admitted when the
//! free pages cover its prompt *and* its decode reservation on top of every reservation
//! already promised to admitted requests — so a running request never has to be pushed out
//! to make room for a newer one. A request that cannot be admitted blocks those behind it.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use ferry_cluster::Refused;
use tonic::Code;

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Waiting for pages.
    Prealloc,
    /// Pages preallocated; KV arriving from the prefill node.
    Transfer,
    /// Pages preallocated; the prompt is computed here.
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

/// Limits of the queues.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most admitted requests (transfer, prefill, waiting and running together).
    pub max_running: usize,
    /// How long a request may wait for pages.
    pub prealloc_timeout: Duration,
    /// How long a complete request may wait to join the batch.
    pub waiting_timeout: Duration,
}

struct Entry {
    stage: Stage,
    since: Instant,
    local: bool,
    /// Pages for the prompt, taken at admission.
    need: usize,
    /// Pages promised for decoding beyond the prompt.
    reserve: usize,
    /// Of those, taken so far.
    grown: usize,
}

/// The decode node's requests.
pub struct Queues {
    entries: HashMap<u64, Entry>,
    prealloc: VecDeque<u64>,
    limits: Limits,
}

/// A request admitted by [`Queues::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// The room.
    pub room: u64,
    /// Pages to allocate now (the prompt's).
    pub pages: usize,
    /// Whether it prefills here.
    pub local: bool,
}

impl Queues {
    /// Empty queues.
    pub fn new(limits: Limits) -> Self {
        Self { entries: HashMap::new(), prealloc: VecDeque::new(), limits }
    }

    /// A new request needing `need` pages for its prompt and `reserve` more for decoding.
    pub fn push(&mut self, room: u64, need: usize, reserve: usize, local: bool, now: Instant) -> Result<(), Refused> {
        if self.entries.contains_key(&room) {
            return Err(Refused::new(Code::AlreadyExists, "duplicate_room", format!("room {room} is already here")));
        }
        self.entries.insert(room, Entry { stage: Stage::Prealloc, since: now, local, need, reserve, grown: 0 });
        self.prealloc.push_back(room);
        Ok(())
    }

    /// Pages promised to admitted requests and not yet taken.
    pub fn promised(&self) -> usize {
        self.entries.values().filter(|e| e.stage != Stage::Prealloc).map(|e| e.reserve.saturating_sub(e.grown)).sum()
    }

    fn admitted(&self) -> usize {
        self.entries.values().filter(|e| e.stage != Stage::Prealloc).count()
    }

    /// Admits from the head of the prealloc queue while `free` pages allow; the caller
    /// allocates their pages right away.
    pub fn admit(&mut self, mut free: usize, now: Instant) -> Vec<Admitted> {
        let mut out = Vec::new();
        let mut promised = self.promised();
        let mut admitted = self.admitted();
        while let Some(&room) = self.prealloc.front() {
            let Some(e) = self.entries.get_mut(&room) else {
                self.prealloc.pop_front();
                continue;
            };
            if admitted >= self.limits.max_running || free < promised + e.need + e.reserve {
                break;
            }
            self.prealloc.pop_front();
            e.stage = if e.local { Stage::Prefill } else { Stage::Transfer };
            e.since = now;
            free -= e.need;
            promised += e.reserve;
            admitted += 1;
            out.push(Admitted { room, pages: e.need, local: e.local });
        }
        out
    }

    /// Whether a request needing `need + reserve` pages could ever be admitted with `total`.
    pub fn could_fit(total: usize, need: usize, reserve: usize) -> bool {
        need + reserve <= total
    }

    /// `room` took `pages` more pages while decoding.
    pub fn grew(&mut self, room: u64, pages: usize) {
        if let Some(e) = self.entries.get_mut(&room) {
            e.grown += pages;
        }
    }

    /// Whether `room` may take another page without touching others' reservations, given
    /// `free` pages.
    pub fn may_grow(&self, room: u64, free: usize) -> bool {
        match self.entries.get(&room) {
            Some(e) if e.grown < e.reserve => true,
            Some(_) => free > self.promised(),
            None => false,
        }
    }

    /// Moves `room` to `stage`.
    pub fn advance(&mut self, room: u64, stage: Stage, now: Instant) {
        if let Some(e) = self.entries.get_mut(&room) {
            e.stage = stage;
            e.since = now;
        }
    }

    /// The stage of `room`.
    pub fn stage(&self, room: u64) -> Option<Stage> {
        self.entries.get(&room).map(|e| e.stage)
    }

    /// Forgets `room`; returns the stage it was in.
    pub fn remove(&mut self, room: u64) -> Option<Stage> {
        let e = self.entries.remove(&room)?;
        if e.stage == Stage::Prealloc {
            self.prealloc.retain(|&r| r != room);
        }
        Some(e.stage)
    }

    /// Requests past their stage's timeout (prealloc and waiting; transfers time out in the
    /// transfer receiver, local prefill and running do not time out).
    pub fn expired(&self, now: Instant) -> Vec<(u64, Stage)> {
        self.entries
            .iter()
            .filter(|(_, e)| match e.stage {
                Stage::Prealloc => now.duration_since(e.since) >= self.limits.prealloc_timeout,
                Stage::Waiting => now.duration_since(e.since) >= self.limits.waiting_timeout,
                _ => false,
            })
            .map(|(&r, e)| (r, e.stage))
            .collect()
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
mod tests {
    use super::*;

    fn queues(max_running: usize) -> Queues {
        let s = Duration::from_secs(1);
        Queues::new(Limits { max_running, prealloc_timeout: s, waiting_timeout: 2 * s })
    }

    #[test]
    fn admission_keeps_every_reservation_and_is_first_come_first_served() {
        let t0 = Instant::now();
        let mut q = queues(8);
        q.push(1, 4, 2, false, t0).expect("new");
        q.push(2, 3, 2, true, t0).expect("new");
        q.push(3, 1, 0, false, t0).expect("new");
        // 10 free: room 1 takes 4 + promises 2; room 2 needs 3 + 2 on top of 2 promised: 4 left.
        let a = q.admit(10, t0);
        assert_eq!(a, vec![Admitted { room: 1, pages: 4, local: false }]);
        assert_eq!(q.promised(), 2);
        // Room 3 would fit, but room 2 is ahead: head of line blocks.
        assert!(q.admit(6, t0).is_empty());
        let a = q.admit(7, t0);
        assert_eq!(a.iter().map(|x| x.room).collect::<Vec<_>>(), vec![2]);
        assert_eq!(q.stage(2), Some(Stage::Prefill));
        q.grew(1, 2);
        assert!(q.may_grow(2, 0), "room 2 still has its reservation");
        assert!(!q.may_grow(1, 2), "room 1 used its own; the 2 free pages are promised to room 2");
        assert_eq!(q.promised(), 2);
        assert_eq!(q.remove(1), Some(Stage::Transfer));
        assert_eq!(q.admit(1, t0).iter().map(|x| x.room).collect::<Vec<_>>(), Vec::<u64>::new());
        assert_eq!(q.admit(3, t0).iter().map(|x| x.room).collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn limits_duplicates_and_timeouts() {
        let t0 = Instant::now();
        let mut q = queues(1);
        q.push(1, 1, 0, false, t0).expect("new");
        assert_eq!(q.push(1, 1, 0, false, t0).map_err(|e| e.reason), Err("duplicate_room"));
        q.push(2, 1, 0, false, t0).expect("new");
        assert_eq!(q.admit(100, t0).len(), 1, "max_running = 1");
        q.advance(1, Stage::Waiting, t0);
        let s = Duration::from_secs(1);
        assert_eq!(q.expired(t0 + s), vec![(2, Stage::Prealloc)]);
        let mut late = q.expired(t0 + 2 * s);
        late.sort_unstable_by_key(|x| x.0);
        assert_eq!(late, vec![(1, Stage::Waiting), (2, Stage::Prealloc)]);
        assert!(Queues::could_fit(10, 6, 4) && !Queues::could_fit(10, 6, 5));
        assert_eq!(q.depth()[&Stage::Waiting], 1);
    }
}
