//! What reaches the prefill engine thread ([`Cmd`] and its payloads) and what it reports
//! ([`PrefillDone`], [`Load`]).

use std::sync::Arc;

use crate::error::{PrefillError, TaskError};

use ferry_cluster::{Room, RoomSecret};
use ferry_engine::SamplingParams;
use ferry_radix::events::KvEvent;
use ferry_transfer::backend::TransferConfig;
use ferry_transfer::{BackendKind, Sender};
use tokio::sync::oneshot;

/// What the Prefill call gets back.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillDone {
    /// Prompt tokens found in the cache.
    pub cached_tokens: u32,
    /// The first sampled token.
    pub first_token: u32,
    /// Its logprob.
    pub logprob: f32,
    /// Its most likely alternatives, when asked for.
    pub top: Vec<(u32, f32)>,
    /// The room's phases here, in order.
    pub phases: Vec<ferry_cluster::phases::Lap>,
    /// Each prompt token after the first with its logprob and alternatives, when asked for.
    pub prompt_logprobs: Vec<ferry_engine::Sampled>,
}

/// Replies to a Prefill call.
pub type PrefillReply = oneshot::Sender<Result<PrefillDone, PrefillError>>;

/// A request for the engine.
pub struct NewRequest {
    /// Prompt.
    pub tokens: Vec<u32>,
    /// Sampling of the first token.
    pub sampling: SamplingParams,
    /// The output constraint the first token obeys, compiled (off the engine's thread).
    pub guide: Option<ferry_engine::Guide>,
    /// Scheduling priority.
    pub priority: i32,
    /// The decode node to pull held pages from, when the router allows it.
    pub pull_from: Option<String>,
    /// Where the outcome goes.
    pub reply: PrefillReply,
    /// The request's span (request id, room, trace id): lines about it are written in it.
    pub span: tracing::Span,
}

/// A decode node's handshake, its sender already connected.
pub struct Handshake {
    /// Destination pages, in prompt order, after the held ones.
    pub dest: Vec<u32>,
    /// Leading prompt pages the decode node holds already: not sent (delta transfer).
    pub held: usize,
    /// The data-plane sender to that decode node.
    pub sender: Arc<Sender>,
    /// How to reach that decode node anew, to abort the room there when the sender's
    /// connection breaks.
    pub reconnect: Reconnect,
}

/// A decode node's data plane, to connect to again.
#[derive(Debug, Clone)]
pub struct Reconnect {
    /// The transfer backend.
    pub kind: BackendKind,
    /// Its data-plane endpoint.
    pub endpoint: String,
    /// Transfer settings.
    pub cfg: TransferConfig,
}

/// Commands to the engine thread.
pub enum Cmd {
    /// A Prefill call.
    Request { room: Room, secret: RoomSecret, req: NewRequest },
    /// A Bootstrap.Handshake call.
    Handshake { room: Room, secret: RoomSecret, hs: Handshake, reply: oneshot::Sender<Result<(), PrefillError>> },
    /// An Abort call; replies whether the room was known.
    Abort { room: Room, secret: RoomSecret, reason: String, reply: oneshot::Sender<Result<bool, PrefillError>> },
    /// A room task sent a chunk (the inflight timeout counts from the last one).
    Progress { room: Room },
    /// A room task finished: its transfer succeeded or failed.
    Sent { room: Room, result: Result<(), TaskError> },
    /// A pull of held pages ended ([`crate::pull`]).
    Pulled(Box<crate::pull::Pulled>),
    /// A snapshot of the prefix cache for a KV event subscriber.
    Snapshot { reply: oneshot::Sender<KvEvent> },
    /// Stop admitting, abort what is in flight, free everything, exit.
    Shutdown,
}

/// What the Load service and the metrics report.
#[derive(Debug, Clone, Default)]
pub struct Load {
    /// Rooms per phase (bootstrap, waiting, inflight).
    pub depth: (usize, usize, usize),
    /// Free pages.
    pub free_pages: usize,
    /// Evictable cached pages.
    pub evictable_pages: usize,
    /// All pages.
    pub total_pages: usize,
    /// Prompt tokens still to compute.
    pub queued_tokens: usize,
    /// Measured prefill rate (tokens per second, moving average).
    pub tokens_per_second: f64,
}
