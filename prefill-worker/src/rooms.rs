//! The prefill node's room queue as a pure state machine (no I/O, the caller's clock):
//!
//! - **bootstrap**: the request arrived and waits for the decode node's handshake, or the
//!   handshake arrived and waits for the request — either may come first;
//! - **waiting**: both known, handed to the scheduler (queued or computing);
//! - **inflight**: computed, pages still on the wire;
//! - **closing**: aborted, failed or timed out after it was handed to the scheduler, its room
//!   task still ending (pages may still be on the wire). The id stays taken until the task
//!   reports ([`Rooms::finish`]): a request or handshake for it is refused (`room_closing`),
//!   so a caller reusing a room id never meets the earlier room's chunks or pages.
//!
//! Every state has a timeout; [`Rooms::expired`] removes rooms past theirs and hands back what
//! they held so the caller can answer and free. `R` and `H` are the caller's payloads for the
//! request and the handshake.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_cluster::{Refused, Room, RoomSecret};
use tonic::Code;

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

struct Slot<R, H> {
    secret: RoomSecret,
    phase: Phase,
    since: Instant,
    request: Option<R>,
    handshake: Option<H>,
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
pub struct Rooms<R, H> {
    slots: HashMap<Room, Slot<R, H>>,
    timeouts: PhaseTimeouts,
}

fn wrong_secret(room: Room) -> Refused {
    Refused::new(Code::PermissionDenied, "wrong_secret", format!("room {room}: wrong room secret"))
}

impl<R, H> Rooms<R, H> {
    /// No rooms.
    pub fn new(timeouts: PhaseTimeouts) -> Self {
        Self { slots: HashMap::new(), timeouts }
    }

    /// The request arrived. Returns the pair when the handshake was already there (the room
    /// is then waiting). A refusal hands the request back.
    pub fn request(
        &mut self,
        room: Room,
        secret: RoomSecret,
        r: R,
        now: Instant,
    ) -> Result<Option<(R, H)>, (Refused, R)> {
        let slot = match self.slot(room, secret, now, |s| s.request.is_some(), "duplicate_room", "a request") {
            Ok(s) => s,
            Err(e) => return Err((e, r)),
        };
        slot.request = Some(r);
        Ok(self.pair(room, now))
    }

    /// The handshake arrived. Returns the pair when the request was already there. A refusal
    /// hands the handshake back.
    pub fn handshake(
        &mut self,
        room: Room,
        secret: RoomSecret,
        h: H,
        now: Instant,
    ) -> Result<Option<(R, H)>, (Refused, H)> {
        let slot = match self.slot(room, secret, now, |s| s.handshake.is_some(), "duplicate_handshake", "a handshake") {
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
        has: impl Fn(&Slot<R, H>) -> bool,
        reason: &'static str,
        what: &str,
    ) -> Result<&mut Slot<R, H>, Refused> {
        let s = self.slots.entry(room).or_insert_with(|| Slot {
            secret,
            phase: Phase::Bootstrap,
            since: now,
            request: None,
            handshake: None,
        });
        if s.secret != secret {
            return Err(wrong_secret(room));
        }
        if s.phase == Phase::Closing {
            let why = format!("room {room}: an earlier room with this id is still ending");
            return Err(Refused::new(Code::AlreadyExists, "room_closing", why));
        }
        if has(s) || s.phase != Phase::Bootstrap {
            return Err(Refused::new(Code::AlreadyExists, reason, format!("room {room} already has {what}")));
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
    pub fn computed(&mut self, room: Room, now: Instant) {
        if let Some(s) = self.slots.get_mut(&room)
            && s.phase == Phase::Waiting
        {
            s.phase = Phase::Inflight;
            s.since = now;
        }
    }

    /// The room's task reported, or the room never had one: forgets it; returns the phase it
    /// was in.
    pub fn finish(&mut self, room: Room) -> Option<Phase> {
        self.slots.remove(&room).map(|s| s.phase)
    }

    /// The room's transfer moved (a chunk was sent): an inflight room's timeout counts from
    /// its last progress, so a long transfer that keeps moving is not cut.
    pub fn progress(&mut self, room: Room, now: Instant) {
        if let Some(s) = self.slots.get_mut(&room)
            && s.phase == Phase::Inflight
        {
            s.since = now;
        }
    }

    /// The room ended early (failed, aborted, timed out) while its task still runs: it is
    /// `Closing` until [`finish`](Self::finish). A bootstrapping room has no task and is
    /// forgotten at once.
    pub fn close(&mut self, room: Room, now: Instant) {
        match self.slots.get_mut(&room) {
            Some(s) if s.phase == Phase::Bootstrap => {
                self.slots.remove(&room);
            }
            Some(s) => {
                s.phase = Phase::Closing;
                s.since = now;
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
        self.close(room, now);
        Some(gone)
    }

    /// An abort for `room` (checked against its secret when given). Returns the phase and,
    /// when it was still bootstrapping, what it held; a bootstrapping room is forgotten, any
    /// other closes. A room already closing is not aborted again (`Ok(None)`).
    pub fn abort(
        &mut self,
        room: Room,
        secret: Option<RoomSecret>,
        now: Instant,
    ) -> Result<Option<Expired<R, H>>, Refused> {
        match self.slots.get(&room) {
            None => return Ok(None),
            Some(s) if secret.is_some_and(|x| x != s.secret) => {
                return Err(wrong_secret(room));
            }
            Some(s) if s.phase == Phase::Closing => return Ok(None),
            Some(_) => {}
        }
        Ok(self.take(room, now))
    }

    /// Takes out the rooms past their phase's timeout (bootstrapping ones are forgotten,
    /// others close). A closing room has no timeout here: its task's sends and abort are each
    /// bounded by the transfer timeout.
    pub fn expired(&mut self, now: Instant) -> Vec<Expired<R, H>> {
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
mod tests {
    use super::*;

    fn rooms() -> Rooms<&'static str, &'static str> {
        let s = Duration::from_secs(1);
        Rooms::new(PhaseTimeouts { bootstrap: s, waiting: 2 * s, inflight: 3 * s })
    }

    #[test]
    fn either_half_may_come_first_and_pairs_once() {
        let t0 = Instant::now();
        let mut r = rooms();
        assert_eq!(r.request(Room::from(1u32), RoomSecret::from([1; 16]), "req", t0).ok(), Some(None));
        assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Bootstrap));
        assert_eq!(r.handshake(Room::from(1u32), RoomSecret::from([1; 16]), "hs", t0).ok(), Some(Some(("req", "hs"))));
        assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Waiting));
        assert_eq!(r.handshake(Room::from(2u32), RoomSecret::from([2; 16]), "hs", t0).ok(), Some(None));
        assert_eq!(r.request(Room::from(2u32), RoomSecret::from([2; 16]), "req", t0).ok(), Some(Some(("req", "hs"))));
        assert_eq!(r.depth(), (0, 2, 0));
        r.computed(Room::from(1u32), t0);
        assert_eq!(r.depth(), (0, 1, 1));
        assert_eq!(r.finish(Room::from(1u32)), Some(Phase::Inflight));
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn duplicates_and_wrong_secrets_are_refused_without_harm() {
        let t0 = Instant::now();
        let mut r = rooms();
        r.request(Room::from(1u32), RoomSecret::from([1; 16]), "req", t0).expect("first");
        let (e, back) = r.request(Room::from(1u32), RoomSecret::from([1; 16]), "again", t0).expect_err("duplicate");
        assert_eq!((e.code, e.reason, back), (Code::AlreadyExists, "duplicate_room", "again"));
        let (e, _) = r.handshake(Room::from(1u32), RoomSecret::from([9; 16]), "hs", t0).expect_err("wrong secret");
        assert_eq!(e.code, Code::PermissionDenied);
        assert!(r.abort(Room::from(1u32), Some(RoomSecret::from([9; 16])), t0).is_err(), "an abort needs the secret");
        assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Bootstrap), "the room is untouched");
        let gone = r.abort(Room::from(1u32), Some(RoomSecret::from([1; 16])), t0).expect("abort").expect("was known");
        assert_eq!((gone.phase, gone.request), (Phase::Bootstrap, Some("req")));
        assert!(r.abort(Room::from(1u32), None, t0).expect("unknown is fine").is_none());
    }

    /// Issue 21's room-id reuse: an aborted room whose task still runs keeps its id, so a
    /// new request or handshake with that id is refused until the task reports, instead of
    /// replacing the room the engine is still computing and sending.
    #[test]
    fn a_room_id_stays_taken_until_the_aborted_rooms_task_reports() {
        let t0 = Instant::now();
        let mut r = rooms();
        r.request(Room::from(1u32), RoomSecret::from([1; 16]), "req", t0).expect("request");
        assert!(
            r.handshake(Room::from(1u32), RoomSecret::from([1; 16]), "hs", t0).expect("handshake").is_some(),
            "paired: the room task starts"
        );
        let gone = r.abort(Room::from(1u32), Some(RoomSecret::from([1; 16])), t0).expect("abort").expect("was known");
        assert_eq!(gone.phase, Phase::Waiting);
        assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Closing));
        let (e, _) =
            r.request(Room::from(1u32), RoomSecret::from([1; 16]), "again", t0).expect_err("the id is still taken");
        assert_eq!((e.code, e.reason), (Code::AlreadyExists, "room_closing"));
        let (e, _) =
            r.handshake(Room::from(1u32), RoomSecret::from([1; 16]), "again", t0).expect_err("for handshakes too");
        assert_eq!(e.reason, "room_closing");
        assert!(r.abort(Room::from(1u32), None, t0).expect("closing").is_none(), "not aborted twice");
        assert!(r.expired(t0 + Duration::from_secs(3600)).is_empty(), "closing waits for its task");
        assert_eq!(r.depth(), (0, 0, 1));
        assert_eq!(r.finish(Room::from(1u32)), Some(Phase::Closing));
        assert!(
            r.request(Room::from(1u32), RoomSecret::from([1; 16]), "new", t0).is_ok(),
            "free once the task reported"
        );
    }

    /// Issue 21's defect 6: the inflight timeout counted from the end of computation, so a
    /// transfer still moving was cut after it.
    #[test]
    fn an_inflight_room_times_out_from_its_last_progress() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut r = rooms();
        r.request(Room::from(1u32), RoomSecret::from([1; 16]), "a", t0).expect("ok");
        r.handshake(Room::from(1u32), RoomSecret::from([1; 16]), "a", t0).expect("ok");
        r.computed(Room::from(1u32), t0);
        r.progress(Room::from(1u32), t0 + 2 * s);
        assert!(r.expired(t0 + 4 * s).is_empty(), "moving 2 s ago, timeout 3 s");
        assert_eq!(r.expired(t0 + 5 * s).len(), 1);
    }

    #[test]
    fn every_phase_times_out() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut r = rooms();
        r.request(Room::from(1u32), RoomSecret::from([1; 16]), "a", t0).expect("ok");
        r.request(Room::from(2u32), RoomSecret::from([2; 16]), "b", t0).expect("ok");
        r.handshake(Room::from(2u32), RoomSecret::from([2; 16]), "b", t0).expect("ok");
        r.request(Room::from(3u32), RoomSecret::from([3; 16]), "c", t0).expect("ok");
        r.handshake(Room::from(3u32), RoomSecret::from([3; 16]), "c", t0).expect("ok");
        r.computed(Room::from(3u32), t0);
        assert_eq!(r.next_deadline(), Some(t0 + s));
        assert!(r.expired(t0 + s - Duration::from_millis(1)).is_empty());
        let e = r.expired(t0 + s);
        assert_eq!(r.next_deadline(), Some(t0 + 2 * s), "the first deadline left is room 2's");
        assert_eq!((e.len(), e[0].room, e[0].phase, e[0].request), (1, Room::from(1u32), Phase::Bootstrap, Some("a")));
        assert_eq!(
            r.expired(t0 + 2 * s).iter().map(|e| (e.room, e.phase)).collect::<Vec<_>>(),
            vec![(Room::from(2u32), Phase::Waiting)]
        );
        assert_eq!(
            r.expired(t0 + 3 * s).iter().map(|e| (e.room, e.phase)).collect::<Vec<_>>(),
            vec![(Room::from(3u32), Phase::Inflight)]
        );
        // Rooms 2 and 3 had tasks: closing until they report.
        assert_eq!(
            (r.phase(Room::from(2u32)), r.phase(Room::from(3u32))),
            (Some(Phase::Closing), Some(Phase::Closing))
        );
        assert_eq!(r.next_deadline(), None, "closing rooms wait for their tasks, not a clock");
        r.finish(Room::from(2u32));
        r.finish(Room::from(3u32));
        assert!(r.is_empty());
    }
}
