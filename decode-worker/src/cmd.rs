//! What reaches the decode engine thread ([`Cmd`], [`Generate`]) and what it sends and
//! reports ([`Emit`], [`Load`]).

use ferry_cluster::{Room, RoomKey, RoomSecret};

use crate::error::DecodeError;
use ferry_engine::{FinishReason, Sampled, SamplingParams};
use ferry_transfer::table::Outcome;
use tokio::sync::{mpsc, oneshot};

/// One generated token for the client's stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Emit {
    /// The token, with its logprob and top alternatives.
    pub sampled: Sampled,
    /// Set on the last token.
    pub finish: Option<FinishReason>,
    /// On the last token: the request's phases here, in order.
    pub phases: Vec<ferry_cluster::phases::Lap>,
    /// On the first token of a prompt computed here that asked for them: the prompt logprobs.
    pub prompt: Vec<Sampled>,
    /// Which of the request's sequences it belongs to (0 .. n-1).
    pub index: u32,
    /// On the first token of a prompt prefilled here: its tokens found in the prefix cache.
    pub cached: u32,
}

/// A client's stream of tokens (or the error that ended it).
pub type Out = mpsc::UnboundedSender<Result<Emit, DecodeError>>;

/// A Decode.Generate call.
pub struct Generate {
    /// Room and secret.
    pub key: RoomKey,
    /// This request's incarnation ([`crate::wake::next_incarnation`]).
    pub incarnation: u64,
    /// The prefill node's bootstrap address; None: prefill here.
    pub bootstrap: Option<String>,
    /// Prompt.
    pub prompt: Vec<u32>,
    /// Sampling.
    pub params: SamplingParams,
    /// The output constraint, compiled (the service compiles it off this thread).
    pub guide: Option<ferry_engine::Guide>,
    /// With `n` > 1 sequences: the constraint of each other sequence (one each, `None` when
    /// unconstrained).
    pub forks: Vec<Option<ferry_engine::Guide>>,
    /// Where tokens go.
    pub out: Out,
    /// Accepted or refused (before any token).
    pub accepted: oneshot::Sender<Result<(), DecodeError>>,
    /// The request's span (request id, room, trace id): lines about it are written in it.
    pub span: tracing::Span,
    /// Its trace context, the parent of the handshake call.
    pub trace: ferry_cluster::TraceContext,
}

/// Commands to the engine thread.
pub enum Cmd {
    /// A new request.
    Generate(Box<Generate>),
    /// An Abort call; replies whether the room was known.
    Abort {
        /// Room.
        room: Room,
        /// Its secret.
        secret: RoomSecret,
        /// Why.
        reason: String,
        /// Only this sequence of a request with `n` > 1, quietly (the others go on).
        sequence: Option<u32>,
        /// Whether it was known.
        reply: oneshot::Sender<Result<bool, DecodeError>>,
    },
    /// A request's token stream was dropped (the client went away, or the stream ended).
    Gone {
        /// Room.
        room: Room,
        /// The request's incarnation.
        incarnation: u64,
    },
    /// A room's transfer ended.
    Transferred {
        /// Room.
        room: Room,
        /// The request's incarnation.
        incarnation: u64,
        /// How (None: the receiver dropped the room unresolved).
        outcome: Option<Outcome>,
    },
    /// The last write into a closed room's pages landed: they may be reused.
    Released {
        /// Room.
        room: Room,
    },
    /// The handshake with the prefill node failed.
    HandshakeFailed {
        /// Room.
        room: Room,
        /// Why.
        why: DecodeError,
    },
    /// A prefill node pulls a room's held pages (`Holder.Pull`): they are lent to the pull
    /// (their ids, host-mirrored when the pool has a mirror) under a new pull id.
    Pull {
        /// Room.
        room: Room,
        /// Its secret.
        secret: RoomSecret,
        /// Index of the first prompt page wanted.
        first: usize,
        /// Pages wanted.
        n: usize,
        /// The pull id and the page ids, or why not.
        reply: oneshot::Sender<Result<(u64, Vec<u32>), DecodeError>>,
    },
    /// A pull's pages were sent (or its send failed or was dropped): whether the room held
    /// them all along (not ended nor retracted since, so no page was reused while it was read).
    PullDone {
        /// The pull id.
        id: u64,
        /// Whether its pages stayed the room's.
        reply: oneshot::Sender<bool>,
    },
    /// Stop admitting, abort everything, free every page, exit.
    Shutdown,
    /// A snapshot of the prefix cache, for a `KvEvents` subscriber.
    Snapshot {
        /// Where it goes.
        reply: oneshot::Sender<ferry_radix::events::KvEvent>,
    },
}

/// What the Load service and the metrics report.
#[derive(Debug, Clone, Default)]
pub struct Load {
    /// Requests per stage.
    pub depth: Vec<(&'static str, usize)>,
    /// Pages no request holds: free, or in the prefix cache and evictable.
    pub free_pages: usize,
    /// Of those, the prefix cache's.
    pub evictable_pages: usize,
    /// Pages free and not promised to admitted requests.
    pub admissible_pages: usize,
    /// All pages.
    pub total_pages: usize,
}
