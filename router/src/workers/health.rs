//! A worker's circuit breaker: what its active checks and the router's calls to it say of
//! it, and whether placement may use it.

use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;

use crate::placement::PrefillState;

/// Consecutive failures that open a worker's circuit.
pub(super) const TRIP_AFTER: u32 = 3;
/// How long an open circuit keeps a worker out of placement.
pub(super) const OPEN_FOR: Duration = Duration::from_secs(2);

/// A worker's circuit breaker, fed by the active checks and by calls, counted apart: a
/// passing health check does not clear failed calls (a worker whose health endpoint answers
/// while its calls fail stays out of placement), only a call that succeeds does.
#[derive(Debug, Default)]
pub(super) struct Health {
    /// Consecutive failed active checks.
    pub(super) check_failures: u32,
    /// Consecutive failed calls.
    pub(super) call_failures: u32,
    pub(super) open_until: Option<Instant>,
    /// Its circuit opened and has not closed since (reopening after the half-open time
    /// included): one outage, told once.
    pub(super) out: bool,
    pub(super) load: Option<pb::LoadReport>,
    pub(super) seen: bool,
}

impl Health {
    /// What [`view::View::healthy`] answers once this is published.
    #[cfg(test)]
    pub(super) fn healthy(&self, now: Instant) -> bool {
        self.seen && self.open_until.is_none_or(|t| now >= t)
    }

    /// From when it is healthy, nanoseconds from the placement epoch (0: now); None: not
    /// until something changes ([`Self::healthy`] as the prefill board keeps it).
    pub(super) fn ready_at(&self) -> Option<u64> {
        self.seen.then(|| self.open_until.map_or(0, crate::placement::since_epoch))
    }

    /// What placement scores of it as a prefill worker (its `healthy` as of no time in
    /// particular: the board keeps [`Self::ready_at`]).
    pub(super) fn prefill_state(&self) -> PrefillState {
        let (queued, rate) =
            self.load.as_ref().map_or((0, 0.0), |l| (l.queued_prefill_tokens, l.prefill_tokens_per_second));
        PrefillState::new(self.seen, queued, rate)
    }

    /// Opens the circuit when either count reached [`TRIP_AFTER`] and it is not open now (a
    /// half-open worker that fails again reopens at once); true when this opened it.
    pub(super) fn trip(&mut self, now: Instant) -> bool {
        let tripped = self.check_failures.max(self.call_failures) >= TRIP_AFTER;
        if tripped && self.open_until.is_none_or(|t| now >= t) {
            self.open_until = Some(now + OPEN_FOR);
            self.out = true;
            return true;
        }
        false
    }

    /// Closes the circuit.
    pub(super) fn close(&mut self) {
        self.open_until = None;
        self.out = false;
    }

    pub(super) fn call_ok(&mut self) {
        self.call_failures = 0;
        if self.check_failures < TRIP_AFTER {
            self.close();
        }
        self.seen = true;
    }

    pub(super) fn call_failed(&mut self, now: Instant) -> bool {
        self.call_failures += 1;
        self.trip(now)
    }

    pub(super) fn check_ok(&mut self, load: pb::LoadReport) {
        self.check_failures = 0;
        self.load = Some(load);
        self.seen = true;
        if self.call_failures < TRIP_AFTER {
            self.close();
        }
    }

    pub(super) fn check_failed(&mut self, now: Instant) -> bool {
        self.check_failures += 1;
        self.trip(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 21's defect 8: every passing health check used to clear the breaker, so a worker
    /// failing its calls kept getting traffic.
    #[test]
    fn passing_health_checks_do_not_clear_failed_calls() {
        let t0 = Instant::now();
        let mut h = Health::default();
        h.check_ok(pb::LoadReport::default());
        assert!(h.healthy(t0));
        assert!(!h.call_failed(t0) && !h.call_failed(t0));
        assert!(h.call_failed(t0), "the third failed call opens the circuit");
        h.check_ok(pb::LoadReport::default());
        assert!(!h.healthy(t0), "its health endpoint answering does not close it");
        // Half-open after OPEN_FOR: one more failed call reopens it at once.
        let later = t0 + OPEN_FOR;
        assert!(h.healthy(later));
        assert!(h.call_failed(later));
        assert!(!h.healthy(later));
        // A call that succeeds closes it.
        h.call_ok();
        assert!(h.healthy(later));
        // Failed checks trip it on their own, and a passing check closes what they opened.
        for _ in 0..TRIP_AFTER {
            h.check_failed(later);
        }
        assert!(!h.healthy(later));
        h.check_ok(pb::LoadReport::default());
        assert!(h.healthy(later));
    }

    /// A worker that stays unreachable reopens its circuit every `OPEN_FOR`; the router told
    /// the operator so every time (a warning every 2 s while a worker was frozen). One outage
    /// is one `out` spell, from the circuit opening to its closing.
    #[test]
    fn an_outage_is_one_spell_however_often_the_circuit_reopens() {
        let t0 = Instant::now();
        let mut h = Health::default();
        h.check_ok(pb::LoadReport::default());
        for _ in 1..TRIP_AFTER {
            h.check_failed(t0);
        }
        assert!(!h.out);
        assert!(h.check_failed(t0) && h.out, "opened: out");
        let later = t0 + OPEN_FOR;
        assert!(h.check_failed(later), "half-open, failing again: reopened");
        assert!(h.out, "still the same outage");
        h.check_ok(pb::LoadReport::default());
        assert!(!h.out && h.healthy(later), "closed: back");
        // Calls that fail open it too; a passing check does not close what calls opened.
        for _ in 0..TRIP_AFTER {
            h.call_failed(later);
        }
        h.check_ok(pb::LoadReport::default());
        assert!(h.out, "failed calls keep it out");
        h.call_ok();
        assert!(!h.out);
    }
}
