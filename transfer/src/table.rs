//! The receiver's table of open rooms: which destination pages each room may fill, what has
//! arrived, and every refusal counted by reason. Pure (no I/O, caller's clock).
//!
//! Safety rules enforced here: a frame is accepted only for an open room, with its secret,
//! and only for destination pages preallocated for that room and not yet received (or
//! being received); no page belongs to two open rooms. A page run is *claimed* before its
//! payload is read and *committed* after its checksum passed, so two writers never touch
//! one page and a corrupt payload never reaches a page.

use ferry_core::{PageId, Room, RoomSecret};
use std::collections::HashMap;
use std::time::Instant;

use crate::frame::{Aux, Header};
use crate::room::{FailReason, Progress, State, Timeouts};

/// Why a frame or a room was refused (a metrics label each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// No open room with this id.
    UnknownRoom,
    /// The secret does not match.
    WrongSecret,
    /// Pages outside the room's destination pages.
    OutsideRoom,
    /// Pages already received or being received.
    Duplicate,
    /// The room already ended.
    Closed,
    /// `open` for a room id that is open.
    DuplicateRoom,
    /// `open` with pages that another open room holds.
    PagesInUse,
    /// `open` for a room id whose earlier incarnation is closed but still has a run being
    /// written.
    RoomClosing,
}

impl Refusal {
    /// Stable label.
    pub fn label(self) -> &'static str {
        match self {
            Self::UnknownRoom => "unknown_room",
            Self::WrongSecret => "wrong_secret",
            Self::OutsideRoom => "outside_room",
            Self::Duplicate => "duplicate_pages",
            Self::Closed => "closed",
            Self::DuplicateRoom => "duplicate_room",
            Self::PagesInUse => "pages_in_use",
            Self::RoomClosing => "room_closing",
        }
    }
}

/// How a room ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// All pages and the aux data arrived.
    Success(Aux),
    /// The room failed.
    Failed(FailReason),
}

/// Pages `first..first + n` of one room, claimed for one writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// The room.
    pub room: Room,
    /// Which opening of the room id the claim belongs to: a claim settles only its own
    /// incarnation, never a later room opened with the same id.
    pub incarnation: u64,
    /// First destination page.
    pub first: u32,
    /// Pages.
    pub n: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageState {
    Expected,
    Claimed,
    Received,
}

struct Closing {
    incarnation: u64,
    pages: Vec<u32>,
    claimed: usize,
    /// An RDMA sender still holds windows over the pages ([`RoomTable::end_lease`]).
    leased: bool,
}

struct RecvRoom {
    incarnation: u64,
    secret: RoomSecret,
    /// Destination page → its state.
    pages: HashMap<u32, PageState>,
    received: usize,
    aux: Option<Aux>,
    room: Progress,
    /// A peer already used this room's key for an RDMA connection exchange.
    admitted_peer: bool,
    /// An RDMA sender was granted windows over this room's pages.
    granted: bool,
    /// ... and has ended the room since (its `Done` or `Abort`, its connection gone), or its
    /// windows were revoked: nothing of it can write the pages any more.
    lease_ended: bool,
}

/// Open rooms of one receiver.
pub struct RoomTable {
    rooms: HashMap<Room, RecvRoom>,
    /// Closed rooms with runs still being written: their pages stay owned until the last
    /// claim settles, so no new room is handed a page a writer may still touch.
    closing: HashMap<Room, Closing>,
    /// Destination page → the open room holding it.
    owners: HashMap<PageId, Room>,
    refusals: HashMap<Refusal, u64>,
    timeouts: Timeouts,
    ended: Vec<(Room, Outcome)>,
    /// Closed rooms whose last run being written settled since the last
    /// [`drain_released`](Self::drain_released): their pages are free.
    released: Vec<Room>,
    /// The next room's incarnation (every `open` takes one).
    next_incarnation: u64,
}

impl std::fmt::Debug for RoomTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomTable").field("rooms", &self.rooms.len()).field("refusals", &self.refusals).finish()
    }
}

impl RoomTable {
    /// An empty table.
    pub fn new(timeouts: Timeouts) -> Self {
        Self {
            rooms: HashMap::new(),
            closing: HashMap::new(),
            owners: HashMap::new(),
            refusals: HashMap::new(),
            timeouts,
            ended: Vec::new(),
            released: Vec::new(),
            next_incarnation: 0,
        }
    }

    fn refuse<T>(&mut self, r: Refusal) -> Result<T, Refusal> {
        *self.refusals.entry(r).or_default() += 1;
        crate::metrics::refused(r);
        Err(r)
    }

    /// Refusals so far, by reason.
    pub fn refusals(&self, r: Refusal) -> u64 {
        self.refusals.get(&r).copied().unwrap_or(0)
    }

    /// Open rooms.
    pub fn open_rooms(&self) -> usize {
        self.rooms.len()
    }

    /// Destination pages held by open rooms.
    pub fn held_pages(&self) -> usize {
        self.owners.len()
    }

    /// Opens a room that may fill `dest` (its preallocated pages), waiting for input. A room
    /// id is refused while an earlier room of that id is open, or closed with a run still
    /// being written ([`Refusal::RoomClosing`]).
    pub fn open(&mut self, room: Room, secret: RoomSecret, dest: &[u32], now: Instant) -> Result<(), Refusal> {
        if self.rooms.contains_key(&room) {
            return self.refuse(Refusal::DuplicateRoom);
        }
        if self.closing.contains_key(&room) {
            return self.refuse(Refusal::RoomClosing);
        }
        let mut pages = HashMap::with_capacity(dest.len());
        for &p in dest {
            if self.owners.contains_key(&PageId(p)) || pages.insert(p, PageState::Expected).is_some() {
                return self.refuse(Refusal::PagesInUse);
            }
        }
        for &p in dest {
            self.owners.insert(PageId(p), room);
        }
        let mut r = Progress::new(now, self.timeouts);
        // The receiver opens a room once the handshake is sent: it waits for input.
        let _ = r.advance(State::WaitingForInput, now);
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        self.rooms.insert(
            room,
            RecvRoom {
                incarnation,
                secret,
                pages,
                received: 0,
                aux: None,
                room: r,
                admitted_peer: false,
                granted: false,
                lease_ended: false,
            },
        );
        Ok(())
    }

    /// Whether a peer showing `room` and `secret` holds the key of a room open here, still
    /// waiting for its first frame, that no peer used before: what the RDMA connection
    /// exchange asks before it hands out anything, so one key opens one exchange and a key
    /// already seen on the wire opens none. Refusals are counted like a frame's.
    pub fn admit_peer(&mut self, room: Room, secret: &RoomSecret) -> Result<(), Refusal> {
        let Some(r) = self.rooms.get(&room) else { return self.refuse(Refusal::UnknownRoom) };
        if r.secret != *secret {
            return self.refuse(Refusal::WrongSecret);
        }
        // Only before its first frame: a key seen on the wire opens no exchange.
        if r.room.state() != State::WaitingForInput || r.admitted_peer {
            return self.refuse(Refusal::Closed);
        }
        if let Some(r) = self.rooms.get_mut(&room) {
            r.admitted_peer = true;
        }
        Ok(())
    }

    /// An RDMA sender asks to write `room`'s pages, showing its key: once per room, before
    /// its first frame. Returns the room's destination pages, sorted (the windows to bind).
    pub fn grant(&mut self, room: Room, secret: &RoomSecret) -> Result<Vec<u32>, Refusal> {
        let Some(r) = self.rooms.get_mut(&room) else { return self.refuse(Refusal::UnknownRoom) };
        if r.secret != *secret {
            return self.refuse(Refusal::WrongSecret);
        }
        if r.room.state() != State::WaitingForInput || r.granted {
            return self.refuse(Refusal::Closed);
        }
        r.granted = true;
        let mut pages: Vec<u32> = r.pages.keys().copied().collect();
        pages.sort_unstable();
        Ok(pages)
    }

    /// Checks a frame header and claims its pages (for `Pages` frames).
    pub fn claim(&mut self, h: &Header, now: Instant) -> Result<Claim, Refusal> {
        let Some(r) = self.rooms.get_mut(&h.room) else { return self.refuse(Refusal::UnknownRoom) };
        if r.secret != h.secret {
            return self.refuse(Refusal::WrongSecret);
        }
        if r.room.state().is_terminal() {
            return self.refuse(Refusal::Closed);
        }
        // A run ending past u32::MAX cannot be inside any room (found by the fuzzer).
        let Some(end) = h.dst_page.checked_add(h.n_pages) else { return self.refuse(Refusal::OutsideRoom) };
        let run = h.dst_page..end;
        let mut verdict = None;
        for p in run.clone() {
            match r.pages.get(&p) {
                None => verdict = verdict.or(Some(Refusal::OutsideRoom)),
                Some(PageState::Claimed | PageState::Received) => verdict = verdict.or(Some(Refusal::Duplicate)),
                Some(PageState::Expected) => {}
            }
        }
        if let Some(v) = verdict {
            return self.refuse(v);
        }
        for p in run {
            r.pages.insert(p, PageState::Claimed);
        }
        let _ = r.room.advance(State::Transferring, now);
        r.room.progress(now);
        Ok(Claim { room: h.room, incarnation: r.incarnation, first: h.dst_page, n: h.n_pages })
    }

    /// Marks claimed pages as received (their payload passed its checksum and was written).
    pub fn commit(&mut self, c: Claim, now: Instant) {
        if self.settle_closing(c) {
            return;
        }
        let Some(r) = self.rooms.get_mut(&c.room).filter(|r| r.incarnation == c.incarnation) else { return };
        for p in c.first..c.first + c.n {
            if r.pages.get(&p) == Some(&PageState::Claimed) {
                r.pages.insert(p, PageState::Received);
                r.received += 1;
            }
        }
        r.room.progress(now);
        self.try_complete(c.room, now);
    }

    /// Ends a claim whose payload did not (fully, or correctly) land: its pages are expected
    /// again (the caller fails the room).
    pub fn unclaim(&mut self, c: Claim) {
        if self.settle_closing(c) {
            return;
        }
        let Some(r) = self.rooms.get_mut(&c.room).filter(|r| r.incarnation == c.incarnation) else { return };
        for p in c.first..c.first + c.n {
            if r.pages.get(&p) == Some(&PageState::Claimed) {
                r.pages.insert(p, PageState::Expected);
            }
        }
    }

    /// A claim of a closed room settled; true when the claim's incarnation was closing.
    fn settle_closing(&mut self, c: Claim) -> bool {
        let Some(z) = self.closing.get_mut(&c.room).filter(|z| z.incarnation == c.incarnation) else { return false };
        z.claimed = z.claimed.saturating_sub(c.n as usize);
        self.release_if_settled(c.room);
        true
    }

    /// Releases a closing room's pages once no run is being written and no sender holds
    /// windows over them.
    fn release_if_settled(&mut self, room: Room) {
        if self.closing.get(&room).is_some_and(|z| z.claimed == 0 && !z.leased)
            && let Some(z) = self.closing.remove(&room)
        {
            for p in z.pages {
                self.owners.remove(&PageId(p));
            }
            self.released.push(room);
        }
    }

    /// The RDMA sender granted `room` can write its pages no more (it ended the room, its
    /// queue pair is gone, or its windows were revoked): a closed room's pages are released
    /// (when no run is being written either).
    pub fn end_lease(&mut self, room: Room) {
        if let Some(r) = self.rooms.get_mut(&room) {
            r.lease_ended = true;
        } else if let Some(z) = self.closing.get_mut(&room) {
            z.leased = false;
            self.release_if_settled(room);
        }
    }

    /// Whether `room` is closed but an RDMA sender may still write its pages.
    pub fn leased_closing(&self, room: Room) -> bool {
        self.closing.get(&room).is_some_and(|z| z.leased)
    }

    /// Whether a closed room still has runs being written, or an RDMA sender's windows over
    /// its pages (its pages are not free yet).
    pub fn writing(&self, room: Room) -> bool {
        self.closing.contains_key(&room)
    }

    /// Records the room's `Done` frame (already checked by [`claim`](Self::claim)'s rules:
    /// call [`check_control`](Self::check_control) first).
    pub fn done(&mut self, room: Room, aux: Aux, now: Instant) {
        let Some(r) = self.rooms.get_mut(&room) else { return };
        if aux.room_echo != room.get() || aux.total_pages as usize != r.pages.len() {
            let why =
                format!("aux says {} pages for room {:#x}, {} expected", aux.total_pages, aux.room_echo, r.pages.len());
            self.fail(room, FailReason::Corrupt(why));
            return;
        }
        r.aux = Some(aux);
        self.try_complete(room, now);
    }

    /// Checks a `Done` / `Abort` header: known open room with the right secret.
    pub fn check_control(&mut self, h: &Header) -> Result<(), Refusal> {
        let Some(r) = self.rooms.get(&h.room) else { return self.refuse(Refusal::UnknownRoom) };
        if r.secret != h.secret {
            return self.refuse(Refusal::WrongSecret);
        }
        if r.room.state().is_terminal() {
            return self.refuse(Refusal::Closed);
        }
        Ok(())
    }

    fn try_complete(&mut self, room: Room, now: Instant) {
        let Some(r) = self.rooms.get_mut(&room) else { return };
        if let (Some(aux), true) = (r.aux, r.received == r.pages.len())
            && r.room.advance(State::Success, now).is_ok()
        {
            self.ended.push((room, Outcome::Success(aux)));
        }
    }

    /// Fails a room (its claimed pages stay unusable until it is closed).
    pub fn fail(&mut self, room: Room, reason: FailReason) {
        if let Some(r) = self.rooms.get_mut(&room)
            && r.room.fail(reason.clone())
        {
            self.ended.push((room, Outcome::Failed(reason)));
        }
    }

    /// Fails rooms whose state outlived its timeout.
    pub fn tick(&mut self, now: Instant) {
        let mut failed = Vec::new();
        for (&id, r) in &mut self.rooms {
            if let Some(reason) = r.room.tick(now) {
                failed.push((id, reason));
            }
        }
        self.ended.extend(failed.into_iter().map(|(id, reason)| (id, Outcome::Failed(reason))));
    }

    /// Rooms that ended since the last call. The caller acts on them, then [`close`]s them.
    ///
    /// [`close`]: Self::close
    pub fn drain_ended(&mut self) -> Vec<(Room, Outcome)> {
        std::mem::take(&mut self.ended)
    }

    /// Closed rooms whose pages stopped being written since the last call (each was
    /// [`writing`](Self::writing) when it closed).
    pub fn drain_released(&mut self) -> Vec<Room> {
        std::mem::take(&mut self.released)
    }

    /// The state of an open room.
    pub fn state(&self, room: Room) -> Option<State> {
        self.rooms.get(&room).map(|r| r.room.state())
    }

    /// Forgets a room; later frames for it are refused. Its pages are released at once, or,
    /// when runs are still being written into them or an RDMA sender still holds windows over
    /// them, once the last of those settles and the sender's lease ends (see
    /// [`writing`](Self::writing), [`end_lease`](Self::end_lease)). Returns its state, or None
    /// when it was not open.
    pub fn close(&mut self, room: Room) -> Option<State> {
        let r = self.rooms.remove(&room)?;
        let claimed = r.pages.values().filter(|&&s| s == PageState::Claimed).count();
        let leased = r.granted && !r.lease_ended;
        if claimed > 0 || leased {
            let pages = r.pages.keys().copied().collect();
            self.closing.insert(room, Closing { incarnation: r.incarnation, pages, claimed, leased });
        } else {
            for p in r.pages.keys() {
                self.owners.remove(&PageId(*p));
            }
        }
        Some(r.room.state())
    }
}

#[cfg(test)]
mod tests;
