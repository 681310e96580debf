//! A request's output: the decode stream (after its first message) turned into text pieces —
//! detokenized incrementally, cut at stop strings — with usage and the request's phases on the
//! last piece.

use std::sync::Arc;
use std::time::Instant;

use ferry_cluster::metrics as M;
use ferry_cluster::phases::PhaseClock;
use ferry_cluster::{RequestId, RoomKey, WorkerId, wire};
use ferry_tokenize::FinishReason;
use futures::StreamExt;
use tonic::{Code, Status};

use super::attempt::{Attempt, PrefillTask};
use super::{Ctx, End, Piece, Prepared, Scored};
use crate::error::RouterError;
use crate::output::Output;
use crate::workers::Worker;

/// A decode stream that broke after tokens went out cannot be retried transparently: the
/// client gets a retriable `UNAVAILABLE` naming the worker (a lost connection otherwise shows
/// as an opaque transport error); the worker's own refusals keep their code.
fn mid_stream(s: Status, request: &RequestId, worker: &WorkerId, sent: u32) -> RouterError {
    if matches!(s.code(), Code::Unknown | Code::Unavailable | Code::Cancelled | Code::Internal) {
        tracing::warn!(request = %request, worker = %worker, error = %s, sent, "decode worker failed mid-stream");
        return RouterError::MidStream { worker: worker.to_string(), sent, cause: s.message().to_string() };
    }
    s.into()
}

impl Ctx {
    pub(super) async fn run(
        &self,
        req: Prepared,
        key: RoomKey,
        prefill: Option<(usize, Arc<Worker>, usize)>,
        decode: Arc<Worker>,
        (arrived, mut clock): (Instant, PhaseClock),
        tx: &tokio::sync::mpsc::Sender<Result<Piece, RouterError>>,
    ) -> Result<(), RouterError> {
        let cached_guess = prefill.as_ref().map_or(0, |p| p.2 as u32);
        let Attempt { mut stream, prefill: prefill_task, first, decode } =
            self.first_message(&req, key, prefill.map(|p| p.1), decode).await?;
        let mut out = Output::new(&self.model, &req.stop);
        let mut completion = 0u32;
        // When the last piece with tokens came (for the inter-token latency).
        let mut last_piece: Option<Instant> = None;
        let mut finish = None;
        let mut pending = first;
        // The prefill call's answer, when taken before the end (for the first token's top
        // alternatives).
        let mut prefilled = None;
        let mut prefill_task = Some(prefill_task);
        // The decode worker's phases, from its last message.
        let mut decode_phases = Vec::new();
        let abort = |t: &Option<PrefillTask>| {
            if let Some(t) = t {
                t.abort();
            }
        };
        loop {
            let msg = match pending.take() {
                Some(m) => m,
                None => stream.next().await,
            };
            let Some(msg) = msg else { break };
            let msg = match msg {
                Ok(m) => m,
                Err(s) => {
                    abort(&prefill_task);
                    return Err(mid_stream(s, &req.request_id, &decode.id, completion));
                }
            };
            if !msg.phases.is_empty() {
                decode_phases = wire::phases_from_proto(&msg.phases);
            }
            let mut tops: Vec<Vec<(u32, f32)>> = msg.top_logprobs.iter().map(wire::top_from_proto).collect();
            // Prompt logprobs come with the first token when the decode worker computed the
            // prompt, else with the prefill call's answer.
            let mut prompt = scored(&msg.prompt_logprobs, &msg.prompt_top_logprobs);
            let want_prompt = req.sampling.prompt_logprobs.is_some() && prompt.is_empty();
            if completion == 0
                && (req.sampling.top_logprobs > 0 && tops.is_empty() || want_prompt)
                && let Some(task) = prefill_task.take()
            {
                // Prefilled elsewhere: the first token's alternatives come with the prefill
                // call's answer, which is due about now (the pages have arrived).
                let r = task.await.unwrap_or_else(|e| Err(Status::internal(e.to_string())));
                if let Ok(Some(p)) = &r {
                    if req.sampling.top_logprobs > 0 && tops.is_empty() {
                        tops = vec![p.first_top.clone()];
                    }
                    if want_prompt {
                        prompt = p.prompt.clone();
                    }
                }
                prefilled = Some(r);
            }
            // Asked for, they must all be there: an answer without them (a failed prefill
            // call, an older worker) would pair the echoed prompt with the wrong logprobs.
            if completion == 0 && req.sampling.prompt_logprobs.is_some() && prompt.len() + 1 != req.tokens.len() {
                abort(&prefill_task);
                return Err(RouterError::Internal(format!(
                    "the workers returned {} prompt logprobs for {} prompt tokens",
                    prompt.len(),
                    req.tokens.len()
                )));
            }
            if !msg.token_ids.is_empty() {
                let now = Instant::now();
                match last_piece {
                    None => {
                        metrics::histogram!(M::ROUTER_TTFT).record(now.duration_since(arrived).as_secs_f64());
                        clock.lap("first_token", now);
                    }
                    Some(t) => metrics::histogram!(M::ROUTER_ITL).record(now.duration_since(t).as_secs_f64()),
                }
                last_piece = Some(now);
            }
            completion += msg.token_ids.len() as u32;
            let lps: Vec<Scored> = msg
                .logprobs
                .iter()
                .enumerate()
                .map(|(i, l)| Scored {
                    id: l.token_id,
                    logprob: l.logprob,
                    top: tops.get(i).cloned().unwrap_or_default(),
                })
                .collect();
            let (text, stopped) = out.push(&msg.token_ids);
            let end = wire::finish_from_proto(msg.finish_reason()).or(stopped.then_some(FinishReason::Stop));
            if tx.send(Ok(Piece { text, tokens: lps, prompt, end: None })).await.is_err() {
                abort(&prefill_task);
                metrics::counter!(M::ROUTER_REQUESTS, "outcome" => "cancelled").increment(1);
                return Ok(()); // the client went away: dropping the calls frees both workers
            }
            if end.is_some() {
                finish = end;
                break;
            }
        }
        drop(stream);
        let prefilled = match (prefilled, prefill_task) {
            (Some(r), _) => Ok(r),
            (None, Some(t)) => t.await,
            (None, None) => Ok(Ok(None)),
        };
        let (cached, prefill_phases) = match prefilled {
            Ok(Ok(c)) => c.map_or((0, Vec::new()), |p| (p.cached, p.phases)),
            Ok(Err(s)) if finish.is_none() => return Err(s.into()),
            _ => (cached_guess, Vec::new()),
        };
        let finish =
            finish.ok_or_else(|| RouterError::Internal("the decode stream ended without a finish reason".into()))?;
        let tail = out.flush();
        clock.lap("decode", Instant::now());
        let end = End {
            finish,
            prompt_tokens: req.tokens.len() as u32,
            completion_tokens: completion,
            cached_tokens: cached,
            phases: ferry_cluster::phases::breakdown(clock.laps(), &prefill_phases, &decode_phases),
        };
        metrics::counter!(M::ROUTER_REQUESTS, "outcome" => finish.as_str()).increment(1);
        metrics::counter!(M::ROUTER_PROMPT_TOKENS, "kind" => "prompt").increment(u64::from(end.prompt_tokens));
        metrics::counter!(M::ROUTER_PROMPT_TOKENS, "kind" => "cached").increment(u64::from(end.cached_tokens));
        let _ = tx.send(Ok(Piece { text: tail, tokens: Vec::new(), prompt: Vec::new(), end: Some(end) })).await;
        Ok(())
    }
}

/// Prompt logprobs from the wire.
pub(super) fn scored(lp: &[ferry_proto::v1::TokenLogprob], top: &[ferry_proto::v1::TopLogprobs]) -> Vec<super::Scored> {
    wire::prompt_from_proto(lp, top).into_iter().map(|(id, logprob, top)| super::Scored { id, logprob, top }).collect()
}
