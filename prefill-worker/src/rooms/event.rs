//! What the prefill rooms hear ([`Event`]) and what they decide ([`Action`]); `R` and `H` are
//! the engine's request and handshake payloads, handed back in the actions.

use ferry_cluster::{Room, RoomSecret};

use super::Expired;

/// Why the rooms refused a request, a handshake or an abort: a domain reason with a stable
/// name; the engine maps it to a gRPC status once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The room is here with another secret.
    WrongSecret,
    /// The room already has its request (or is past bootstrap).
    DuplicateRoom,
    /// The room already has its handshake (or is past bootstrap).
    DuplicateHandshake,
    /// An earlier room with this id is still ending (its task has not reported).
    RoomClosing,
}

impl Refusal {
    /// Stable name (the `ferry-reason` a caller sees).
    pub fn label(self) -> &'static str {
        match self {
            Self::WrongSecret => "wrong_secret",
            Self::DuplicateRoom => "duplicate_room",
            Self::DuplicateHandshake => "duplicate_handshake",
            Self::RoomClosing => "room_closing",
        }
    }

    /// What the caller is told.
    pub fn message(self, room: Room) -> String {
        match self {
            Self::WrongSecret => format!("room {room}: wrong room secret"),
            Self::DuplicateRoom => format!("room {room} already has a request"),
            Self::DuplicateHandshake => format!("room {room} already has a handshake"),
            Self::RoomClosing => format!("room {room}: an earlier room with this id is still ending"),
        }
    }
}

/// Something that happened to a room.
pub enum Event<R, H, L = ()> {
    /// A Prefill call (its prompt already checked).
    Request {
        /// The room.
        room: Room,
        /// Its secret.
        secret: RoomSecret,
        /// The request.
        request: R,
    },
    /// A decode node's handshake.
    Handshake {
        /// The room.
        room: Room,
        /// Its secret.
        secret: RoomSecret,
        /// The handshake.
        handshake: H,
    },
    /// An Abort call (`secret` checked), or the worker stopping (`None`).
    Abort {
        /// The room.
        room: Room,
        /// The caller's secret; None: the worker's own abort.
        secret: Option<RoomSecret>,
    },
    /// The engine started the room (scheduled it, its task running): its record lives here
    /// until the task reports.
    Started {
        /// The room.
        room: Room,
        /// The engine's record.
        live: L,
    },
    /// The engine hands pages to the room's task (with a host mirror: they are read from
    /// their mirror pages until the task reports).
    Handing {
        /// The room.
        room: Room,
        /// Its pages, in order.
        pages: Vec<u32>,
    },
    /// The room's prompt is computed: its last pages are on the wire.
    Computed(Room),
    /// Its task sent a chunk: the inflight timeout counts from here.
    Progress(Room),
    /// The engine failed the room while its task runs: why (what its caller was told).
    Close {
        /// The room.
        room: Room,
        /// Why.
        why: String,
    },
    /// Its task reported (or it never had one).
    Finished(Room),
    /// Time passed: rooms past their phase's timeout leave.
    Tick,
}

/// What the engine must do.
pub enum Action<R, H, L = ()> {
    /// Refuse the request; it is handed back.
    RefuseRequest {
        /// The room.
        room: Room,
        /// The request.
        request: R,
        /// Why.
        why: Refusal,
    },
    /// Refuse the handshake; it is handed back. (A handshake with no such action was taken.)
    RefuseHandshake {
        /// The room.
        room: Room,
        /// The handshake.
        handshake: H,
        /// Why.
        why: Refusal,
    },
    /// Request and handshake are both here: schedule the room.
    Pair {
        /// The room.
        room: Room,
        /// Its secret.
        secret: RoomSecret,
        /// The request.
        request: R,
        /// The handshake.
        handshake: H,
    },
    /// The answer to an Abort call: whether the room was known (a closing room is not
    /// aborted again), or the refusal of a wrong secret.
    Aborted(Result<bool, Refusal>),
    /// The room left by abort or timeout, with what it held: answer the request, abort the
    /// handshake's room on the decode node, and (past bootstrap) stop its task.
    Gone(Expired<R, H>),
    /// Copy these of the pages handed over to their mirror pages first: no other room's task
    /// is sending them (a page on the wire for another room is a cached prefix page, locked
    /// and unchanged since it was copied, and its mirror page may be being read).
    Mirror {
        /// Pages to copy.
        pages: Vec<u32>,
    },
    /// The room's task reported (or it never had one): the room is forgotten, its record
    /// handed back to release what it holds.
    Finished {
        /// The room.
        room: Room,
        /// The engine's record, if it was started.
        live: Option<L>,
        /// Why it closed early, if it did (else its task's report is its outcome).
        closed: Option<String>,
    },
}
