//! Where a request's time goes: each daemon splits its part of every request into phases and
//! records each in `ferry_request_phase_seconds{role, phase}` (a histogram), so an operator
//! can tell queueing from compute from transfer.
//!
//! | role | phase | from → to |
//! |---|---|---|
//! | router | `tokenize` | body received → parsed and tokenized (OpenAI API) |
//! | router | `queue` | admission asked → a slot given |
//! | router | `placement` | slot given → workers chosen (prefix match, load, provisional insert) |
//! | router | `first_token` | workers chosen → first token streamed (all of prefill, transfer, decode admission) |
//! | router | `decode` | first token → last token |
//! | prefill | `prefill_queue` | request and handshake both here → first chunk scheduled |
//! | prefill | `prefill_compute` | first chunk scheduled → last chunk computed |
//! | prefill | `transfer` | last chunk computed → every page acknowledged |
//! | decode | `admission` | request accepted (or retracted) → its pages allocated |
//! | decode | `transfer` | pages allocated → the prompt's KV arrived |
//! | decode | `local_prefill` | pages allocated → the prompt computed here |
//! | decode | `first_token` | KV complete → first token emitted |
//! | decode | `decode` | first token → the request ends |
//!
//! A request retracted on the decode node records its decoding up to the retraction as one
//! `decode`, its wait for pages again as another `admission`, and the rest as a last
//! `decode`.

use std::time::Instant;

/// A request's clock on one daemon: each [`lap`](Self::lap) records the time since the
/// previous boundary as one phase.
#[derive(Debug, Clone, Copy)]
pub struct PhaseClock {
    role: &'static str,
    at: Instant,
}

impl PhaseClock {
    /// A clock for `role` whose first phase starts at `now`.
    pub fn start(role: &'static str, now: Instant) -> Self {
        Self { role, at: now }
    }

    /// Records `phase` as lasting from the last boundary to `now`, and starts the next one.
    pub fn lap(&mut self, phase: &'static str, now: Instant) {
        let d = now.saturating_duration_since(self.at);
        metrics::histogram!(crate::metrics::REQUEST_PHASE, "role" => self.role, "phase" => phase)
            .record(d.as_secs_f64());
        self.at = now;
    }
}
