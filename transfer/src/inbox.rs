//! What every receiver backend shares: the room table behind a lock, and the owners waiting
//! for their rooms' outcomes.

use ferry_core::{Room, RoomSecret};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::frame::{Aux, Header, Kind};
use crate::room::{FailReason, State, Timeouts};
use crate::table::{Claim, Outcome, Refusal, RoomTable};

/// Open rooms and their waiting owners.
pub struct Inbox {
    table: Mutex<RoomTable>,
    waiters: Mutex<HashMap<Room, oneshot::Sender<Outcome>>>,
    /// Owners waiting for a closed room's last write to settle.
    release_waiters: Mutex<HashMap<Room, Vec<oneshot::Sender<()>>>>,
    backend: &'static str,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("table", &*self.table.lock()).finish()
    }
}

impl Inbox {
    /// An empty inbox for the named backend (a metrics label).
    pub fn new(timeouts: Timeouts, backend: &'static str) -> Self {
        Self {
            table: Mutex::new(RoomTable::new(timeouts)),
            waiters: Mutex::new(HashMap::new()),
            release_waiters: Mutex::new(HashMap::new()),
            backend,
        }
    }

    /// Runs `f` on the table, then tells the owners of rooms that ended.
    pub fn with_table<R>(&self, f: impl FnOnce(&mut RoomTable) -> R) -> R {
        let (r, ended, released) = {
            let mut t = self.table.lock();
            let r = f(&mut t);
            (r, t.drain_ended(), t.drain_released())
        };
        if !released.is_empty() {
            let mut w = self.release_waiters.lock();
            for room in released {
                for tx in w.remove(&room).unwrap_or_default() {
                    let _ = tx.send(());
                }
            }
        }
        if !ended.is_empty() {
            let mut w = self.waiters.lock();
            for (room, outcome) in ended {
                crate::metrics::room_ended(self.backend, crate::metrics::Side::Receiver, &outcome);
                if let Some(tx) = w.remove(&room) {
                    let _ = tx.send(outcome);
                }
            }
        }
        r
    }

    /// Opens a room that may fill `dest`; the receiver resolves with its outcome.
    pub fn open(&self, room: Room, secret: RoomSecret, dest: &[u32]) -> Result<oneshot::Receiver<Outcome>, Refusal> {
        let (tx, rx) = oneshot::channel();
        self.with_table(|t| t.open(room, secret, dest, Instant::now()))?;
        self.waiters.lock().insert(room, tx);
        Ok(rx)
    }

    /// Opens a room after checking its pages lie in an arena of `arena_pages` pages.
    pub fn open_in(
        &self,
        arena_pages: usize,
        room: Room,
        secret: RoomSecret,
        dest: &[u32],
    ) -> Result<oneshot::Receiver<Outcome>, Refusal> {
        if let Some(&bad) = dest.iter().find(|&&p| p as usize >= arena_pages) {
            tracing::warn!(room = %room, page = bad, "destination page outside the arena");
            return Err(Refusal::OutsideRoom);
        }
        self.open(room, secret, dest)
    }

    /// Ends a claim whose payload has landed: commits it when `crc_ok`, else fails the room
    /// (the bytes are in the room's own pages, which no request reads once it failed). True
    /// when this made the room whole (read under the table's lock: its owner may close it
    /// the moment the lock is free).
    pub fn settle(&self, h: &Header, claim: Claim, crc_ok: bool) -> bool {
        self.with_table(|t| {
            if crc_ok {
                t.commit(claim, Instant::now());
            } else {
                t.unclaim(claim);
                let why = format!("checksum mismatch in pages {}..+{}", claim.first, claim.n);
                t.fail(h.room, FailReason::Corrupt(why));
            }
            t.state(h.room) == Some(State::Success)
        })
    }

    /// Handles a `Done` or `Abort` frame with its payload: None when refused, else whether it
    /// made the room whole (as [`settle`](Self::settle)).
    pub fn control(&self, h: &Header, payload: &[u8]) -> Option<bool> {
        if let Err(r) = self.with_table(|t| t.check_control(h)) {
            tracing::debug!(room = %h.room, reason = r.label(), "control frame refused");
            return None;
        }
        if h.check_payload(payload).is_err() {
            self.with_table(|t| t.fail(h.room, FailReason::Corrupt("control frame checksum mismatch".into())));
            return Some(false);
        }
        let whole = match h.kind {
            Kind::Done => match Aux::decode(payload) {
                Some(aux) => self.with_table(|t| {
                    t.done(h.room, aux, Instant::now());
                    t.state(h.room) == Some(State::Success)
                }),
                None => {
                    self.with_table(|t| t.fail(h.room, FailReason::Corrupt("malformed aux data".into())));
                    false
                }
            },
            _ => {
                let why = String::from_utf8_lossy(payload).into_owned();
                self.with_table(|t| t.fail(h.room, FailReason::Aborted(why)));
                false
            }
        };
        Some(whole)
    }

    /// Fails every room in `rooms` that has not ended (a connection carrying them broke).
    pub fn fail_all(&self, rooms: impl IntoIterator<Item = Room>, reason: &FailReason) {
        self.with_table(|t| {
            for room in rooms {
                t.fail(room, reason.clone());
            }
        });
    }

    /// Forgets a room (after its outcome, or to abort it from this side).
    pub fn close(&self, room: Room) -> Option<State> {
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
        self.table.lock().refusals(r)
    }

    /// The state of an open room (None once closed or never opened).
    pub fn state(&self, room: Room) -> Option<State> {
        self.table.lock().state(room)
    }

    /// Whether a closed room still has runs being written: its pages must not be reused yet.
    pub fn writing(&self, room: Room) -> bool {
        self.table.lock().writing(room)
    }

    /// For a closed room whose pages are still being written: resolves once the last write
    /// settled and the pages are free to reuse. None when no write is pending (they are free
    /// now). The owner waits on this instead of polling [`writing`](Self::writing).
    pub fn released(&self, room: Room) -> Option<oneshot::Receiver<()>> {
        // Registered under the table lock: a write settling after the check finds the waiter.
        let t = self.table.lock();
        if !t.writing(room) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        self.release_waiters.lock().entry(room).or_default().push(tx);
        Some(rx)
    }

    /// `(open rooms, destination pages they hold)`.
    pub fn open_rooms(&self) -> (usize, usize) {
        let t = self.table.lock();
        (t.open_rooms(), t.held_pages())
    }
}

/// Most data-plane connections one receiver serves at once; more are dropped as they arrive
/// (counted, reason `at_cap`). Senders keep a few connections per peer (4 by default).
pub const MAX_CONNECTIONS: usize = 1024;

/// The tasks every receiver runs: accepting connections (each shaking hands as `security`
/// says, then served by `serve`, at most [`MAX_CONNECTIONS`] at once) and failing rooms past their timeouts every 50 ms. A failed
/// accept (out of file descriptors, say) is counted and retried after 100 ms: it never ends
/// the loop or the connections being served. Abort the tasks to stop the receiver.
pub(crate) fn spawn_receiver_tasks<S, F, Fut>(
    listener: tokio::net::TcpListener,
    shared: std::sync::Arc<S>,
    inbox: fn(&S) -> &Inbox,
    security: crate::secure::Security,
    serve: F,
) -> Vec<tokio::task::JoinHandle<()>>
where
    S: Send + Sync + 'static,
    F: Fn(std::sync::Arc<S>, crate::secure::DataStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let s = std::sync::Arc::clone(&shared);
    let serve = std::sync::Arc::new(serve);
    let accept = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let accepted = listener.accept().await;
            while conns.try_join_next().is_some() {}
            match accepted {
                Ok((stream, _)) if conns.len() >= MAX_CONNECTIONS => {
                    tracing::warn!(cap = MAX_CONNECTIONS, "data-plane connection dropped: at the connection cap");
                    crate::metrics::connection_refused("at_cap");
                    drop(stream);
                }
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    keepalive(&stream);
                    let (s, serve, security) =
                        (std::sync::Arc::clone(&s), std::sync::Arc::clone(&serve), security.clone());
                    // The handshake runs in the connection's own task: a slow peer holds up no other.
                    conns.spawn(async move {
                        if let Ok(stream) = security.accept(stream).await {
                            serve(s, stream).await;
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "data-plane accept failed; retrying in 100 ms");
                    crate::metrics::connection_refused("accept_error");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
            crate::metrics::connections(conns.len());
        }
    });
    let ticker = tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_millis(50));
        loop {
            every.tick().await;
            inbox(&shared).tick();
        }
    });
    vec![accept, ticker]
}

/// TCP keepalive on a data-plane connection: a peer host that vanished (powered off,
/// partitioned: no FIN, no RST) is noticed after about 10 s + 3 × 5 s of silence even on an
/// idle connection, which then fails the rooms it carried.
fn keepalive(stream: &tokio::net::TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(10))
        .with_interval(std::time::Duration::from_secs(5))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&ka) {
        tracing::debug!(error = %e, "TCP keepalive not set");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The owner of a room closed mid-write learns when its pages are free, without polling.
    #[test]
    fn released_resolves_when_the_last_write_into_a_closed_room_settles() {
        let inbox = Inbox::new(Timeouts::default(), "test");
        let _outcome = inbox.open(Room::from(1u32), RoomSecret::from([1; 16]), &[5, 6]).expect("open");
        let h = Header::pages(Room::from(1u32), RoomSecret::from([1; 16]), 5, 2, &[]);
        let claim = inbox.with_table(|t| t.claim(&h, Instant::now())).expect("claim");
        assert!(inbox.released(Room::from(1u32)).is_none(), "an open room is not closing");
        inbox.close(Room::from(1u32));
        let mut rx = inbox.released(Room::from(1u32)).expect("a write is pending");
        assert!(rx.try_recv().is_err(), "not yet: the run is still being written");
        inbox.settle(&h, claim, true);
        assert_eq!(rx.try_recv(), Ok(()), "told once the write landed");
        assert!(inbox.released(Room::from(1u32)).is_none(), "nothing pending any more");
        inbox.open(Room::from(2u32), RoomSecret::from([2; 16]), &[5, 6]).expect("the pages are free again");
    }
}
