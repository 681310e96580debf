//! What every receiver backend shares: the room table behind a lock, and the owners waiting
//! for their rooms' outcomes.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::room::{FailReason, State, Timeouts};
use crate::table::{Outcome, Refusal, RoomTable};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the table consistent, so a poisoned lock is usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Open rooms and their waiting owners.
pub struct Inbox {
    table: Mutex<RoomTable>,
    waiters: Mutex<HashMap<u64, oneshot::Sender<Outcome>>>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("table", &*lock(&self.table)).finish()
    }
}

impl Inbox {
    /// An empty inbox.
    pub fn new(timeouts: Timeouts) -> Self {
        Self { table: Mutex::new(RoomTable::new(timeouts)), waiters: Mutex::new(HashMap::new()) }
    }

    /// Runs `f` on the table, then tells the owners of rooms that ended.
    pub fn with_table<R>(&self, f: impl FnOnce(&mut RoomTable) -> R) -> R {
        let (r, ended) = {
            let mut t = lock(&self.table);
            let r = f(&mut t);
            (r, t.drain_ended())
        };
        if !ended.is_empty() {
            let mut w = lock(&self.waiters);
            for (room, outcome) in ended {
                if let Some(tx) = w.remove(&room) {
                    let _ = tx.send(outcome);
                }
            }
        }
        r
    }

    /// Opens a room that may fill `dest`; the receiver resolves with its outcome.
    pub fn open(&self, room: u64, secret: [u8; 16], dest: &[u32]) -> Result<oneshot::Receiver<Outcome>, Refusal> {
        let (tx, rx) = oneshot::channel();
        self.with_table(|t| t.open(room, secret, dest, Instant::now()))?;
        lock(&self.waiters).insert(room, tx);
        Ok(rx)
    }

    /// Forgets a room (after its outcome, or to abort it from this side).
    pub fn close(&self, room: u64) -> Option<State> {
        self.with_table(|t| {
            t.fail(room, FailReason::Aborted("closed by the receiver".into()));
            t.close(room)
        })
    }

    /// Fails rooms past their timeouts.
    pub fn tick(&self) {
        self.with_table(|t| t.tick(Instant::now()));
    }

    /// Refusals so far for `r`.
    pub fn refusals(&self, r: Refusal) -> u64 {
        lock(&self.table).refusals(r)
    }

    /// `(open rooms, destination pages they hold)`.
    pub fn open_rooms(&self) -> (usize, usize) {
        let t = lock(&self.table);
        (t.open_rooms(), t.held_pages())
    }
}
