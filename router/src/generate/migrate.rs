//! Migration: a stream whose decode worker fails after tokens went out moves to another
//! decode worker. The prompt and the tokens already streamed become the new request's
//! context, those tokens marked as its own output ([`SamplingParams::resumed`]: the sampler
//! stands where the undisturbed run's stood — penalties, output constraint, random stream),
//! and the client's stream goes on with the next token: no gap, no duplicate, no error.

use ferry_cluster::metrics as M;
use ferry_cluster::{RoomKey, WorkerId};
use ferry_tokenize::SamplingParams;
use tonic::{Code, Status};

use super::attempt::Attempt;
use super::{Ctx, Prepared};

/// Whether a decode stream ended by this status failed for its worker's sake (killed, cut
/// off, crashed, silent while out of placement), which another worker can make good: not a
/// refusal of the request itself, nor its output constraint's dead end (`INTERNAL` with
/// `ferry-reason: constraint_failed`), which a move would only compute again and meet again.
pub(super) fn worker_failed(s: &Status) -> bool {
    let reason = s.metadata().get(ferry_cluster::status::REASON).and_then(|v| v.to_str().ok());
    matches!(s.code(), Code::Unknown | Code::Unavailable | Code::Cancelled | Code::Internal)
        && reason != Some("constraint_failed")
}

impl Ctx {
    /// Continues `req`, whose stream had sent `generated`, on a decode worker not in `tried`:
    /// its first message once there (the calls retried as before the first token:
    /// [`Ctx::first_message`]). The context is computed by the prefill worker holding most
    /// of it, or on the decode worker when short (`--local-prefill-below`) or when no
    /// prefill worker is left.
    pub(super) async fn migrate(
        &self,
        req: &Prepared,
        generated: &[u32],
        tried: &[WorkerId],
    ) -> Result<Attempt, Status> {
        let left = req.sampling.max_new_tokens.saturating_sub(generated.len() as u32);
        let len = req.tokens.len() + generated.len();
        if left == 0 || len >= self.model.context_length {
            return Err(Status::unavailable("the stream had nothing left to generate when its decode worker failed"));
        }
        let mut tokens = Vec::with_capacity(len);
        tokens.extend_from_slice(&req.tokens);
        tokens.extend_from_slice(generated);
        let sampling = SamplingParams {
            resumed: generated.len() as u32,
            max_new_tokens: left,
            prompt_logprobs: None,
            ..req.sampling.clone()
        };
        let moved = Prepared { tokens, sampling, ..req.clone() };
        let need = self.pages_needed(len, &moved.sampling);
        let Some(decode) = self.other_decode(need, len, tried) else {
            return Err(Status::unavailable("no other decode worker can take the stream"));
        };
        metrics::counter!(M::ROUTER_DECODE_PLACEMENTS, "worker" => decode.id.clone()).increment(1);
        let prefill = if len >= self.local_prefill_below { self.fallback(&moved.tokens, &[]) } else { None };
        tracing::info!(
            request = %req.request_id,
            to = %decode.id,
            prefill = prefill.as_ref().map_or("decode-local", |w| w.id.as_str()),
            generated = generated.len(),
            "moving the stream to another decode worker"
        );
        self.first_message(&moved, RoomKey::random(), prefill, decode, false).await
    }
}

/// Counts a failed stream's fate ([`M::ROUTER_MIGRATIONS`]).
pub(super) fn count(outcome: &'static str) {
    metrics::counter!(M::ROUTER_MIGRATIONS, "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker gone moves the stream; the request's own failures do not.
    #[test]
    fn only_a_workers_failure_moves_a_stream() {
        let with_reason =
            |code, reason: &'static str| ferry_cluster::status::Refused::new(code, reason, "why").into_status();
        assert!(worker_failed(&Status::unavailable("transport error")));
        assert!(worker_failed(&Status::unknown("h2 protocol error")));
        assert!(worker_failed(&with_reason(Code::Unavailable, "shutting_down")));
        assert!(worker_failed(&with_reason(Code::Internal, "engine_error")));
        assert!(!worker_failed(&with_reason(Code::Internal, "constraint_failed")));
        assert!(!worker_failed(&with_reason(Code::InvalidArgument, "invalid_request")));
        assert!(!worker_failed(&Status::resource_exhausted("no room")));
    }
}
