//! The sender's side of one room: created when the request is known (bootstrapping), given
//! the decode node's destination pages at the handshake (waiting for input), fed chunk by
//! chunk (transferring) and closed by the last chunk's aux data (success) — or failed, by a
//! send error, an abort or a timeout. State only moves forward ([`crate::room`]).

use ferry_core::{Room, RoomSecret};
use std::sync::Arc;
use std::time::Instant;

use crate::backend::Sender;
use crate::frame::Aux;
use crate::memory::HostPages;
use crate::metrics::{self, Side};
use crate::room::{FailReason, Progress, State, Timeouts};
use crate::runs::coalesce;
use crate::table::Outcome;

/// One room on the prefill node.
#[derive(Debug)]
pub struct SendRoom {
    id: Room,
    secret: RoomSecret,
    room: Progress,
    sender: Option<Arc<Sender>>,
    dest: Vec<u32>,
    /// Leading slots the receiver already holds (delta transfer): `dest[i]` is slot
    /// `held + i`, and chunks' slots below `held` are not sent.
    held: usize,
    /// Destination slots already sent (by position in `dest`).
    sent: Vec<bool>,
    reported: bool,
}

impl SendRoom {
    /// A room known from the request, waiting for the decode node's handshake.
    pub fn new(id: Room, secret: RoomSecret, timeouts: Timeouts, now: Instant) -> Self {
        Self {
            id,
            secret,
            room: Progress::new(now, timeouts),
            sender: None,
            dest: Vec::new(),
            held: 0,
            sent: Vec::new(),
            reported: false,
        }
    }

    /// The room id.
    pub fn id(&self) -> Room {
        self.id
    }

    /// The decode node's handshake arrived: where pages go and how.
    pub fn handshake(&mut self, sender: Arc<Sender>, dest: Vec<u32>, now: Instant) -> Result<(), FailReason> {
        self.handshake_held(sender, dest, 0, now)
    }

    /// [`handshake`](Self::handshake) from a receiver that already holds the room's first
    /// `held` slots (its prefix cache): `dest` lists the slots after them, and chunks' slots
    /// below `held` are skipped.
    pub fn handshake_held(
        &mut self,
        sender: Arc<Sender>,
        dest: Vec<u32>,
        held: usize,
        now: Instant,
    ) -> Result<(), FailReason> {
        self.room
            .advance(State::WaitingForInput, now)
            .map_err(|e| FailReason::Refused(format!("handshake in the wrong state: {e}")))?;
        self.sent = vec![false; dest.len()];
        self.dest = dest;
        self.held = held;
        self.sender = Some(sender);
        Ok(())
    }

    /// Destination pages (empty before the handshake).
    pub fn destination(&self) -> &[u32] {
        &self.dest
    }

    /// Sends a chunk: `src[i]` (a page of `mem`) goes to destination slot `first + i` (slots
    /// the receiver holds are skipped). With `last`, the room's aux data follows (its page
    /// count is the room's slots; the held ones are taken off) and the room succeeds once it
    /// is sent.
    pub async fn send(
        &mut self,
        first: usize,
        src: &[u32],
        mem: &HostPages,
        last: Option<Aux>,
    ) -> Result<(), FailReason> {
        if self.room.state().is_terminal() {
            return Err(self.room.reason().cloned().unwrap_or(FailReason::Aborted("room already ended".into())));
        }
        let Some(sender) = self.sender.clone() else {
            return Err(self.fail(FailReason::Refused("send before the handshake".into())));
        };
        // Slots the receiver holds: not sent; the rest index `dest` from `held` on.
        let skip = self.held.saturating_sub(first).min(src.len());
        let src = &src[skip..];
        // The aux data counts the room's slots; the receiver expects the pages it is sent.
        let last = last.map(|mut a| {
            a.total_pages = a.total_pages.saturating_sub(self.held as u32);
            a
        });
        if src.is_empty() && last.is_none() {
            return Ok(());
        }
        let first = (first + skip).saturating_sub(self.held);
        let end = first + src.len();
        if end > self.dest.len() || self.sent[first..end].iter().any(|&s| s) {
            return Err(self.fail(FailReason::Refused(format!(
                "chunk slots {}..{} outside the {} destination pages after {} held, or already sent",
                first + self.held,
                end + self.held,
                self.dest.len(),
                self.held
            ))));
        }
        let now = Instant::now();
        let _ = self.room.advance(State::Transferring, now);
        let runs = coalesce(src, &self.dest[first..end]);
        if let Err(e) = sender.send(self.id, self.secret, &runs, mem, last).await {
            return Err(self.fail(FailReason::PeerGone(e.to_string())));
        }
        self.sent[first..end].iter_mut().for_each(|s| *s = true);
        self.room.progress(Instant::now());
        if let Some(aux) = last {
            let _ = self.room.advance(State::Success, Instant::now());
            self.report(&Outcome::Success(aux));
        }
        Ok(())
    }

    /// Where the room stands; fails it first when its state outlived its timeout.
    pub fn poll(&mut self, now: Instant) -> State {
        if let Some(reason) = self.room.tick(now) {
            self.report(&Outcome::Failed(reason));
        }
        self.room.state()
    }

    /// Why the room failed.
    pub fn reason(&self) -> Option<&FailReason> {
        self.room.reason()
    }

    /// Abandons the room and tells the receiver (when the handshake told us who it is).
    pub async fn abort(&mut self, why: &str) {
        let reason = FailReason::Aborted(why.to_string());
        if !self.room.state().is_terminal() {
            self.fail(reason);
            if let Some(s) = &self.sender
                && let Err(e) = s.abort(self.id, self.secret, why).await
            {
                tracing::debug!(room = %self.id, error = %e, "abort not delivered; the receiver will time out");
            }
        }
    }

    fn fail(&mut self, reason: FailReason) -> FailReason {
        if self.room.fail(reason.clone()) {
            self.report(&Outcome::Failed(reason.clone()));
        }
        reason
    }

    fn report(&mut self, outcome: &Outcome) {
        if !self.reported {
            self.reported = true;
            let backend = self.sender.as_ref().map_or("none", |s| s.backend());
            metrics::room_ended(backend, Side::Sender, outcome);
        }
    }
}
