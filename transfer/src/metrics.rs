//! Recording transfer figures through the `metrics` facade (names in `ferry_core::metrics`).
//! Without an installed recorder these calls cost next to nothing.

use std::time::Duration;

use ferry_core::metrics as names;

use crate::table::{Outcome, Refusal};

/// One chunk sent: its bytes, runs and how long it took.
pub fn chunk_sent(backend: &'static str, bytes: u64, runs: u64, took: Duration) {
    metrics::counter!(names::TRANSFER_BYTES, "backend" => backend).increment(bytes);
    metrics::counter!(names::TRANSFER_RUNS, "backend" => backend).increment(runs);
    metrics::histogram!(names::TRANSFER_CHUNK_SECONDS, "backend" => backend).record(took.as_secs_f64());
    let secs = took.as_secs_f64();
    if bytes > 0 && secs > 0.0 {
        metrics::gauge!(names::TRANSFER_THROUGHPUT, "backend" => backend).set(bytes as f64 / secs);
    }
}

/// Which end of a room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The prefill node.
    Sender,
    /// The decode node.
    Receiver,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Self::Sender => "sender",
            Self::Receiver => "receiver",
        }
    }
}

/// A room ended.
pub fn room_ended(backend: &'static str, side: Side, outcome: &Outcome) {
    let (outcome, reason) = match outcome {
        Outcome::Success(_) => ("success", "none"),
        Outcome::Failed(r) => ("failed", r.label()),
    };
    metrics::counter!(names::TRANSFER_ROOMS, "backend" => backend, "side" => side.label(), "outcome" => outcome,
        "reason" => reason)
    .increment(1);
}

/// A receiver refused a frame or a room.
pub fn refused(r: Refusal) {
    metrics::counter!(names::TRANSFER_REFUSALS, "reason" => r.label()).increment(1);
}

/// The backend chosen for this process.
pub fn backend_chosen(chosen: &'static str, requested: &'static str) {
    metrics::gauge!(names::TRANSFER_BACKEND, "backend" => chosen, "requested" => requested).set(1.0);
}

/// Data-plane connections served now.
pub fn connections(n: usize) {
    metrics::gauge!(names::TRANSFER_CONNECTIONS).set(n as f64);
}

/// A connection dropped at the cap (`at_cap`) or an accept that failed (`accept_error`).
pub fn connection_refused(reason: &'static str) {
    metrics::counter!(names::TRANSFER_CONNECTIONS_REFUSED, "reason" => reason).increment(1);
}
