//! Errors as gRPC statuses: one place decides the code each failure gets, and counts the
//! refusals of bad input by reason.

use tonic::{Code, Status};

use crate::wire::WireError;

/// The gRPC metadata key carrying a refusal's stable reason (`request_over_pool`,
/// `room_closing`, ...): the router passes a worker's on to its clients.
pub const REASON: &str = "ferry-reason";

/// A refused call: its gRPC code, a metrics reason label and the message for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refused {
    /// The gRPC code.
    pub code: Code,
    /// Stable label for `ferry_bad_requests_total`.
    pub reason: &'static str,
    /// For the client.
    pub message: String,
}

impl Refused {
    /// A refusal.
    pub fn new(code: Code, reason: &'static str, message: impl Into<String>) -> Self {
        Self { code, reason, message: message.into() }
    }

    /// `INVALID_ARGUMENT`.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, reason, message)
    }

    /// Counts the refusal for `role` and turns it into a status.
    pub fn status(self, role: &'static str) -> Status {
        metrics::counter!(crate::metrics::BAD_REQUESTS, "role" => role, "reason" => self.reason).increment(1);
        tracing::info!(role, reason = self.reason, message = %self.message, "refused");
        self.into_status()
    }

    /// The status, its reason in the `ferry-reason` metadata (not counted: for failures that
    /// are not the caller's fault, such as a transfer that broke).
    pub fn into_status(self) -> Status {
        let mut s = Status::new(self.code, self.message);
        s.metadata_mut().insert(REASON, tonic::metadata::MetadataValue::from_static(self.reason));
        s
    }
}

impl From<WireError> for Refused {
    fn from(e: WireError) -> Self {
        Self::invalid("malformed", e.to_string())
    }
}
