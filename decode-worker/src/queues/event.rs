//! What the decode queues hear ([`Event`]) and what they decide ([`Action`]): the engine
//! thread turns what happens (a call, a finished pass, a transfer's outcome, time passing)
//! into events, hands them to [`Queues::on`](super::Queues::on) and carries out the actions,
//! in order. The queues count every page they hand out, so the pool's free pages must always
//! equal [`Queues::free_pages`](super::Queues::free_pages).

use ferry_cluster::Room;

use super::Stage;

/// Why the queues refused a request: a domain reason with a stable name; the engine maps it to
/// a gRPC status once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It asks for more sequences than the node runs at once.
    NOverBatch {
        /// Sequences asked for.
        n: usize,
        /// Requests the node runs at once.
        max: usize,
    },
    /// Its prompt and max tokens cannot fit the pool even alone (it would never be admitted).
    OverPool {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens each sequence may generate.
        limit: usize,
        /// Sequences.
        n: usize,
        /// Pages it would need.
        need: usize,
        /// Pages in the pool.
        pool: usize,
    },
    /// Not one constraint for each of its other sequences.
    ForkConstraints {
        /// Constraints given.
        given: usize,
        /// Sequences asked for.
        n: usize,
    },
    /// A request of this room id is here.
    DuplicateRoom,
    /// An ended request of this room id still has a page run being written.
    RoomClosing,
}

impl Refusal {
    /// Stable name (the `ferry-reason` a caller sees).
    pub fn label(self) -> &'static str {
        match self {
            Self::NOverBatch { .. } => "n_over_batch",
            Self::OverPool { .. } => "request_over_pool",
            Self::ForkConstraints { .. } => "fork_constraints",
            Self::DuplicateRoom => "duplicate_room",
            Self::RoomClosing => "room_closing",
        }
    }

    /// What the caller is told.
    pub fn message(self, room: Room) -> String {
        match self {
            Self::NOverBatch { n, max } => format!("n = {n} sequences: this decode worker runs at most {max}"),
            Self::OverPool { prompt, limit, n, need, pool } => {
                let seqs = if n > 1 { format!(" for {n} sequences") } else { String::new() };
                format!(
                    "the prompt ({prompt} tokens) and max_tokens ({limit}){seqs} need {need} KV pages; this decode worker has {pool}: lower max_tokens"
                )
            }
            Self::ForkConstraints { given, n } => format!("{given} constraints for {} more sequences", n - 1),
            Self::DuplicateRoom => format!("room {room} is already here"),
            Self::RoomClosing => format!("room {room}: an earlier room with this id is still closing"),
        }
    }
}

/// Something that happened to the decode node's requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A new request: a prompt of `prompt` tokens that may generate `limit` tokens; `local`:
    /// prefilled here, else its KV comes from a prefill node.
    Request {
        /// Its room.
        room: Room,
        /// Prompt tokens.
        prompt: usize,
        /// Tokens it may generate.
        limit: usize,
        /// Prefilled here.
        local: bool,
        /// Sequences asked for (`n`): they fork once the prompt's KV is complete.
        n: usize,
        /// Constraints given for its other sequences (one each: `n - 1`).
        forks: usize,
    },
    /// Its prompt's KV is complete and it stands for more than one sequence: `children` (its
    /// other sequences, as rooms of their own) join, prefilling the prompt's last token here,
    /// and the prompt's full pages become theirs together.
    Fork {
        /// Its room.
        room: Room,
        /// A room for each other sequence.
        children: Vec<Room>,
    },
    /// Admit from the head of the prealloc queue what the free pages allow.
    Admit,
    /// Its receiver room ended (`ok`: every page and the last frame arrived) or its handshake
    /// failed (not `ok`): a room still in Transfer lands its pages or fails; one that left
    /// Transfer meanwhile (cancelled, expired, a late report) changes nothing.
    TransferEnded {
        /// Its room.
        room: Room,
        /// The pages all arrived.
        ok: bool,
    },
    /// Its received pages are on the device: the prompt's KV is here (Transfer → Waiting).
    Transferred(Room),
    /// The KV it had to compute here is computed (Prefill → Running).
    Computed(Room),
    /// Its first token went out: it joins the batch (Waiting → Running).
    Joined(Room),
    /// It generated a token.
    Token(Room),
    /// The pool refused pages of a [`Action::Grow`] (the pool and the queues disagree, a bug):
    /// the queues stop counting them.
    GrowFailed {
        /// Its room.
        room: Room,
        /// The pages not given.
        pages: usize,
    },
    /// Before a forward pass: every running request gets the pages its next token needs;
    /// when the pool is short, victims are retracted until it is not.
    MakeRoom,
    /// A forward pass ran; `decoding`: it decoded tokens of running requests.
    Stepped {
        /// Whether the pass had decode rows.
        decoding: bool,
    },
    /// It ended (finished, failed, cancelled); `writing`: its closed receiver room still has a
    /// run being written into its pages.
    End {
        /// Its room.
        room: Room,
        /// A write may still land in its pages.
        writing: bool,
    },
    /// The last write into an ended request's pages landed.
    Released(Room),
    /// Time passed: requests past their stage's timeout are reported.
    Tick,
}

/// What the engine must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Refuse the request (it was not queued).
    Refuse(Refusal),
    /// Allocate `pages` pages for the request's context; `local`: it prefills here, else
    /// open its receiver room and start the handshake.
    Allocate {
        /// Its room.
        room: Room,
        /// Pages.
        pages: usize,
        /// Prefill here.
        local: bool,
    },
    /// Give a running request `pages` more pages.
    Grow {
        /// Its room.
        room: Room,
        /// More pages.
        pages: usize,
    },
    /// Drop the request's `pages` pages (with its group's, when it was their last reader): it waits at the front of the prealloc queue and
    /// recomputes `context` tokens (its prompt and all its generated tokens but the last)
    /// when admitted again.
    Retract {
        /// Its room.
        room: Room,
        /// Pages it held.
        pages: usize,
        /// Tokens it recomputes.
        context: usize,
        /// It was decoding (else prefilling here).
        running: bool,
    },
    /// Return `pages` pages of an ended (or released) request to the pool.
    Free {
        /// Its room.
        room: Room,
        /// Pages.
        pages: usize,
    },
    /// Keep an ended request's `pages` pages aside until [`Event::Released`].
    Drain {
        /// Its room.
        room: Room,
        /// Pages.
        pages: usize,
    },
    /// Its pages all arrived: copy them onto the device, then [`Event::Transferred`].
    Land(Room),
    /// Its transfer or handshake failed: end it with the reason the engine holds.
    Fail(Room),
    /// The request waited past its stage's timeout: end it.
    Expired {
        /// Its room.
        room: Room,
        /// Where it waited.
        stage: Stage,
    },
}
