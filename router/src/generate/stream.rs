//! A request's output: the decode stream (after its first message) turned into text pieces —
//! detokenized incrementally, cut at stop strings — with usage and the request's phases on the
//! last piece.

use std::time::{Duration, Instant};

use ferry_cluster::metrics as M;
use ferry_cluster::phases::PhaseClock;
use ferry_cluster::{RequestId, RoomKey, WorkerId, wire};
use ferry_tokenize::FinishReason;
use futures::StreamExt;
use tonic::{Code, Status};

use super::attempt::{Attempt, PrefillTask};
use super::migrate::{self, worker_failed};
use super::{Chosen, Ctx, End, Piece, Prepared, Scored};
use crate::error::RouterError;
use crate::output::Output;
use crate::workers::{Placed, Worker};

/// A decode stream that broke after tokens went out and could not move to another worker
/// ([`super::migrate`]): the client gets a retriable `UNAVAILABLE` naming the worker (a lost
/// connection otherwise shows as an opaque transport error); the worker's own refusals keep
/// their code.
fn mid_stream(s: Status, request: &RequestId, worker: &WorkerId, sent: u32) -> RouterError {
    if matches!(s.code(), Code::Unknown | Code::Unavailable | Code::Cancelled | Code::Internal) {
        tracing::warn!(request = %request, worker = %worker, error = %s, sent, "decode worker failed mid-stream");
        return RouterError::MidStream { worker: worker.to_string(), sent, cause: s.message().to_string() };
    }
    s.into()
}

/// How long a decode stream may send nothing, once its worker is out of placement or gone
/// from the registry, before the router asks whether the worker answers at all.
const SILENT_WHILE_OUT: Duration = Duration::from_secs(1);

/// The stream's next message — or `UNAVAILABLE` when its worker `w` is out of placement (its
/// circuit opened) or left the registry, the stream has sent nothing since `last` for
/// [`SILENT_WHILE_OUT`], and the worker does not answer a health check within a second
/// ([`Worker::answers`]). A frozen process keeps its connections up: without this a stream
/// that had sent tokens waited on the HTTP/2 pings (~8 s), or for ever on a process that
/// answers pings but not its calls. A worker that answers — draining on its way out (it says
/// NOT_SERVING and leaves, then finishes its requests, some of which may wait there a while),
/// or busy — keeps its streams, as does one whose stream still sends.
async fn next_unless_silent_while_out<S, M>(s: &mut S, w: &Worker, last: Instant) -> Option<Result<M, Status>>
where
    S: futures::Stream<Item = Result<M, Status>> + Unpin,
{
    loop {
        let out = w.taken_out();
        if w.out_of_service() {
            let until = tokio::time::Instant::from_std(last + SILENT_WHILE_OUT);
            if let Ok(m) = tokio::time::timeout_at(until, s.next()).await {
                return m;
            }
            tokio::select! {
                biased;
                m = s.next() => return m,
                alive = w.answers() => if !alive {
                    return Some(Err(Status::unavailable(format!(
                        "decode worker {} is out of placement, sent nothing for {} ms and does not answer",
                        w.id,
                        last.elapsed().as_millis()
                    ))));
                },
            }
        }
        // Answering, or in service: the stream, or the next time the worker is taken out.
        tokio::select! {
            biased;
            m = s.next() => return m,
            () = out => {}
        }
    }
}

/// One sequence of a request (`n` > 1 makes several, their messages interleaved).
struct Seq<'a> {
    out: Output<'a>,
    /// Tokens it generated.
    completion: u32,
    /// Their ids (a migrated stream's context; kept for `n` = 1 only).
    tokens: Vec<u32>,
    /// When its last piece with tokens went (inter-token latency).
    last_piece: Option<Instant>,
    /// Why it ended, once it has.
    finish: Option<FinishReason>,
}

impl Ctx {
    pub(super) async fn run(
        &self,
        req: Prepared,
        key: RoomKey,
        (prefill, pull): (Option<Chosen>, bool),
        decode: Placed,
        (arrived, mut clock): (Instant, PhaseClock),
        tx: &tokio::sync::mpsc::Sender<Result<Piece, RouterError>>,
    ) -> Result<(), RouterError> {
        let cached_guess = prefill.as_ref().map_or(0, |c| c.held as u32);
        let (prefill, computing) = prefill.map(|c| (c.worker, c.computing)).unzip();
        let Attempt { stream, prefill: prefill_task, first, mut decode, placed: mut _placed, mut key } =
            self.first_message(&req, key, prefill, decode, pull).await?;
        // The prompt is computed (or its prefill call failed and another computed it).
        drop(computing);
        // Dropped once every sequence has ended (a stop string found here leaves the worker
        // generating until it hears).
        let mut stream = Some(stream);
        let n = req.sampling.n.max(1) as usize;
        let mut seqs: Vec<Seq<'_>> = (0..n)
            .map(|_| Seq {
                out: Output::new(&self.model, &req.stop),
                completion: 0,
                tokens: Vec::new(),
                last_piece: None,
                finish: None,
            })
            .collect();
        let mut ended = 0;
        let mut first_token = true;
        let mut pending = first;
        // The prefill call's answer, once taken (for the first token's top alternatives, the
        // prompt's logprobs, the cached tokens and the phases).
        let mut prefilled = None;
        let mut prefill_task = Some(prefill_task);
        // The decode worker's phases, from the last message that carried them.
        let mut decode_phases = Vec::new();
        // Prompt tokens the decode worker found cached (a prompt prefilled there).
        let mut decode_cached = 0;
        let abort = |t: &Option<PrefillTask>| {
            if let Some(t) = t {
                t.abort();
            }
        };
        let mut last_message = Instant::now();
        // Decode workers this request's stream has failed on, and the prefill call of the
        // attempt it moved to, while its first token's alternatives may still be wanted.
        let (mut failed_on, mut moved_prefill): (Vec<WorkerId>, Option<PrefillTask>) = (Vec::new(), None);
        while ended < n {
            let msg = match (pending.take(), stream.as_mut()) {
                (Some(m), _) => m,
                (None, Some(s)) => next_unless_silent_while_out(s, &decode, last_message).await,
                (None, None) => None,
            };
            last_message = Instant::now();
            let Some(msg) = msg else {
                abort(&prefill_task);
                return Err(RouterError::Internal("the decode stream ended without a finish reason".into()));
            };
            let msg = match msg {
                Ok(m) => m,
                Err(s) => {
                    let sent = seqs.iter().map(|s| s.completion).sum();
                    let outcome = if !worker_failed(&s) {
                        None
                    } else if n > 1 {
                        Some("unsupported")
                    } else if failed_on.len() >= self.migration_limit as usize {
                        Some("limit")
                    } else {
                        tracing::warn!(request = %req.request_id, worker = %decode.id, error = %s, sent, "decode worker failed mid-stream; moving the stream");
                        failed_on.push(decode.id.clone());
                        // The prefill call is done (the first token needed its pages): its
                        // answer is the request's (cached tokens, phases, alternatives).
                        if prefilled.is_none()
                            && let Some(t) = prefill_task.take()
                        {
                            let r = tokio::time::timeout(Duration::from_secs(1), t).await;
                            prefilled = Some(r.map_or_else(
                                |_| Err(Status::deadline_exceeded("prefill call")),
                                |r| r.unwrap_or_else(|e| Err(Status::internal(e.to_string()))),
                            ));
                        }
                        match self.migrate(&req, &seqs[0].tokens, &failed_on).await {
                            Ok(a) => {
                                migrate::count("resumed");
                                (stream, pending, decode, _placed, key) =
                                    (Some(a.stream), a.first, a.decode, a.placed, a.key);
                                moved_prefill = Some(a.prefill);
                                continue;
                            }
                            Err(e) => {
                                tracing::warn!(request = %req.request_id, error = %e, "the stream could not move");
                                Some("failed")
                            }
                        }
                    };
                    if let Some(outcome) = outcome {
                        migrate::count(outcome);
                    }
                    abort(&prefill_task);
                    return Err(mid_stream(s, &req.request_id, &decode.id, sent));
                }
            };
            let index = msg.index as usize;
            let Some(seq) = seqs.get_mut(index) else {
                abort(&prefill_task);
                return Err(RouterError::Internal(format!("the decode worker sent sequence {index} of {n}")));
            };
            if seq.finish.is_some() {
                continue; // ended here by a stop string; the worker's abort is on its way
            }
            if !msg.phases.is_empty() {
                decode_phases = wire::phases_from_proto(&msg.phases);
            }
            let mut tops: Vec<Vec<(u32, f32)>> = msg.top_logprobs.iter().map(wire::top_from_proto).collect();
            // Prompt logprobs come with sequence 0's first token when the decode worker
            // computed the prompt, else with the prefill call's answer.
            let mut prompt = scored(&msg.prompt_logprobs, &msg.prompt_top_logprobs);
            let opening = seq.completion == 0 && index == 0;
            if opening {
                // Prefilled on the decode worker: what its prefix cache held.
                decode_cached = msg.cached_tokens;
            }
            // A moved stream's first token, prefilled elsewhere: its alternatives come with
            // the new prefill call's answer.
            if req.sampling.top_logprobs > 0
                && tops.is_empty()
                && !msg.token_ids.is_empty()
                && let Some(task) = moved_prefill.take()
                && let Ok(Ok(Some(p))) = task.await
            {
                tops = vec![p.first_top];
            }
            let want_prompt = req.sampling.prompt_logprobs.is_some() && prompt.is_empty();
            if opening
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
            if opening && req.sampling.prompt_logprobs.is_some() && prompt.len() + 1 != req.tokens.len() {
                abort(&prefill_task);
                return Err(RouterError::Internal(format!(
                    "the workers returned {} prompt logprobs for {} prompt tokens",
                    prompt.len(),
                    req.tokens.len()
                )));
            }
            if !msg.token_ids.is_empty() {
                let now = Instant::now();
                if std::mem::take(&mut first_token) {
                    metrics::histogram!(M::ROUTER_TTFT).record(now.duration_since(arrived).as_secs_f64());
                    clock.lap("first_token", now);
                } else if let Some(t) = seq.last_piece {
                    metrics::histogram!(M::ROUTER_ITL).record(now.duration_since(t).as_secs_f64());
                }
                seq.last_piece = Some(now);
            }
            seq.completion += msg.token_ids.len() as u32;
            if n == 1 {
                seq.tokens.extend_from_slice(&msg.token_ids);
            }
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
            let (text, stopped) = seq.out.push(&msg.token_ids);
            let end = wire::finish_from_proto(msg.finish_reason()).or(stopped.then_some(FinishReason::Stop));
            let piece = Piece { index: msg.index, text, tokens: lps, prompt, end: None };
            if tx.send(Ok(piece)).await.is_err() {
                abort(&prefill_task);
                metrics::counter!(M::ROUTER_REQUESTS, "outcome" => "cancelled").increment(1);
                return Ok(()); // the client went away: dropping the calls frees both workers
            }
            let Some(finish) = end else { continue };
            seq.finish = Some(finish);
            ended += 1;
            let tail = seq.out.flush();
            let completion_tokens = seq.completion;
            let last = ended == n;
            if last {
                stream = None;
            } else if stopped && wire::finish_from_proto(msg.finish_reason()).is_none() {
                // A stop string ended this sequence; the others go on: the worker stops it.
                stop_sequence(&decode, key, msg.index);
            }
            // The prefill call is done by now (the first token needed its pages).
            if prefilled.is_none() {
                prefilled = Some(match prefill_task.take() {
                    Some(t) => t.await.unwrap_or_else(|e| Err(Status::internal(e.to_string()))),
                    None => Ok(None),
                });
            }
            let (cached, prefill_phases) = match &prefilled {
                Some(Ok(Some(p))) => (p.cached, p.phases.clone()),
                Some(Ok(None)) => (decode_cached, Vec::new()),
                // A prefill call that failed once the decode worker had the pages cost nothing.
                _ => (cached_guess, Vec::new()),
            };
            if last {
                clock.lap("decode", Instant::now());
                metrics::counter!(M::ROUTER_REQUESTS, "outcome" => finish.as_str()).increment(1);
                metrics::counter!(M::ROUTER_PROMPT_TOKENS, "kind" => "prompt").increment(req.tokens.len() as u64);
                metrics::counter!(M::ROUTER_PROMPT_TOKENS, "kind" => "cached").increment(u64::from(cached));
            }
            let end = End {
                finish,
                prompt_tokens: req.tokens.len() as u32,
                completion_tokens,
                cached_tokens: cached,
                phases: ferry_cluster::phases::breakdown(clock.laps(), &prefill_phases, &decode_phases),
            };
            let piece = Piece { index: msg.index, text: tail, tokens: Vec::new(), prompt: Vec::new(), end: Some(end) };
            let _ = tx.send(Ok(piece)).await;
        }
        Ok(())
    }
}

/// Tells the decode worker to stop sequence `index` of the request in `key` (a stop string
/// ended it here while its other sequences go on). Best effort: a failed call leaves it
/// generating until its own end, its tokens dropped here.
fn stop_sequence(decode: &Worker, key: RoomKey, index: u32) {
    let mut dc = ferry_proto::v1::decode_client::DecodeClient::new(decode.channel.clone());
    let req = ferry_proto::v1::AbortRequest {
        room: Some(wire::room_key_to_proto(&key)),
        reason: "a stop string ended the sequence".into(),
        sequence: Some(index),
    };
    let worker = decode.id.clone();
    tokio::spawn(async move {
        if let Err(e) = dc.abort(req).await {
            tracing::debug!(worker = %worker, sequence = index, error = %e, "stopping a sequence failed");
        }
    });
}

/// Prompt logprobs from the wire.
pub(super) fn scored(lp: &[ferry_proto::v1::TokenLogprob], top: &[ferry_proto::v1::TopLogprobs]) -> Vec<super::Scored> {
    wire::prompt_from_proto(lp, top).into_iter().map(|(id, logprob, top)| super::Scored { id, logprob, top }).collect()
}
