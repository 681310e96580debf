//! The router's errors, by what went wrong rather than by protocol: the core (admission,
//! validation, placement, the calls to workers) returns a [`RouterError`]; the gRPC service
//! maps it to a status once ([`RouterError::status`]) and the OpenAI API to an HTTP response
//! once ([`RouterError::http`]). Every kind has a stable reason name, sent to clients (gRPC
//! metadata `ferry-reason`, the OpenAI error's `code`) and used as a metrics label.

use std::time::Duration;

use tonic::{Code, Status};

pub use ferry_cluster::status::REASON;
/// The gRPC metadata key carrying how long to wait before retrying, in milliseconds.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// Why the router did not serve a request (or stopped serving it).
#[derive(Debug, Clone, thiserror::Error)]
pub enum RouterError {
    /// The request itself is wrong; the message names the field.
    #[error("{message}")]
    Invalid {
        /// Stable reason.
        reason: &'static str,
        /// For the client.
        message: String,
    },
    /// No capacity now (admission queue full or timed out, no decode pool with room): retry
    /// after the hint.
    #[error("{message}")]
    Busy {
        /// Stable reason.
        reason: &'static str,
        /// For the client.
        message: String,
        /// When a retry may succeed.
        retry_after: Duration,
    },
    /// The request can never be served here (no decode pool could hold it even empty).
    #[error("{message}")]
    TooLarge {
        /// For the client.
        message: String,
    },
    /// The router is stopping.
    #[error("the router is stopping")]
    Stopping,
    /// A worker refused or failed the request before it produced output; its status as it
    /// came (and its reason, when it sent one).
    #[error("{}", .status.message())]
    Worker {
        /// The worker's status.
        status: Status,
    },
    /// The decode worker failed after some tokens were sent: the answer is incomplete.
    #[error("decode worker {worker} failed after {sent} tokens ({cause}); retry the request")]
    MidStream {
        /// The worker.
        worker: String,
        /// Tokens sent before the failure.
        sent: u32,
        /// What it said.
        cause: String,
    },
    /// A broken promise inside Ferry (a stream that ended without a finish reason).
    #[error("{0}")]
    Internal(String),
}

impl From<Status> for RouterError {
    fn from(status: Status) -> Self {
        Self::Worker { status }
    }
}

impl RouterError {
    /// A request at fault.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid { reason, message: message.into() }
    }

    /// The stable reason name.
    pub fn reason(&self) -> &str {
        match self {
            Self::Invalid { reason, .. } | Self::Busy { reason, .. } => reason,
            Self::TooLarge { .. } => "request_over_pool",
            Self::Stopping => "stopping",
            Self::Worker { status } => status
                .metadata()
                .get(REASON)
                .and_then(|v| v.to_str().ok())
                .filter(|r| !r.is_empty() && r.len() <= 64)
                .unwrap_or(worker_reason(status.code())),
            Self::MidStream { .. } => "worker_failed_mid_stream",
            Self::Internal(_) => "internal",
        }
    }

    /// The gRPC status: the code by kind, the reason in `ferry-reason`, a retry hint in
    /// `retry-after-ms`.
    pub fn status(&self) -> Status {
        let code = match self {
            Self::Invalid { .. } => Code::InvalidArgument,
            Self::Busy { .. } => Code::ResourceExhausted,
            Self::TooLarge { .. } => Code::OutOfRange,
            Self::Stopping | Self::MidStream { .. } => Code::Unavailable,
            Self::Worker { status } => status.code(),
            Self::Internal(_) => Code::Internal,
        };
        let mut s = Status::new(code, self.to_string());
        if let Ok(v) = self.reason().parse() {
            s.metadata_mut().insert(REASON, v);
        }
        if let Some(ms) = self.retry_after().map(|d| d.as_millis().to_string())
            && let Ok(v) = ms.parse()
        {
            s.metadata_mut().insert(RETRY_AFTER_MS, v);
        }
        s
    }

    /// When a retry may succeed, for refusals that say.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Busy { retry_after, .. } => Some(*retry_after),
            Self::Worker { status } if status.code() == Code::ResourceExhausted => {
                let ms = status.metadata().get(RETRY_AFTER_MS)?.to_str().ok()?.parse().ok()?;
                Some(Duration::from_millis(ms))
            }
            _ => None,
        }
    }

    /// The HTTP status and the OpenAI error `type` for the OpenAI API.
    pub fn http(&self) -> (u16, &'static str) {
        let code = match self {
            Self::Invalid { .. } | Self::TooLarge { .. } => 400,
            Self::Busy { .. } => 429,
            Self::Stopping | Self::MidStream { .. } => 503,
            Self::Internal(_) => 500,
            Self::Worker { status } => match status.code() {
                Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
                Code::ResourceExhausted => 429,
                Code::NotFound => 404,
                Code::DeadlineExceeded => 504,
                _ => 503,
            },
        };
        let kind = match code {
            400 | 404 => "invalid_request_error",
            429 => "rate_limit_error",
            500 => "internal_error",
            _ => "service_unavailable_error",
        };
        (code, kind)
    }
}

/// A worker status's reason when the worker sent none.
fn worker_reason(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => "worker_refused",
        Code::ResourceExhausted => "worker_busy",
        Code::DeadlineExceeded => "worker_timeout",
        Code::Cancelled | Code::Aborted => "worker_aborted",
        _ => "worker_unavailable",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind maps once to gRPC and once to HTTP, with its reason on both.
    #[test]
    fn every_kind_has_one_grpc_and_one_http_mapping() {
        let cases: Vec<(RouterError, Code, u16, &str)> = vec![
            (RouterError::invalid("bad_stop", "`stop` has 40 strings"), Code::InvalidArgument, 400, "bad_stop"),
            (
                RouterError::Busy {
                    reason: "queue_full",
                    message: "full".into(),
                    retry_after: Duration::from_millis(1500),
                },
                Code::ResourceExhausted,
                429,
                "queue_full",
            ),
            (RouterError::TooLarge { message: "too big".into() }, Code::OutOfRange, 400, "request_over_pool"),
            (RouterError::Stopping, Code::Unavailable, 503, "stopping"),
            (
                RouterError::MidStream { worker: "d0".into(), sent: 3, cause: "reset".into() },
                Code::Unavailable,
                503,
                "worker_failed_mid_stream",
            ),
            (RouterError::Internal("no finish".into()), Code::Internal, 500, "internal"),
            (Status::deadline_exceeded("slow").into(), Code::DeadlineExceeded, 504, "worker_timeout"),
        ];
        for (e, code, http, reason) in cases {
            let s = e.status();
            assert_eq!((s.code(), e.http().0, e.reason()), (code, http, reason), "{e:?}");
            assert_eq!(s.metadata().get(REASON).and_then(|v| v.to_str().ok()), Some(reason), "{e:?}");
            assert_eq!(s.message(), e.to_string());
        }
        let busy =
            RouterError::Busy { reason: "no_decode_room", message: "x".into(), retry_after: Duration::from_secs(2) };
        assert_eq!(busy.status().metadata().get(RETRY_AFTER_MS).and_then(|v| v.to_str().ok()), Some("2000"));
    }

    /// A worker's refusal keeps its reason through the router: the client sees why.
    #[test]
    fn a_workers_reason_passes_through() {
        let mut s = Status::out_of_range("the prompt and max_tokens need 300 KV pages; this decode worker has 96");
        s.metadata_mut().insert(REASON, "request_over_pool".parse().expect("ascii"));
        let e = RouterError::from(s);
        assert_eq!((e.reason(), e.http().0), ("request_over_pool", 400));
        let mut busy = Status::resource_exhausted("no pages");
        busy.metadata_mut().insert(RETRY_AFTER_MS, "250".parse().expect("ascii"));
        assert_eq!(RouterError::from(busy).retry_after(), Some(Duration::from_millis(250)));
    }
}
