//! What placement reads of a worker, without a lock: its health and the numbers of a decode
//! worker's load report that placement scores (a prefill worker's are on the registry's
//! board, `super::board`, one array per number). Whoever changes the worker's
//! [`super::Health`] (an active check, a call's outcome) publishes them here while holding
//! its lock; placements read them with relaxed atomic loads. A router with a thousand
//! workers used to take a thousand mutexes per request here.
//!
//! The numbers are read one by one, not as one consistent report: a placement racing a report
//! may mix the old numbers with the new. Both are estimates already a poll interval old, so
//! this costs nothing placement could notice.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::time::Instant;

use ferry_proto::v1 as pb;

use super::Health;
use crate::placement::{DecodeState, since_epoch};

/// A worker's placement inputs, published.
#[derive(Debug)]
pub(super) struct View {
    /// An active check or a call has succeeded since it joined.
    seen: AtomicBool,
    /// While its circuit is open: 1 + nanoseconds from the placement epoch until it
    /// half-opens; 0 when closed.
    open_until: AtomicU64,
    /// A load report came.
    reported: AtomicBool,
    /// Free plus evictable pages (a decode worker's).
    admissible_pages: AtomicU64,
    total_pages: AtomicU64,
    /// Requests this router placed on it (a decode worker) and still streams ([`Placed`]).
    placed: AtomicU64,
    /// Requests its last load report counted beyond those this router had placed on it then
    /// (other routers').
    others: AtomicU64,
}

/// A request this router streams from a decode worker, counted in its view's `placed`
/// while it lives: a burst of requests sees the ones before it at once, a poll interval
/// before any load report could.
#[derive(Debug)]
pub struct Placed(std::sync::Arc<super::Worker>);

impl Placed {
    pub(super) fn new(w: std::sync::Arc<super::Worker>) -> Self {
        w.view.placed.fetch_add(1, Relaxed);
        Self(w)
    }
}

impl std::ops::Deref for Placed {
    type Target = std::sync::Arc<super::Worker>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for Placed {
    fn drop(&mut self) {
        self.0.view.placed.fetch_sub(1, Relaxed);
    }
}

impl Default for View {
    fn default() -> Self {
        Self {
            seen: AtomicBool::new(false),
            open_until: AtomicU64::new(0),
            reported: AtomicBool::new(false),
            admissible_pages: AtomicU64::new(0),
            total_pages: AtomicU64::new(0),
            placed: AtomicU64::new(0),
            others: AtomicU64::new(0),
        }
    }
}

impl View {
    /// Publishes `h` (the caller holds its lock, so publications never interleave); its load
    /// report too when `load` (an active check brought a new one; a call's outcome changes
    /// only the breaker, and rewriting numbers every placement reads would cost them).
    pub(super) fn publish(&self, h: &Health, load: bool) {
        self.seen.store(h.seen, Relaxed);
        self.open_until.store(h.open_until.map_or(0, |t| since_epoch(t).saturating_add(1)), Relaxed);
        if let (true, Some(l)) = (load, &h.load) {
            self.publish_load(l);
            // Release: whoever sees `reported` sees the numbers of the first report.
            self.reported.store(true, Release);
        }
    }

    fn publish_load(&self, l: &pb::LoadReport) {
        self.admissible_pages.store(u64::from(l.free_pages) + u64::from(l.evictable_pages), Relaxed);
        self.total_pages.store(u64::from(l.total_pages), Relaxed);
        // A decode worker's queues: prealloc, transfer, waiting, running.
        let requests: u64 = l.queue_depth.values().map(|&n| u64::from(n)).sum();
        self.others.store(requests.saturating_sub(self.placed.load(Relaxed)), Relaxed);
    }

    /// Seen and its circuit not open at `now` ([`Health::healthy`]).
    #[inline]
    pub(super) fn healthy(&self, now: Instant) -> bool {
        let open = self.open_until.load(Relaxed);
        self.seen.load(Relaxed) && (open == 0 || since_epoch(now) >= open - 1)
    }

    pub(super) fn decode_state(&self, now: Instant, excluded: bool, cached_tokens: usize) -> DecodeState {
        let reported = self.reported.load(Acquire);
        DecodeState {
            healthy: !excluded && self.healthy(now),
            // A decode worker's evictable pages are its prefix cache's, given on demand.
            admissible_pages: if reported { self.admissible_pages.load(Relaxed) } else { 0 },
            total_pages: if reported { self.total_pages.load(Relaxed) } else { u64::MAX },
            cached_tokens,
            requests: self.placed.load(Relaxed) + if reported { self.others.load(Relaxed) } else { 0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::placement::{PrefillBoard, PrefillState};

    /// The published view, and the prefill board, answer what the locked health answers, at every step of a
    /// breaker's life and before and after a report.
    #[test]
    fn the_view_agrees_with_the_health_it_publishes() {
        let (mut h, v) = (Health::default(), View::default());
        let t0 = Instant::now();
        let agree = |h: &Health, v: &View, now: Instant| {
            assert_eq!(v.healthy(now), h.healthy(now), "{h:?} at {:?}", now - t0);
            let load = h.load.as_ref();
            // The prefill board as a worker publishes to it (`Board::publish`).
            let mut board = PrefillBoard::default();
            board.set(2, h.ready_at(), &h.prefill_state());
            assert_eq!(board.healthy(2, now), h.healthy(now), "{h:?} at {:?}", now - t0);
            let (queued, rate) = load.map_or((0, 0.0), |l| (l.queued_prefill_tokens, l.prefill_tokens_per_second));
            assert_eq!(board.state(2, now), PrefillState::new(h.healthy(now), queued, rate));
            assert!(!board.healthy(1, now) && !board.healthy(3, now), "free slots");
            let d = v.decode_state(now, false, 3);
            assert_eq!(d.total_pages, load.map_or(u64::MAX, |l| u64::from(l.total_pages)));
            assert_eq!(d.admissible_pages, load.map_or(0, |l| u64::from(l.free_pages + l.evictable_pages)));
            assert!(!v.decode_state(now, true, 0).healthy, "excluded");
        };
        let at = [t0, t0 + Duration::from_millis(1), t0 + super::super::health::OPEN_FOR, t0 + Duration::from_secs(60)];
        let step = |h: &mut Health, f: &dyn Fn(&mut Health)| {
            f(h);
            v.publish(h, true);
            for now in at {
                agree(h, &v, now);
            }
        };
        step(&mut h, &|_| {});
        let report = pb::LoadReport {
            queued_prefill_tokens: 70,
            prefill_tokens_per_second: 1234.5,
            free_pages: 10,
            evictable_pages: 5,
            total_pages: 99,
            ..Default::default()
        };
        step(&mut h, &|h| h.check_ok(report.clone()));
        for _ in 0..super::super::health::TRIP_AFTER {
            step(&mut h, &|h| {
                h.call_failed(t0);
            });
        }
        assert!(!v.healthy(t0), "tripped");
        assert!(v.healthy(t0 + super::super::health::OPEN_FOR), "half-open");
        step(&mut h, &|h| h.call_ok());
        assert!(v.healthy(t0));
    }
}
