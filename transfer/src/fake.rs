//! The `fake` backend: moves no bytes and completes at once, with the same room accounting
//! as a real receiver (secrets, page ownership, refusals, timeouts). For scheduling tests of
//! whole clusters in one process, and for warm-up.

use ferry_core::{Room, RoomSecret};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use tokio::sync::oneshot;

use crate::frame::{Aux, Header, Kind};
use crate::inbox::Inbox;
use crate::room::{FailReason, State, Timeouts};
use crate::runs::PageRun;
use crate::table::{Outcome, Refusal};

/// The receiving side: an inbox the paired senders write into directly.
#[derive(Debug, Clone)]
pub struct FakeReceiver {
    inbox: Arc<Inbox>,
}

impl FakeReceiver {
    /// A receiver whose rooms time out after `timeouts` (checked on every call).
    pub fn new(timeouts: Timeouts) -> Self {
        Self { inbox: Arc::new(Inbox::new(timeouts, "fake")) }
    }

    /// A sender delivering into this receiver.
    pub fn sender(&self) -> FakeSender {
        FakeSender { inbox: Arc::clone(&self.inbox) }
    }

    /// Names this receiver in the process-wide registry, so senders made elsewhere in the
    /// process (another in-process daemon) can find it: returns its endpoint, `fake:<n>`.
    pub fn register(&self) -> String {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let name = format!("fake:{}", NEXT.fetch_add(1, Ordering::Relaxed));
        registry().lock().insert(name.clone(), Arc::downgrade(&self.inbox));
        name
    }

    /// Opens a room that may fill `dest`.
    pub fn open(&self, room: Room, secret: RoomSecret, dest: &[u32]) -> Result<oneshot::Receiver<Outcome>, Refusal> {
        self.inbox.tick();
        self.inbox.open(room, secret, dest)
    }

    /// Forgets a room.
    pub fn close(&self, room: Room) -> Option<State> {
        self.inbox.close(room)
    }

    /// The rooms and their counters.
    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }
}

/// The sending side of [`FakeReceiver`].
#[derive(Debug, Clone)]
pub struct FakeSender {
    inbox: Arc<Inbox>,
}

fn registry() -> &'static Mutex<HashMap<String, Weak<Inbox>>> {
    static R: OnceLock<Mutex<HashMap<String, Weak<Inbox>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

impl FakeSender {
    /// A sender to the registered receiver named `endpoint` (see [`FakeReceiver::register`]),
    /// if it is still alive in this process.
    pub fn lookup(endpoint: &str) -> Option<Self> {
        let r = registry().lock();
        r.get(endpoint).and_then(Weak::upgrade).map(|inbox| Self { inbox })
    }

    /// "Sends" runs: the receiver accounts for the pages without any byte moving.
    pub fn send_pages(&self, room: Room, secret: RoomSecret, runs: &[PageRun]) -> Result<(), Refusal> {
        self.inbox.tick();
        for r in runs {
            let h = Header::with(Kind::Pages, room, secret, r.dst, r.len, &[]);
            let claim = self.inbox.with_table(|t| t.claim(&h, std::time::Instant::now()))?;
            self.inbox.with_table(|t| t.commit(claim, std::time::Instant::now()));
        }
        Ok(())
    }

    /// Delivers the aux data.
    pub fn send_done(&self, room: Room, secret: RoomSecret, aux: Aux) -> Result<(), Refusal> {
        let h = Header::with(Kind::Done, room, secret, 0, 0, &[]);
        self.inbox.with_table(|t| {
            t.check_control(&h)?;
            t.done(room, aux, std::time::Instant::now());
            Ok(())
        })
    }

    /// Abandons the room.
    pub fn send_abort(&self, room: Room, secret: RoomSecret, reason: &str) -> Result<(), Refusal> {
        let h = Header::with(Kind::Abort, room, secret, 0, 0, &[]);
        self.inbox.with_table(|t| {
            t.check_control(&h)?;
            t.fail(room, FailReason::Aborted(reason.to_string()));
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runs::coalesce;

    #[tokio::test]
    async fn completes_at_once_with_real_accounting() {
        let rx = FakeReceiver::new(Timeouts::default());
        let tx = rx.sender();
        let done = rx.open(Room::from(1u32), RoomSecret::from([1; 16]), &[4, 5, 6]).expect("open");
        assert_eq!(
            tx.send_pages(Room::from(1u32), RoomSecret::from([2; 16]), &coalesce(&[0], &[4])),
            Err(Refusal::WrongSecret)
        );
        tx.send_pages(Room::from(1u32), RoomSecret::from([1; 16]), &coalesce(&[0, 1, 2], &[4, 5, 6])).expect("send");
        assert_eq!(
            tx.send_pages(Room::from(1u32), RoomSecret::from([1; 16]), &coalesce(&[0], &[4])),
            Err(Refusal::Duplicate)
        );
        tx.send_done(
            Room::from(1u32),
            RoomSecret::from([1; 16]),
            Aux { first_token: 3, logprob: 0.0, room_echo: 1, total_pages: 3 },
        )
        .expect("done");
        assert!(matches!(done.await, Ok(Outcome::Success(a)) if a.first_token == 3));
        rx.close(Room::from(1u32));
        let done = rx.open(Room::from(2u32), RoomSecret::from([2; 16]), &[4]).expect("pages free again");
        tx.send_abort(Room::from(2u32), RoomSecret::from([2; 16]), "bye").expect("abort");
        assert!(matches!(done.await, Ok(Outcome::Failed(FailReason::Aborted(_)))));
        rx.close(Room::from(2u32));
        assert_eq!(rx.inbox().open_rooms(), (0, 0));
    }
}
