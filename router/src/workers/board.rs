//! The prefill board placements read ([`PrefillBoard`]: every slot's numbers, one array per
//! number), and who may write each slot. A worker publishes here whenever it publishes its
//! view and its numbers changed (a call's success changes nothing, most of the time): under
//! the board's lock it copies the board with its slot changed and swaps the copy in, so a
//! placement takes the board with one atomic load and never waits. A slot is written only by
//! the worker that holds it: one that left may still finish a call and publish its outcome
//! after a newcomer took its slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::placement::{PrefillBoard, PrefillState};

/// Every prefill slot's placement numbers, and each slot's holder.
#[derive(Debug, Default)]
pub struct Board {
    current: arc_swap::ArcSwap<PrefillBoard>,
    /// Each slot's worker ([`serial`]; 0: none).
    holders: Mutex<Vec<u64>>,
}

/// A number no other worker of this process has (from 1).
pub(super) fn serial() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Board {
    /// The board as placements read it: one atomic load.
    pub fn load(&self) -> Arc<PrefillBoard> {
        self.current.load_full()
    }

    /// Worker `serial` holds `slot` from now, out of placement until it publishes.
    pub(super) fn claim(&self, slot: usize, serial: u64) {
        let mut holders = self.holders.lock();
        if holders.len() <= slot {
            holders.resize(slot + 1, 0);
        }
        holders[slot] = serial;
        self.change(|b| b.hold(slot, serial));
    }

    /// Worker `serial` left `slot` (nothing, when another holds it now).
    pub(super) fn release(&self, slot: usize, serial: u64) {
        let mut holders = self.holders.lock();
        if holders.get(slot) == Some(&serial) {
            holders[slot] = 0;
            self.change(|b| b.hold(slot, 0));
        }
    }

    /// Worker `serial`, in `slot`, is in state `s`, healthy from `ready_at` (nanoseconds from
    /// the placement epoch; None: not until it changes). Nothing when another holds the slot
    /// or nothing changed.
    pub(super) fn publish(&self, slot: usize, serial: u64, ready_at: Option<u64>, s: &PrefillState) {
        // Most publications (a call's success) change nothing: seen without the lock every
        // worker's publications share. (Whoever holds the slot, nothing would be written.)
        let unchanged = || self.current.load().entry(slot) == Some((ready_at, *s));
        if unchanged() {
            return;
        }
        let holders = self.holders.lock();
        if holders.get(slot) != Some(&serial) || unchanged() {
            return;
        }
        self.change(|b| b.set(slot, ready_at, s));
    }

    /// Swaps in a copy of the board changed by `f`; the caller holds the lock.
    fn change(&self, f: impl FnOnce(&mut PrefillBoard)) {
        let mut b = PrefillBoard::clone(&self.current.load());
        f(&mut b);
        self.current.store(Arc::new(b));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// A slot is written by its holder only: a worker that left and publishes a call's outcome
    /// late leaves its successor's numbers alone; a publication that changes nothing does not
    /// copy the board.
    #[test]
    fn only_a_slots_holder_writes_it() {
        let (b, now) = (Board::default(), Instant::now());
        let (old, new) = (serial(), serial());
        b.claim(1, old);
        assert_eq!(b.load().len(), 2, "slots below a claimed one exist, free");
        assert_eq!((b.load().holder(0), b.load().holder(1)), (0, old));
        assert!(!b.load().healthy(1, now), "out of placement until it publishes");
        b.publish(1, old, Some(0), &PrefillState::new(true, 10, 100.0));
        assert_eq!(b.load().state(1, now), PrefillState::new(true, 10, 100.0));
        let before = b.load();
        b.publish(1, old, Some(0), &PrefillState::new(true, 10, 100.0));
        assert!(Arc::ptr_eq(&before, &b.load()), "nothing changed: no copy");
        b.release(1, old);
        assert!(!b.load().healthy(1, now));
        assert_eq!(b.load().holder(1), 0, "left");
        b.claim(1, new);
        assert_eq!(b.load().holder(1), new);
        b.publish(1, new, Some(0), &PrefillState::new(true, 7, 50.0));
        b.publish(1, old, Some(0), &PrefillState::new(true, 999, 1.0));
        b.release(1, old);
        assert_eq!(b.load().state(1, now), PrefillState::new(true, 7, 50.0), "the leaver wrote nothing");
        b.publish(1, new, None, &PrefillState::new(true, 7, 50.0));
        assert!(!b.load().healthy(1, now), "tripped");
        assert!(!b.load().healthy(0, now) && !b.load().healthy(5, now));
    }
}
