//! What the async side learns, forwarded to the engine thread as commands: a room's transfer
//! outcome, a closed room's last write landing, a client going away. The engine blocks on its
//! one command channel between steps (until its queues' next deadline) instead of waking
//! every millisecond to poll each room.
//!
//! Every request has an *incarnation*, unique in the process: a command about a request names
//! it, so a late one (its request already ended, its room id maybe reused) changes nothing.

use ferry_cluster::Room;
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_transfer::table::Outcome;
use ferry_worker::EngineLink;
use tokio::sync::oneshot;

use crate::cmd::Cmd;

static INCARNATIONS: AtomicU64 = AtomicU64::new(1);

/// A fresh request incarnation.
pub fn next_incarnation() -> u64 {
    INCARNATIONS.fetch_add(1, Ordering::Relaxed)
}

/// Forwards transfer outcomes and page releases to the engine.
#[derive(Clone)]
pub struct Wake {
    rt: tokio::runtime::Handle,
    engine: EngineLink<Cmd>,
}

impl Wake {
    /// Forwarding on `rt` to `engine`.
    pub fn new(rt: tokio::runtime::Handle, engine: EngineLink<Cmd>) -> Self {
        Self { rt, engine }
    }

    /// The room's outcome, when the receiver resolves it (None: the room vanished).
    pub fn outcome(&self, room: Room, incarnation: u64, rx: oneshot::Receiver<Outcome>) {
        let engine = self.engine.clone();
        self.rt.spawn(async move {
            let outcome = rx.await.ok();
            engine.report(Cmd::Transferred { room, incarnation, outcome });
        });
    }

    /// The closed room's pages, once no write into them is pending.
    pub fn released(&self, room: Room, rx: oneshot::Receiver<()>) {
        let engine = self.engine.clone();
        self.rt.spawn(async move {
            let _ = rx.await;
            engine.report(Cmd::Released { room });
        });
    }
}

/// Held by a request's token stream: dropping the stream (the client went away, or the
/// stream ended) tells the engine, which ends the request if it is still there.
pub struct Gone {
    engine: EngineLink<Cmd>,
    room: Room,
    incarnation: u64,
}

impl Gone {
    /// A guard for the request `(room, incarnation)`.
    pub fn new(engine: EngineLink<Cmd>, room: Room, incarnation: u64) -> Self {
        Self { engine, room, incarnation }
    }
}

impl Drop for Gone {
    fn drop(&mut self) {
        self.engine.report(Cmd::Gone { room: self.room, incarnation: self.incarnation });
    }
}
