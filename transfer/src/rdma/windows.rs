//! The receiver's memory windows: which pages each sender's queue pair may write. A room's
//! grant binds one window per run of its pages on the queue pair of the sender that asked
//! (with the room's key, once); nothing else in the arena is writable from the network.
//!
//! The grant is a **lease** on the room's pages: they are not reused while it lasts. It ends
//! when the sender ends the room on that connection (its `Done` or `Abort`), when the queue
//! pair goes, or — for a room the receiver closed while its sender may still be writing (a
//! cancelled request) — after the transferring timeout. Only then are the windows
//! invalidated and the pages released. So a closing room never breaks the queue pair that
//! other rooms share (a write into an invalidated window would), and no later owner of the
//! pages can be written by the old sender. A window that cannot be invalidated takes its queue
//! pair down with it.
//!
//! On a NIC an invalidation runs in the queue pair's send-queue order: a write already past the
//! NIC when it is posted may still land; none posted by the peer after the room's end can.

use ferry_core::Room;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

use super::verbs::{MemKeys, QueuePair, VerbsError};

/// Work request ids of window binds and invalidations carry this bit (RECVs are numbered by
/// their buffer slot).
pub(super) const WINDOW_WR: u64 = 1 << 63;

/// A receiver's queue pair, shared by its connection's task (RECVs, grants) and by `close`
/// (invalidations).
pub(super) struct Link<Q> {
    pub qp: Q,
    /// Window binds and invalidations posted and not yet completed.
    pub in_flight: u32,
    /// Work requests the send queue holds: invalidations past it wait in `pending`.
    pub cap: u32,
    /// Invalidations waiting for room in the send queue (posted as completions free it).
    pending: std::collections::VecDeque<u32>,
    /// A window could not be invalidated: the connection ends and the queue pair goes with it.
    pub poisoned: bool,
    next: u64,
}

pub(super) type SharedLink<Q> = Arc<Mutex<Link<Q>>>;

impl<Q: QueuePair> Link<Q> {
    pub fn new(qp: Q, cap: u32) -> SharedLink<Q> {
        let cap = cap.max(1);
        Arc::new(Mutex::new(Self { qp, in_flight: 0, cap, pending: Default::default(), poisoned: false, next: 0 }))
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

    /// Invalidates the window `rkey` now, or as soon as the send queue has room.
    fn invalidate(&mut self, rkey: u32) {
        self.pending.push_back(rkey);
        self.post_pending();
    }

    /// A window operation completed: its send-queue slot is free again.
    pub fn window_done(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.post_pending();
    }

    /// Posts waiting invalidations while the send queue has room.
    fn post_pending(&mut self) {
        while self.in_flight < self.cap {
            let Some(rkey) = self.pending.pop_front() else { return };
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

    /// Whether invalidations wait for the send queue (binds must not take their room).
    pub fn waiting(&self) -> bool {
        !self.pending.is_empty()
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
        self.0.lock().insert(room, Grant { link: Arc::downgrade(link), rkeys });
    }

    /// Invalidates `room`'s windows, if it has any.
    pub fn revoke(&self, room: Room) {
        let Some(g) = self.0.lock().remove(&room) else { return };
        // A queue pair already gone took its windows with it.
        let Some(link) = g.link.upgrade() else { return };
        let mut l = link.lock();
        for rkey in g.rkeys {
            l.invalidate(rkey);
        }
    }

    /// Forgets the grants of `link`, whose queue pair is going away; their rooms.
    pub fn forget(&self, link: &SharedLink<Q>) -> Vec<Room> {
        let me = Arc::downgrade(link);
        let mut gone = Vec::new();
        self.0.lock().retain(|&room, g| {
            let mine = Weak::ptr_eq(&g.link, &me);
            if mine {
                gone.push(room);
            }
            !mine
        });
        gone
    }

    /// Rooms with windows in force.
    pub fn rooms(&self) -> usize {
        self.0.lock().len()
    }
}
