//! The receiver's memory windows: which pages each sender's queue pair may write. A room's
//! grant binds one window per run of its pages on the queue pair of the sender that asked
//! (with the room's key, once); nothing else in the arena is writable from the network. The
//! windows are invalidated when the room ends on that connection (its `Done` or `Abort`) or
//! when the receiver closes the room, whichever comes first — before `close` returns, so no
//! later owner of those pages can be written by the old sender — and they die with the queue
//! pair. A window that cannot be invalidated takes its queue pair down with it.
//!
//! On a NIC an invalidation runs in the queue pair's send-queue order: a write already past the
//! NIC when it is posted may still land; none posted by the peer after the room's end can.

use ferry_core::Room;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::verbs::{MemKeys, QueuePair, VerbsError};

/// Work request ids of window binds and invalidations carry this bit (RECVs are numbered by
/// their buffer slot).
pub(super) const WINDOW_WR: u64 = 1 << 63;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A receiver's queue pair, shared by its connection's task (RECVs, grants) and by `close`
/// (invalidations).
pub(super) struct Link<Q> {
    pub qp: Q,
    /// Window binds and invalidations posted and not yet completed.
    pub in_flight: u32,
    /// A window could not be invalidated: the connection ends and the queue pair goes with it.
    pub poisoned: bool,
    next: u64,
}

pub(super) type SharedLink<Q> = Arc<Mutex<Link<Q>>>;

impl<Q: QueuePair> Link<Q> {
    pub fn new(qp: Q) -> SharedLink<Q> {
        Arc::new(Mutex::new(Self { qp, in_flight: 0, poisoned: false, next: 0 }))
    }

    fn next_id(&mut self) -> u64 {
        self.next += 1;
        WINDOW_WR | self.next
    }

    /// Binds a window over `len` bytes at `addr` of `mr`; its remote key.
    pub fn bind(&mut self, mr: MemKeys, addr: u64, len: u64) -> Result<u32, VerbsError> {
        let id = self.next_id();
        let rkey = self.qp.bind_window(id, mr, addr, len)?;
        self.in_flight += 1;
        Ok(rkey)
    }

    fn invalidate(&mut self, rkey: u32) {
        let id = self.next_id();
        match self.qp.invalidate_window(id, rkey) {
            Ok(()) => self.in_flight += 1,
            Err(e) => {
                tracing::warn!(error = %e, "a memory window could not be invalidated: dropping its queue pair");
                self.poisoned = true;
            }
        }
    }
}

struct Grant<Q> {
    link: Weak<Mutex<Link<Q>>>,
    rkeys: Vec<u32>,
}

/// The windows in force, by room.
pub(super) struct Grants<Q>(Mutex<HashMap<Room, Grant<Q>>>);

impl<Q> Default for Grants<Q> {
    fn default() -> Self {
        Self(Mutex::new(HashMap::new()))
    }
}

impl<Q: QueuePair> Grants<Q> {
    /// Records `room`'s windows, bound on `link`.
    pub fn insert(&self, room: Room, link: &SharedLink<Q>, rkeys: Vec<u32>) {
        lock(&self.0).insert(room, Grant { link: Arc::downgrade(link), rkeys });
    }

    /// Invalidates `room`'s windows, if it has any.
    pub fn revoke(&self, room: Room) {
        let Some(g) = lock(&self.0).remove(&room) else { return };
        // A queue pair already gone took its windows with it.
        let Some(link) = g.link.upgrade() else { return };
        let mut l = lock(&link);
        for rkey in g.rkeys {
            l.invalidate(rkey);
        }
    }

    /// Forgets the grants of `link`, whose queue pair is going away.
    pub fn forget(&self, link: &SharedLink<Q>) {
        let me = Arc::downgrade(link);
        lock(&self.0).retain(|_, g| !Weak::ptr_eq(&g.link, &me));
    }

    /// Rooms with windows in force.
    pub fn rooms(&self) -> usize {
        lock(&self.0).len()
    }
}
