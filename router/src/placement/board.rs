//! What placement scores of every prefill worker, one array per number: a router scores a
//! thousand workers on every request, and passes over plain arrays of `f64` vectorize where
//! reading each worker's own published atomics (a pointer, a flag, a branch each) took
//! ~3.3 µs a request at 1,024 workers before the scoring began.

use std::sync::OnceLock;
use std::time::Instant;

use super::PrefillState;

/// The instant every published deadline counts from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds from the process's placement epoch to `t` (0 for instants before it).
pub(crate) fn since_epoch(t: Instant) -> u64 {
    t.saturating_duration_since(epoch()).as_nanos().try_into().unwrap_or(u64::MAX)
}

/// Every prefill slot's placement numbers (a free slot: unhealthy, nothing queued).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillBoard {
    /// From when the worker is healthy, nanoseconds from the epoch (0: now; infinite: not
    /// until something changes — never seen, or no worker in the slot).
    ready_at: Vec<f64>,
    /// Prompt tokens queued, as placement scores them.
    queued: Vec<f64>,
    /// `1 / tokens_per_second`, 0 when not measured.
    seconds_per_token: Vec<f64>,
    /// The states the numbers came from (their `healthy` as of the last change).
    states: Vec<PrefillState>,
    /// Each slot's worker, by its serial (0: none): a placement reads the board and the
    /// registry's members apart, and sends a request only to the worker it scored.
    holders: Vec<u64>,
}

impl PrefillBoard {
    /// A board of `states`, each healthy or not whenever asked.
    pub fn from_states(states: &[PrefillState]) -> Self {
        let mut b = Self::default();
        for (w, s) in states.iter().enumerate() {
            b.set(w, if s.healthy { Some(0) } else { None }, s);
        }
        b
    }

    /// Slots on the board.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// No slots.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Slot `w` (a worker there) is healthy at `now`.
    pub fn healthy(&self, w: usize, now: Instant) -> bool {
        self.ready_at.get(w).is_some_and(|&r| since_epoch(now) as f64 >= r)
    }

    /// Slot `w`'s state at `now` (a free slot's: unhealthy, nothing queued).
    pub fn state(&self, w: usize, now: Instant) -> PrefillState {
        let s = self.states.get(w).copied().unwrap_or(PrefillState::new(false, 0, 0.0));
        PrefillState { healthy: self.healthy(w, now), ..s }
    }

    /// The placement numbers, one array each, over the same slots: from when each is
    /// healthy (nanoseconds from the epoch), its queued tokens and its seconds per token.
    pub(super) fn numbers(&self) -> (&[f64], &[f64], &[f64]) {
        (&self.ready_at, &self.queued, &self.seconds_per_token)
    }

    /// Slot `w` holds a worker in state `s`, healthy from `ready_at` (nanoseconds from the
    /// epoch; None: not until a later change).
    pub(crate) fn set(&mut self, w: usize, ready_at: Option<u64>, s: &PrefillState) {
        self.grow(w);
        self.ready_at[w] = ready_at.map_or(f64::INFINITY, |r| r as f64);
        self.queued[w] = s.queued;
        self.seconds_per_token[w] = s.seconds_per_token;
        self.states[w] = *s;
    }

    /// Slots up to `w` exist (new ones free).
    fn grow(&mut self, w: usize) {
        if self.states.len() <= w {
            let gone = PrefillState::new(false, 0, 0.0);
            self.ready_at.resize(w + 1, f64::INFINITY);
            self.queued.resize(w + 1, 0.0);
            self.seconds_per_token.resize(w + 1, 0.0);
            self.states.resize(w + 1, gone);
            self.holders.resize(w + 1, 0);
        }
    }

    /// Slot `w`'s worker is the one numbered `serial` (0: none), out of placement until it
    /// publishes.
    pub(crate) fn hold(&mut self, w: usize, serial: u64) {
        self.clear(w);
        self.holders[w] = serial;
    }

    /// The serial of slot `w`'s worker when these numbers were its (0: none, or a board not
    /// kept by a registry).
    pub fn holder(&self, w: usize) -> u64 {
        self.holders.get(w).copied().unwrap_or(0)
    }

    /// Slot `w` is free, or its worker out of placement until it publishes.
    pub(crate) fn clear(&mut self, w: usize) {
        self.set(w, None, &PrefillState::new(false, 0, 0.0));
    }

    /// What [`Self::set`] last gave slot `w`, when it has been given anything.
    pub(crate) fn entry(&self, w: usize) -> Option<(Option<u64>, PrefillState)> {
        let r = *self.ready_at.get(w)?;
        Some(((r < f64::INFINITY).then_some(r as u64), self.states[w]))
    }

    /// The epoch's nanoseconds at `now`, as the board compares them.
    pub(super) fn at(now: Instant) -> f64 {
        since_epoch(now) as f64
    }
}
