//! Every way a decode call or request fails, as one type: the engine, its tasks and the
//! handlers say what happened; `service.rs` alone decides the gRPC code and the stable reason
//! (`ferry-reason`) each failure gets (`impl From<DecodeError> for Refused`).

use ferry_cluster::Room;
use ferry_transfer::room::FailReason;

use crate::queues::Refusal;

/// Why a decode call or request failed. Its `Display` is what the caller reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A request the worker cannot take as asked (`reason`: `malformed`, `prompt_too_long`,
    /// `invalid_request`, `pull_pages`, `bad_bootstrap_addr`).
    #[error("{message}")]
    Invalid {
        /// Stable reason.
        reason: &'static str,
        /// What was wrong.
        message: String,
    },
    /// The queues refused it before holding anything.
    #[error("{}", .why.message(*.room))]
    Refused {
        /// Why.
        why: Refusal,
        /// Its room.
        room: Room,
    },
    /// An Abort call with the room's secret ended it.
    #[error("aborted: {0}")]
    Aborted(String),
    /// An Abort or Pull call named the room with another secret.
    #[error("room {0}: wrong secret")]
    WrongSecret(Room),
    /// Its caller dropped the stream.
    #[error("the client went away")]
    ClientGone,
    /// The worker stops.
    #[error("the worker is shutting down")]
    ShuttingDown,
    /// It waited in prealloc while the node made no progress.
    #[error("no KV pages became free in time")]
    NoRoom,
    /// It waited past its stage's timeout (the stage's label).
    #[error("timed out in {0}")]
    Timeout(&'static str),
    /// The pool refused pages the queues counted free (a bug, contained).
    #[error("{0}")]
    OutOfPages(String),
    /// Its KV transfer failed.
    #[error("KV transfer failed: {0:?}")]
    Transfer(FailReason),
    /// The receiver would not open its room.
    #[error("receiver refused the room: {}", .0.label())]
    RoomRefused(ferry_transfer::table::Refusal),
    /// Its receiver room vanished before its transfer ended.
    #[error("the transfer room vanished")]
    RoomLost,
    /// The prefill node's address could not be reached, or its connection broke.
    #[error("{0}")]
    PrefillUnreachable(String),
    /// The prefill node did not answer the handshake in time.
    #[error("the prefill node did not answer the handshake")]
    HandshakeTimeout,
    /// The prefill node refused the handshake, with its status's code.
    #[error("the prefill node refused the handshake: {message}")]
    HandshakeRefused {
        /// The prefill node's code.
        code: tonic::Code,
        /// Its message.
        message: String,
    },
    /// A Pull call for a room that is not here.
    #[error("room {0} is not here")]
    NoSuchRoom(Room),
    /// A Pull call for a room no longer waiting for its transfer.
    #[error("room {0} is not waiting for its transfer")]
    NotTransferring(Room),
    /// A Pull call naming another transfer backend than this node's.
    #[error("{0}")]
    BackendMismatch(String),
    /// Sending pulled pages failed.
    #[error("{0}")]
    PullFailed(String),
    /// The room let its held pages go while a pull sent them.
    #[error("room {0} let its held pages go while they were sent")]
    PullSpoiled(Room),
    /// Something failed inside the worker (`reason`: `engine_error`, `constraint_failed`,
    /// `fork_pages`, `kv_copy`, `kv_mirror`).
    #[error("{message}")]
    Internal {
        /// Stable reason.
        reason: &'static str,
        /// What failed.
        message: String,
    },
}

impl DecodeError {
    /// [`DecodeError::Invalid`].
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid { reason, message: message.into() }
    }

    /// [`DecodeError::Internal`].
    pub fn internal(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Internal { reason, message: message.into() }
    }

    /// Whether the caller (or the router for it) ended it, not a fault.
    pub fn is_abort(&self) -> bool {
        matches!(self, Self::Aborted(_) | Self::ClientGone)
    }
}

impl From<ferry_cluster::wire::WireError> for DecodeError {
    fn from(e: ferry_cluster::wire::WireError) -> Self {
        Self::invalid("malformed", e.to_string())
    }
}
