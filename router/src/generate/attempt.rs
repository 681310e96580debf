//! One attempt at a request against a pair of workers, and the retries before its first
//! token: the decode call and the prefill call at once, the failed worker replaced by another
//! (or the prompt prefilled on the decode worker), each retry in a new room.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_cluster::metrics as M;
use ferry_cluster::{RoomKey, TraceContext, WorkerId, traces, wire};
use ferry_proto::v1 as pb;
use futures::StreamExt;
use tonic::{Code, Status};
use tracing::Instrument as _;

use super::packed::{self, PackedIds, WithIds};
use super::{Ctx, Prepared};
use crate::placement::DecodeState;
use crate::workers::{Placed, Worker};

/// The largest answer a worker may send in one message: a prompt's logprobs (`echo`) come in
/// one, about 230 bytes a token with 20 alternatives (gRPC's default 4 MiB held ~18k tokens).
const MAX_ANSWER: usize = 256 << 20;

/// What a prefill call answered.
#[derive(Debug, Clone, Default)]
pub(super) struct Prefilled {
    /// Prompt tokens it found cached.
    pub(super) cached: u32,
    /// The first token's top alternatives, when asked for (the decode stream carries the
    /// first token without them).
    pub(super) first_top: Vec<(u32, f32)>,
    /// The room's phases on the prefill worker.
    pub(super) phases: Vec<(String, f64)>,
    /// Prompt logprobs, when asked for.
    pub(super) prompt: Vec<super::Scored>,
}

/// The prefill call of one attempt (None: no prefill worker).
pub(super) struct PrefillTask(tokio::task::JoinHandle<Result<Option<Prefilled>, Status>>);

impl PrefillTask {
    fn spawn(f: impl std::future::Future<Output = Result<Option<Prefilled>, Status>> + Send + 'static) -> Self {
        Self(tokio::spawn(f))
    }

    /// Stops the call (dropping it does too).
    pub(super) fn abort(&self) {
        self.0.abort();
    }
}

impl std::future::Future for PrefillTask {
    type Output = Result<Result<Option<Prefilled>, Status>, tokio::task::JoinError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}

/// A request dropped (its client gone) drops its prefill call with it: the prefill worker
/// then ends the room instead of computing for nobody.
impl Drop for PrefillTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}
/// An attempt's first decode message: `Some(None)` when the stream ended without one, `None`
/// when the prefill finished first.
pub(super) type FirstMessage = Option<Option<Result<pb::DecodeResponse, Status>>>;

/// Retries of a request that failed before its first token.
const MAX_RETRIES: usize = 2;
/// How long a failed decode call waits for its prefill call to report a failure of its own
/// (then the prefill worker is blamed).
const BLAME_GRACE: Duration = Duration::from_millis(300);

/// Which worker failed an attempt.
#[derive(Debug, Clone, Copy)]
enum Stage {
    Prefill,
    Decode,
}

impl Stage {
    fn label(self) -> &'static str {
        match self {
            Stage::Prefill => "prefill",
            Stage::Decode => "decode",
        }
    }
}

/// One attempt under way: its calls, and its first decode message once taken.
pub(super) struct Attempt {
    /// The decode worker's stream.
    pub(super) stream: tonic::Streaming<pb::DecodeResponse>,
    /// The prefill call (its answer None: prefilled on the decode worker).
    pub(super) prefill: PrefillTask,
    /// The first decode message, when taken ([`FirstMessage`]).
    pub(super) first: FirstMessage,
    /// The decode worker it runs on.
    pub(super) decode: Arc<Worker>,
    /// The request counted on that worker while it streams (set once the attempt is the
    /// one that serves: [`Ctx::first_message`]).
    pub(super) placed: Option<Placed>,
    /// Its room.
    pub(super) key: RoomKey,
}

/// What a call waiting on a worker taken out of placement, or gone, ends with.
fn out_of_service(role: &str, w: &Worker) -> Status {
    Status::unavailable(format!(
        "{role} worker {} was taken out of placement (failed health checks) or left during the call",
        w.id
    ))
}

/// `call` to worker `w`, unless its health checks take it out of placement or it leaves
/// first ([`Worker::taken_out`]): a frozen process keeps its connections up, and only the
/// HTTP/2 pings would end the call, seconds later. The error says whether the worker answered
/// it (false: ended here, not to be counted against the worker again).
async fn unless_taken_out<T>(
    w: &Worker,
    role: &str,
    call: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, (Status, bool)> {
    let out = w.taken_out();
    if w.out_of_service() {
        return Err((out_of_service(role, w), false));
    }
    tokio::select! {
        biased;
        r = call => r.map_err(|s| (s, true)),
        () = out => Err((out_of_service(role, w), false)),
    }
}

/// Attempt `a` once its first decode message came (`first`), or its prefill call ended first
/// (its outcome put back); or the stage that failed it and why. A decode worker that stopped
/// answering holds its call until the HTTP/2 pings notice: its failed health checks, or its
/// leaving, end the attempt sooner.
async fn first_of(mut a: Attempt) -> Result<Attempt, (Stage, Status)> {
    let dw = Arc::clone(&a.decode);
    let out = dw.taken_out();
    if dw.out_of_service() {
        a.prefill.abort();
        return Err((Stage::Decode, out_of_service("decode", &dw)));
    }
    tokio::select! {
        biased;
        m = a.stream.next() => match m {
            Some(Err(s)) => match tokio::time::timeout(BLAME_GRACE, &mut a.prefill).await {
                // The decode worker failed because its prefill did: blame the prefill.
                Ok(Ok(Err(p))) => Err((Stage::Prefill, p)),
                _ => {
                    a.prefill.abort();
                    Err((Stage::Decode, s))
                }
            },
            m => Ok(Attempt { first: Some(m), ..a }),
        },
        r = &mut a.prefill => match r {
            Ok(Err(s)) => Err((Stage::Prefill, s)),
            other => {
                // Done: put the outcome back for the end of the request.
                let prefill = PrefillTask::spawn(async move {
                    other.unwrap_or_else(|e| Err(Status::internal(e.to_string())))
                });
                Ok(Attempt { prefill, ..a })
            }
        },
        () = out => {
            a.prefill.abort();
            Err((Stage::Decode, out_of_service("decode", &dw)))
        },
    }
}

/// Whether a failure before the first token is worth another attempt elsewhere: not when the
/// request itself is at fault.
fn retriable(code: Code) -> bool {
    !matches!(
        code,
        Code::InvalidArgument
            | Code::OutOfRange
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::Unimplemented
            | Code::FailedPrecondition
            | Code::NotFound
    )
}

impl Ctx {
    /// Starts one attempt: the decode call and, when `prefill` is given, the prefill call
    /// (allowed to pull what the decode worker holds when `pull`).
    async fn attempt(
        &self,
        req: &Prepared,
        key: RoomKey,
        prefill: Option<Arc<Worker>>,
        dw: &Arc<Worker>,
        pull: bool,
    ) -> Result<Attempt, Status> {
        tracing::Span::current().record("room", tracing::field::display(key.room));
        let sampling = Some(wire::sampling_to_proto(&req.sampling));
        let room = Some(wire::room_key_to_proto(&key));
        let pw = prefill;
        let dreq = pb::DecodeRequest {
            request_id: req.request_id.to_string(),
            room: room.clone(),
            prefill_bootstrap_addr: pw.as_ref().map(|w| w.addr.clone()).unwrap_or_default(),
            token_ids: Vec::new(),
            sampling: sampling.clone(),
        };
        let ids = PackedIds::new(&req.tokens);
        let dreq = WithIds::decode(dreq, ids.clone());
        let preq = pb::PrefillRequest {
            request_id: req.request_id.to_string(),
            room,
            token_ids: Vec::new(),
            sampling,
            priority: 0,
            pull_from: if pull { dw.addr.clone() } else { String::new() },
        };
        let preq = WithIds::prefill(preq, ids);
        let trace = req.trace.unwrap_or_else(TraceContext::random);
        let prefill_task = PrefillTask::spawn(
            async move {
                let Some(pw) = pw else { return Ok(None) };
                let call = packed::prefill(pw.calls.clone(), MAX_ANSWER, traces::request_with(preq, &trace));
                match unless_taken_out(&pw, "prefill", call).await {
                    Ok(r) => {
                        pw.ok();
                        let r = r.into_inner();
                        let first_top = r.first_top.as_ref().map_or_else(Vec::new, wire::top_from_proto);
                        let phases = wire::phases_from_proto(&r.phases);
                        let prompt = super::stream::scored(&r.prompt_logprobs, &r.prompt_top_logprobs);
                        Ok(Some(Prefilled { cached: r.cached_tokens, first_top, phases, prompt }))
                    }
                    Err((s, answered)) => {
                        if answered && s.code() == Code::Unavailable {
                            pw.failed();
                        }
                        Err(s)
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        let call = packed::generate(dw.calls.clone(), MAX_ANSWER, traces::request_with(dreq, &trace));
        match unless_taken_out(dw, "decode", call).await {
            Ok(s) => {
                dw.ok();
                Ok(Attempt {
                    stream: s.into_inner(),
                    prefill: prefill_task,
                    first: None,
                    decode: Arc::clone(dw),
                    placed: None,
                    key,
                })
            }
            Err((s, answered)) => {
                if answered && s.code() == Code::Unavailable {
                    dw.failed();
                }
                prefill_task.abort();
                Err(s)
            }
        }
    }

    /// Another healthy prefill worker than those in `tried`, the one holding most of the
    /// prompt; None: prefill on the decode worker.
    pub(super) fn fallback(&self, tokens: &[u32], tried: &[WorkerId]) -> Option<Arc<Worker>> {
        let snap = self.workers.snapshot();
        let cached = self.index.matched(&tokens[..tokens.len() - 1], snap.prefill.len());
        let open = snap.prefill.iter().enumerate().filter_map(|(s, w)| Some((s, w.as_ref()?)));
        open.filter(|(_, w)| !tried.contains(&w.id) && w.healthy())
            .max_by_key(|&(s, _)| (cached[s], std::cmp::Reverse(s)))
            .map(|(_, w)| Arc::clone(w))
    }

    /// The healthy decode worker, not among `tried`, where a request of `len` prompt tokens
    /// needing `need` pages costs least ([`crate::placement::Placer::decode`]; its cache
    /// not counted: the history was on the failed worker), counted there.
    pub(super) fn other_decode(&self, need: u64, len: usize, tried: &[WorkerId]) -> Option<Placed> {
        let snap = self.workers.snapshot();
        let states: Vec<DecodeState> =
            snap.decode.iter().map(|w| w.decode_state(Instant::now(), tried.contains(&w.id), 0)).collect();
        let d = self.placer.lock().decode(need, len, &states).ok()?;
        Some(snap.decode[d].placed())
    }

    /// Runs attempts until one produces its first message (or ends cleanly), retrying a
    /// failure before the first token on other workers: a failed prefill worker is replaced
    /// by another (or by prefilling on the decode worker), a failed decode worker by another
    /// decode worker. Each retry uses a new room; the failed attempt's calls are dropped, which
    /// frees its pages on both workers.
    pub(super) async fn first_message(
        &self,
        req: &Prepared,
        key: RoomKey,
        mut target: Option<Arc<Worker>>,
        mut decode: Placed,
        pull: bool,
    ) -> Result<Attempt, Status> {
        let need = self.pages_needed(req.tokens.len(), &req.sampling);
        let (mut key, mut tried_prefill, mut tried_decode) = (key, Vec::new(), Vec::new());
        for retry in 0..=MAX_RETRIES {
            let (stage, status) = match self.attempt(req, key, target.clone(), &decode, pull).await {
                Err(s) => (Stage::Decode, s),
                Ok(a) => match first_of(a).await {
                    Ok(mut a) => {
                        a.placed = Some(decode);
                        return Ok(a);
                    }
                    Err(failed) => failed,
                },
            };
            if retry == MAX_RETRIES || !retriable(status.code()) {
                if retriable(status.code()) {
                    tracing::warn!(request = %req.request_id, room = %key.room, error = %status, "no attempt left; failing the request");
                }
                return Err(status);
            }
            // The worker that failed: the prefill worker (or the decode worker prefilling
            // locally) or the decode worker.
            let failed_worker = match stage {
                Stage::Prefill => target.as_ref().map_or_else(|| decode.id.to_string(), |w| w.id.to_string()),
                Stage::Decode => decode.id.to_string(),
            };
            metrics::counter!(M::ROUTER_RETRIES, "stage" => stage.label(), "worker" => failed_worker).increment(1);
            match stage {
                Stage::Prefill => {
                    let failed = target.as_ref().map(|w| w.id.clone());
                    tracing::warn!(request = %req.request_id, room = %key.room, worker = failed.as_ref().map_or("decode-local", WorkerId::as_str), error = %status, "prefill failed before the first token; retrying");
                    tried_prefill.extend(failed);
                    target = self.fallback(&req.tokens, &tried_prefill);
                }
                Stage::Decode => {
                    tracing::warn!(request = %req.request_id, room = %key.room, worker = %decode.id, error = %status, "decode failed before the first token; retrying");
                    tried_decode.push(decode.id.clone());
                    if let Some(d) = self.other_decode(need, req.tokens.len(), &tried_decode) {
                        decode = d;
                    }
                    // A prompt prefilled on the failed worker for the history it held would be
                    // computed whole on the next one: a prefill worker takes it instead (a
                    // short prompt stays local).
                    if target.is_none() && req.tokens.len() >= self.local_prefill_below {
                        target = self.fallback(&req.tokens, &tried_prefill);
                    }
                }
            }
            key = RoomKey::random();
        }
        unreachable!("the last attempt returns")
    }
}
