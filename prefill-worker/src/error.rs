//! Every way a prefill call or room fails, as one type: the engine, its tasks and the handlers
//! say what happened; `service.rs` alone decides the gRPC code and the stable reason
//! (`ferry-reason`) each failure gets (`impl From<PrefillError> for Refused`).

use std::time::Duration;

use ferry_cluster::Room;
use ferry_transfer::room::FailReason;

use crate::rooms::Refusal;

/// Why a prefill call or room failed. Its `Display` is what the caller reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefillError {
    /// A request the worker cannot take as asked (`reason`: `malformed`, `prompt_too_long`,
    /// `invalid_request`, `dest_pages_mismatch`, `oversize_page_list`).
    #[error("{message}")]
    Invalid {
        /// Stable reason.
        reason: &'static str,
        /// What was wrong.
        message: String,
    },
    /// The rooms refused the request or handshake.
    #[error("{}", .why.message(*.room))]
    Refused {
        /// Why.
        why: Refusal,
        /// Its room.
        room: Room,
    },
    /// The prompt needs more pages than the pool has.
    #[error("the prompt needs {pages} pages; this worker's pool has {pool}")]
    PromptOverPool {
        /// Pages it needs.
        pages: usize,
        /// Pages in the pool.
        pool: usize,
    },
    /// The decode node's handshake names another KV layout.
    #[error("{0}")]
    LayoutMismatch(String),
    /// The decode node speaks another transfer backend.
    #[error("{0}")]
    BackendMismatch(String),
    /// The decode node's data endpoint could not be reached.
    #[error("{0}")]
    DataPlaneUnreachable(String),
    /// An Abort call ended it.
    #[error("aborted: {0}")]
    Aborted(String),
    /// The worker stops.
    #[error("the worker is shutting down")]
    ShuttingDown,
    /// It waited past its phase's timeout (the phase's label).
    #[error("room timed out in {0}")]
    Timeout(&'static str),
    /// Its pages did not all reach the decode node.
    #[error("transfer failed: {0}")]
    TransferFailed(TaskError),
    /// The room closed early (why, as its caller was told) before its pages were all sent.
    #[error("{0}")]
    Closed(String),
    /// Something failed inside the worker (`reason`: `engine_error`, `room_state`).
    #[error("{message}")]
    Internal {
        /// Stable reason.
        reason: &'static str,
        /// What failed.
        message: String,
    },
}

impl PrefillError {
    /// [`PrefillError::Invalid`].
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid { reason, message: message.into() }
    }
}

impl From<ferry_cluster::wire::WireError> for PrefillError {
    fn from(e: ferry_cluster::wire::WireError) -> Self {
        Self::invalid("malformed", e.to_string())
    }
}

/// How a room's task ended before its last chunk was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskError {
    /// The engine dropped the room (it failed or was aborted here).
    #[error("abandoned")]
    Abandoned,
    /// A send failed.
    #[error("{0:?}")]
    Send(FailReason),
    /// A chunk made no progress within the transfer timeout.
    #[error("no progress for {0:?}")]
    Stalled(Duration),
}

/// Why a pull of held pages failed (the prompt is then computed whole).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullError {
    /// The decode node's address is not one.
    #[error("pull address {from:?}: {why}")]
    Address {
        /// The address.
        from: String,
        /// Why.
        why: String,
    },
    /// The decode node refused or failed the pull.
    #[error("{from}: {message}")]
    Refused {
        /// The decode node.
        from: String,
        /// Its status's message.
        message: String,
    },
    /// The pages' room failed on the way.
    #[error("{0:?}")]
    Transfer(FailReason),
    /// The pull receiver dropped the room.
    #[error("the pull receiver dropped the room")]
    Dropped,
    /// Another room of this id is still open on the pull receiver.
    #[error("the pull receiver refused the room: {}", .0.label())]
    ReceiverRefused(ferry_transfer::table::Refusal),
    /// No pull within the transfer timeout.
    #[error("no pull within {0:?}")]
    Timeout(Duration),
    /// Copying the pulled pages onto the device failed.
    #[error("{0}")]
    Copy(String),
}
