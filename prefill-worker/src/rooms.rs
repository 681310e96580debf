//! The prefill node's room queue as a pure state machine (no I/O, the caller's clock):
//!
//! - **bootstrap**: the request arrived and waits for the decode node's handshake, or the
//!   handshake arrived and waits for the request — either may come first;
//! - **waiting**: both known, handed to the scheduler (queued or computing);
//! - **inflight**: computed, pages still on the wire;
//! - **closing**: aborted, failed or timed out after it was handed to the scheduler, its room
//!   task still ending (pages may still be on the wire). The id stays taken until the task
//!   reports ([`Event::Finished`]): a request or handshake for it is refused (`room_closing`),
//!   so a caller reusing a room id never meets the earlier room's chunks or pages.
//!
//! Every state has a timeout; a [`Event::Tick`] removes rooms past theirs and hands back what
//! they held ([`Action::Gone`]) so the caller can answer and free. `R` and `H` are the
//! caller's payloads for the request and the handshake.
//!
//! **One entry point**: [`Rooms::on`] takes an [`Event`] and returns the [`Action`]s the
//! engine carries out; every event in every phase is a row of `rooms/table.rs`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_cluster::{Room, RoomSecret};

mod event;
pub use event::{Action, Event, Refusal};

/// Where a room is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Missing the request or the handshake.
    Bootstrap,
    /// Queued or computing.
    Waiting,
    /// Computed; pages on the wire.
    Inflight,
    /// Ended; its room task has not reported yet.
    Closing,
}

impl Phase {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Bootstrap => "bootstrap",
            Self::Waiting => "waiting",
            Self::Inflight => "inflight",
            Self::Closing => "closing",
        }
    }
}

/// Timeout of each phase.
#[derive(Debug, Clone, Copy)]
pub struct PhaseTimeouts {
    /// Bootstrap.
    pub bootstrap: Duration,
    /// Waiting (queueing and compute).
    pub waiting: Duration,
    /// Inflight (the transfer's own timeout also applies, from its last progress).
    pub inflight: Duration,
}

struct Slot<R, H, L> {
    secret: RoomSecret,
    phase: Phase,
    since: Instant,
    request: Option<R>,
    handshake: Option<H>,
    /// The engine's record of the room from its start (past bootstrap) to its task's report.
    live: Option<L>,
    /// Pages handed to its task ([`Event::Handing`]), on the wire until it reports.
    wire: Vec<u32>,
    /// Closing: why (the reason its caller was told), handed back with its record.
    closed: Option<String>,
}

/// A room that timed out, with what it held.
pub struct Expired<R, H> {
    /// The room.
    pub room: Room,
    /// Its secret.
    pub secret: RoomSecret,
    /// The phase it timed out in.
    pub phase: Phase,
    /// Its request, if it was still bootstrapping with one.
    pub request: Option<R>,
    /// Its handshake, if it was still bootstrapping with one.
    pub handshake: Option<H>,
}

/// The rooms of one prefill node.
pub struct Rooms<R, H, L = ()> {
    slots: HashMap<Room, Slot<R, H, L>>,
    /// Page → how many rooms' tasks have it on the wire.
    on_wire: HashMap<u32, u32>,
    timeouts: PhaseTimeouts,
}

impl<R, H, L> Rooms<R, H, L> {
    /// No rooms.
    pub fn new(timeouts: PhaseTimeouts) -> Self {
        Self { slots: HashMap::new(), on_wire: HashMap::new(), timeouts }
    }

    /// What follows from `ev` at `now`, for the engine to carry out.
    pub fn on(&mut self, ev: Event<R, H, L>, now: Instant) -> Vec<Action<R, H, L>> {
        let paired = |p: Option<(R, H)>, room, secret| {
            p.map(|(request, handshake)| Action::Pair { room, secret, request, handshake })
        };
        match ev {
            Event::Request { room, secret, request } => match self.request(room, secret, request, now) {
                Ok(p) => paired(p, room, secret).into_iter().collect(),
                Err((why, request)) => vec![Action::RefuseRequest { room, request, why }],
            },
            Event::Handshake { room, secret, handshake } => match self.handshake(room, secret, handshake, now) {
                Ok(p) => paired(p, room, secret).into_iter().collect(),
                Err((why, handshake)) => vec![Action::RefuseHandshake { room, handshake, why }],
            },
            Event::Abort { room, secret } => match self.abort(room, secret, now) {
                Err(why) => vec![Action::Aborted(Err(why))],
                Ok(None) => vec![Action::Aborted(Ok(false))],
                Ok(Some(gone)) => vec![Action::Aborted(Ok(true)), Action::Gone(gone)],
            },
            Event::Computed(room) => {
                self.computed(room, now);
                Vec::new()
            }
            Event::Progress(room) => {
                self.progress(room, now);
                Vec::new()
            }
            // A room still bootstrapping has no task: it leaves with what it holds, so that
            // its caller is answered.
            Event::Close { room, .. } if self.phase(room) == Some(Phase::Bootstrap) => {
                self.take(room, now).map(Action::Gone).into_iter().collect()
            }
            Event::Close { room, why } => {
                self.close(room, Some(why), now);
                Vec::new()
            }
            Event::Started { room, live } => match self.slots.get_mut(&room) {
                Some(s) if s.phase == Phase::Waiting && s.live.is_none() => {
                    s.live = Some(live);
                    Vec::new()
                }
                // No room waiting for it: handed back, to be released.
                _ => vec![Action::Finished { room, live: Some(live), closed: None }],
            },
            // Only a room past bootstrap has a task to report.
            Event::Finished(room) if self.phase(room) == Some(Phase::Bootstrap) => Vec::new(),
            Event::Finished(room) => match self.slots.remove(&room) {
                Some(s) => {
                    for p in &s.wire {
                        if let Some(n) = self.on_wire.get_mut(p) {
                            *n -= 1;
                            if *n == 0 {
                                self.on_wire.remove(p);
                            }
                        }
                    }
                    vec![Action::Finished { room, live: s.live, closed: s.closed }]
                }
                None => Vec::new(),
            },
            Event::Handing { room, pages } => match self.slots.get_mut(&room) {
                // Only a room with a task sends.
                Some(s) if s.phase != Phase::Bootstrap => {
                    let fresh: Vec<u32> = pages.iter().copied().filter(|p| !self.on_wire.contains_key(p)).collect();
                    for &p in &pages {
                        *self.on_wire.entry(p).or_insert(0) += 1;
                    }
                    s.wire.extend(pages);
                    vec![Action::Mirror { pages: fresh }]
                }
                _ => Vec::new(),
            },
            Event::Tick => self.expired(now).into_iter().map(Action::Gone).collect(),
        }
    }

    /// The request arrived. Returns the pair when the handshake was already there (the room
    /// is then waiting). A refusal hands the request back.
    fn request(&mut self, room: Room, secret: RoomSecret, r: R, now: Instant) -> Result<Option<(R, H)>, (Refusal, R)> {
        let slot = match self.slot(room, secret, now, |s| s.request.is_some(), Refusal::DuplicateRoom) {
            Ok(s) => s,
            Err(e) => return Err((e, r)),
        };
        slot.request = Some(r);
        Ok(self.pair(room, now))
    }

    /// The handshake arrived. Returns the pair when the request was already there. A refusal
    /// hands the handshake back.
    fn handshake(
        &mut self,
        room: Room,
        secret: RoomSecret,
        h: H,
        now: Instant,
    ) -> Result<Option<(R, H)>, (Refusal, H)> {
        let slot = match self.slot(room, secret, now, |s| s.handshake.is_some(), Refusal::DuplicateHandshake) {
            Ok(s) => s,
            Err(e) => return Err((e, h)),
        };
        slot.handshake = Some(h);
        Ok(self.pair(room, now))
    }

    /// The bootstrapping slot for `room` (made when new), after the secret and duplicate checks.
    fn slot(
        &mut self,
        room: Room,
        secret: RoomSecret,
        now: Instant,
        has: impl Fn(&Slot<R, H, L>) -> bool,
        duplicate: Refusal,
    ) -> Result<&mut Slot<R, H, L>, Refusal> {
        let s = self.slots.entry(room).or_insert_with(|| Slot {
            secret,
            phase: Phase::Bootstrap,
            since: now,
            request: None,
            handshake: None,
            live: None,
            wire: Vec::new(),
            closed: None,
        });
        if s.secret != secret {
            return Err(Refusal::WrongSecret);
        }
        if s.phase == Phase::Closing {
            return Err(Refusal::RoomClosing);
        }
        if has(s) || s.phase != Phase::Bootstrap {
            return Err(duplicate);
        }
        Ok(s)
    }

    fn pair(&mut self, room: Room, now: Instant) -> Option<(R, H)> {
        let s = self.slots.get_mut(&room)?;
        if s.request.is_none() || s.handshake.is_none() {
            return None;
        }
        s.phase = Phase::Waiting;
        s.since = now;
        Some((s.request.take()?, s.handshake.take()?))
    }

    /// The room's prompt is computed: its last pages are on the wire.
    fn computed(&mut self, room: Room, now: Instant) {
        if let Some(s) = self.slots.get_mut(&room)
            && s.phase == Phase::Waiting
        {
            s.phase = Phase::Inflight;
            s.since = now;
        }
    }

    /// The room's transfer moved (a chunk was sent): an inflight room's timeout counts from
    /// its last progress, so a long transfer that keeps moving is not cut.
    fn progress(&mut self, room: Room, now: Instant) {
        if let Some(s) = self.slots.get_mut(&room)
            && s.phase == Phase::Inflight
        {
            s.since = now;
        }
    }

    /// The room ended early (failed, aborted, timed out; `why`, when the engine says) while
    /// its task still runs: it is `Closing` until its task reports, and the first reason
    /// given is the one handed back then. A bootstrapping room has no task and is forgotten
    /// at once.
    fn close(&mut self, room: Room, why: Option<String>, now: Instant) {
        match self.slots.get_mut(&room) {
            Some(s) if s.phase == Phase::Bootstrap => {
                self.slots.remove(&room);
            }
            Some(s) => {
                s.phase = Phase::Closing;
                s.since = now;
                s.closed = s.closed.take().or(why);
            }
            None => {}
        }
    }

    /// Takes a room out by abort or timeout: a bootstrapping room is forgotten, any other
    /// becomes `Closing`.
    fn take(&mut self, room: Room, now: Instant) -> Option<Expired<R, H>> {
        let s = self.slots.get_mut(&room)?;
        let gone = Expired {
            room,
            secret: s.secret,
            phase: s.phase,
            request: s.request.take(),
            handshake: s.handshake.take(),
        };
        self.close(room, None, now);
        Some(gone)
    }

    /// An abort for `room` (checked against its secret when given). Returns the phase and,
    /// when it was still bootstrapping, what it held; a bootstrapping room is forgotten, any
    /// other closes. A room already closing is not aborted again (`Ok(None)`).
    fn abort(
        &mut self,
        room: Room,
        secret: Option<RoomSecret>,
        now: Instant,
    ) -> Result<Option<Expired<R, H>>, Refusal> {
        match self.slots.get(&room) {
            None => return Ok(None),
            Some(s) if secret.is_some_and(|x| x != s.secret) => {
                return Err(Refusal::WrongSecret);
            }
            Some(s) if s.phase == Phase::Closing => return Ok(None),
            Some(_) => {}
        }
        Ok(self.take(room, now))
    }

    /// Takes out the rooms past their phase's timeout (bootstrapping ones are forgotten,
    /// others close). A closing room has no timeout here: its task's sends and abort are each
    /// bounded by the transfer timeout.
    fn expired(&mut self, now: Instant) -> Vec<Expired<R, H>> {
        let late: Vec<Room> = self
            .slots
            .iter()
            .filter(|(_, s)| self.limit(s.phase).is_some_and(|l| now.duration_since(s.since) >= l))
            .map(|(&r, _)| r)
            .collect();
        late.into_iter().filter_map(|room| self.take(room, now)).collect()
    }

    /// The timeout of a phase (a closing room has none here).
    fn limit(&self, p: Phase) -> Option<Duration> {
        let t = self.timeouts;
        match p {
            Phase::Bootstrap => Some(t.bootstrap),
            Phase::Waiting => Some(t.waiting),
            Phase::Inflight => Some(t.inflight),
            Phase::Closing => None,
        }
    }

    /// When the next room would time out as things stand: the engine sleeps until then at
    /// most.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.slots.values().filter_map(|s| Some(s.since + self.limit(s.phase)?)).min()
    }

    /// The engine's record of `room` (from [`Event::Started`] to [`Event::Finished`]).
    pub fn live(&self, room: Room) -> Option<&L> {
        self.slots.get(&room)?.live.as_ref()
    }

    /// The same, to change.
    pub fn live_mut(&mut self, room: Room) -> Option<&mut L> {
        self.slots.get_mut(&room)?.live.as_mut()
    }

    /// Rooms with an engine record, in id order.
    pub fn live_rooms(&self) -> Vec<Room> {
        let mut rooms: Vec<Room> = self.slots.iter().filter(|(_, s)| s.live.is_some()).map(|(&r, _)| r).collect();
        rooms.sort_unstable();
        rooms
    }

    /// Pages some room's task has on the wire.
    pub fn pages_on_wire(&self) -> usize {
        self.on_wire.len()
    }

    /// The phase of `room`.
    pub fn phase(&self, room: Room) -> Option<Phase> {
        self.slots.get(&room).map(|s| s.phase)
    }

    /// Rooms per phase: (bootstrap, waiting, inflight); closing rooms count as inflight
    /// (their pages may be on the wire).
    pub fn depth(&self) -> (usize, usize, usize) {
        let mut d = (0, 0, 0);
        for s in self.slots.values() {
            match s.phase {
                Phase::Bootstrap => d.0 += 1,
                Phase::Waiting => d.1 += 1,
                Phase::Inflight | Phase::Closing => d.2 += 1,
            }
        }
        d
    }

    /// Rooms known.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no room is known.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[cfg(test)]
mod props;
#[cfg(test)]
mod table;

#[cfg(test)]
mod tests;
