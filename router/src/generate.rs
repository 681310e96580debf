//! One request through the cluster: place it, mint a room, call the decode worker's
//! `Generate` and the prefill worker's `Prefill` at once, and turn the decode stream into text
//! — detokenized incrementally, cut at stop strings, with usage on the last message.
//! Dropping the returned stream (a client gone) drops both calls, which frees the request's
//! pages on both workers.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_cluster::metrics as M;
use ferry_cluster::phases::PhaseClock;
use ferry_cluster::{RequestId, RoomKey, TraceContext, WorkerId, traces, wire};
use ferry_proto::v1 as pb;
use ferry_tokenize::{FinishReason, SamplingParams, ServedModel};
use futures::{Stream, StreamExt};
use tonic::{Code, Status};
use tracing::Instrument as _;

use crate::admission::Admission;
use crate::error::RouterError;
use crate::index::PrefixIndex;
use crate::output::Output;

/// What a prefill call answered.
#[derive(Debug, Clone, Default)]
struct Prefilled {
    /// Prompt tokens it found cached.
    cached: u32,
    /// The first token's top alternatives, when asked for (the decode stream carries the
    /// first token without them).
    first_top: Vec<(u32, f32)>,
    /// The room's phases on the prefill worker.
    phases: Vec<(String, f64)>,
}

/// The prefill call of one attempt (None: no prefill worker).
type PrefillTask = tokio::task::JoinHandle<Result<Option<Prefilled>, Status>>;
/// An attempt's first decode message: `Some(None)` when the stream ended without one, `None`
/// when the prefill finished first.
type FirstMessage = Option<Option<Result<pb::DecodeResponse, Status>>>;

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

/// A decode worker as placement sees it.
fn decode_state(w: &Worker, healthy: bool) -> DecodeState {
    let load = w.load();
    DecodeState {
        healthy,
        admissible_pages: load.as_ref().map_or(0, |l| u64::from(l.free_pages)),
        total_pages: load.map_or(u64::MAX, |l| u64::from(l.total_pages)),
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
use crate::placement::{DecodeState, NoDecode, Placer, PrefillState, disaggregate};
use crate::workers::{Registry, Worker};

/// A validated request.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Echoed back.
    pub request_id: RequestId,
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// The trace: the caller's context (its `traceparent`) when it sent one; once the
    /// request is placed, the router span's own, the parent of the calls to the workers.
    pub trace: Option<TraceContext>,
    /// The request's clock when a phase ran before [`Ctx::generate`] (the OpenAI API's
    /// `tokenize`); None: it starts there.
    pub clock: Option<PhaseClock>,
}

/// What every request shares.
pub struct Ctx {
    /// The served model's tokenizer and limits.
    pub model: ServedModel,
    /// The workers.
    pub workers: Arc<Registry>,
    /// Who holds which prefix.
    pub index: Arc<Mutex<PrefixIndex>>,
    /// Placement.
    pub placer: Mutex<Placer>,
    /// Prompts with fewer uncached tokens are prefilled on the decode worker.
    pub local_prefill_below: usize,
    /// Tokens per KV page (for the decode worker's room estimate).
    pub page_size: usize,
    /// Keys accepted as `Authorization: Bearer <key>`; empty: no key needed.
    pub api_keys: Vec<String>,
    /// Bounds on stop strings.
    pub limits: crate::limits::Limits,
    /// Bounded concurrency with a queue.
    pub admission: Admission,
}

impl Ctx {
    /// Whether an `authorization` header value is accepted.
    pub fn authorized(&self, header: Option<&str>) -> bool {
        self.api_keys.is_empty()
            || header
                .and_then(|h| h.strip_prefix("Bearer "))
                .is_some_and(|k| self.api_keys.iter().any(|x| ferry_cluster::secret_eq(x.as_bytes(), k.as_bytes())))
    }
}

/// One piece of output.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// New text.
    pub text: String,
    /// New tokens with their logprobs.
    pub tokens: Vec<Scored>,
    /// On the last piece: why it ended and the usage.
    pub end: Option<End>,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// Its id.
    pub id: u32,
    /// Its logprob.
    pub logprob: f32,
    /// The most likely tokens at its position, best first, when sampling asked for
    /// `top_logprobs` (else empty).
    pub top: Vec<(u32, f32)>,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct End {
    /// Why.
    pub finish: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens found in a prefill cache.
    pub cached_tokens: u32,
    /// Where the request's time went ([`ferry_cluster::phases::breakdown`]).
    pub phases: [(&'static str, f64); 12],
}

/// How long a placement counts as the worker holding the prompt's pages before its own KV
/// events confirm them.
const PROVISIONAL_TTL: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Ctx {
    /// Checks a request against the model.
    pub fn validate(&self, tokens: &[u32], sampling: &SamplingParams) -> Result<(), RouterError> {
        if tokens.is_empty() {
            return Err(RouterError::invalid("empty_prompt", "the prompt is empty"));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.model.vocab_size) {
            let why = format!("token id {t} is outside the vocabulary of {}", self.model.vocab_size);
            return Err(RouterError::invalid("token_out_of_vocabulary", why));
        }
        if tokens.len() >= self.model.context_length {
            let why = format!(
                "the prompt has {} tokens; the context holds {} (including at least one generated token)",
                tokens.len(),
                self.model.context_length
            );
            return Err(RouterError::invalid("prompt_too_long", why));
        }
        sampling.validate(self.model.vocab_size).map_err(|e| RouterError::invalid("bad_sampling", e.to_string()))
    }

    /// Waits for admission, then places and starts `req`; the stream yields its output.
    pub async fn generate(
        self: &Arc<Self>,
        mut req: Prepared,
    ) -> Result<impl Stream<Item = Result<Piece, RouterError>> + use<>, RouterError> {
        let mut clock = req.clock.take().unwrap_or_else(|| PhaseClock::start("router", Instant::now()));
        let slot = self.admission.admit().await?;
        clock.lap("queue", Instant::now());
        let len = req.tokens.len();
        let snap = self.workers.snapshot();
        let prefill_states: Vec<PrefillState> = snap
            .prefill
            .iter()
            .map(|w| {
                let Some(w) = w else {
                    return PrefillState { healthy: false, queued_tokens: 0, tokens_per_second: 0.0 };
                };
                let l = w.load().unwrap_or_default();
                PrefillState {
                    healthy: w.healthy(),
                    queued_tokens: l.queued_prefill_tokens,
                    tokens_per_second: l.prefill_tokens_per_second,
                }
            })
            .collect();
        let cached = lock(&self.index).matched(&req.tokens[..len - 1], prefill_states.len());
        let jitter = rand_jitter();
        let choice = lock(&self.placer).prefill(len, &cached, &prefill_states, jitter);
        let decode_states: Vec<DecodeState> = snap.decode.iter().map(|w| decode_state(w, w.healthy())).collect();
        let need =
            (len + req.sampling.max_new_tokens as usize).min(self.model.context_length).div_ceil(self.page_size.max(1));
        let d = lock(&self.placer).decode(need as u64, &decode_states).map_err(|e| {
            metrics::counter!(M::ROUTER_REQUESTS, "outcome" => "refused").increment(1);
            match e {
                NoDecode::NoRoom(r) => RouterError::Busy {
                    reason: "no_decode_room",
                    message: e.to_string(),
                    retry_after: Duration::from_millis(r.retry_after_ms),
                },
                NoDecode::TooLarge { .. } => RouterError::TooLarge { message: e.to_string() },
            }
        })?;
        let prefill = choice
            .filter(|c| disaggregate(len - c.cached_tokens, self.local_prefill_below, true))
            .and_then(|c| Some((c.worker, Arc::clone(snap.prefill[c.worker].as_ref()?), c.cached_tokens)));
        let decode = Arc::clone(&snap.decode[d]);
        match &prefill {
            Some((_, w, _)) => metrics::counter!(M::ROUTER_PLACEMENTS, "target" => "prefill", "worker" => w.id.clone()),
            None => metrics::counter!(M::ROUTER_PLACEMENTS, "target" => "local", "worker" => decode.id.clone()),
        }
        .increment(1);
        let arrived = Instant::now();
        clock.lap("placement", arrived);
        let key = RoomKey::random();
        if let Some((slot, ..)) = &prefill {
            let _ = lock(&self.index).provisional(*slot, &req.tokens, Instant::now(), PROVISIONAL_TTL);
        }
        let me = Arc::clone(self);
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        // The router's span: a child of the caller's; every line about the request carries it.
        let (span, own) = traces::request_span("router", &req.request_id, key.room, req.trace);
        let req = Prepared { trace: Some(own), ..req };
        tokio::spawn(
            async move {
                let _slot = slot; // held while the request runs
                let out = me.run(req, key, prefill, decode, (arrived, clock), &tx).await;
                if let Err(s) = out {
                    metrics::counter!(M::ROUTER_REQUESTS, "outcome" => "error").increment(1);
                    let _ = tx.send(Err(s)).await;
                }
            }
            .instrument(span),
        );
        Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
    }

    /// Starts one attempt: the decode call and, when `prefill` is given, the prefill call.
    async fn attempt(
        &self,
        req: &Prepared,
        key: RoomKey,
        prefill: Option<Arc<Worker>>,
        dw: &Arc<Worker>,
    ) -> Result<(tonic::Streaming<pb::DecodeResponse>, PrefillTask), Status> {
        tracing::Span::current().record("room", tracing::field::display(key.room));
        let sampling = Some(wire::sampling_to_proto(&req.sampling));
        let room = Some(wire::room_key_to_proto(&key));
        let pw = prefill;
        let dreq = pb::DecodeRequest {
            request_id: req.request_id.to_string(),
            room: room.clone(),
            prefill_bootstrap_addr: pw.as_ref().map(|w| w.addr.clone()).unwrap_or_default(),
            token_ids: req.tokens.clone(),
            sampling: sampling.clone(),
        };
        let mut dc = pb::decode_client::DecodeClient::new(dw.channel.clone());
        let preq = pb::PrefillRequest {
            request_id: req.request_id.to_string(),
            room,
            token_ids: req.tokens.clone(),
            sampling,
            priority: 0,
        };
        let trace = req.trace.unwrap_or_else(TraceContext::random);
        let prefill_task = tokio::spawn(
            async move {
                let Some(pw) = pw else { return Ok(None) };
                let mut pc = pb::prefill_client::PrefillClient::new(pw.channel.clone());
                match pc.prefill(traces::request_with(preq, &trace)).await {
                    Ok(r) => {
                        pw.ok();
                        let r = r.into_inner();
                        let first_top = r.first_top.as_ref().map_or_else(Vec::new, wire::top_from_proto);
                        let phases = wire::phases_from_proto(&r.phases);
                        Ok(Some(Prefilled { cached: r.cached_tokens, first_top, phases }))
                    }
                    Err(s) => {
                        if s.code() == Code::Unavailable {
                            pw.failed();
                        }
                        Err(s)
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        match dc.generate(traces::request_with(dreq, &trace)).await {
            Ok(s) => {
                dw.ok();
                Ok((s.into_inner(), prefill_task))
            }
            Err(s) => {
                if s.code() == Code::Unavailable {
                    dw.failed();
                }
                prefill_task.abort();
                Err(s)
            }
        }
    }

    /// Another healthy prefill worker than those in `tried`, the one holding most of the
    /// prompt; None: prefill on the decode worker.
    fn fallback(&self, tokens: &[u32], tried: &[WorkerId]) -> Option<Arc<Worker>> {
        let snap = self.workers.snapshot();
        let cached = lock(&self.index).matched(&tokens[..tokens.len() - 1], snap.prefill.len());
        let open = snap.prefill.iter().enumerate().filter_map(|(s, w)| Some((s, w.as_ref()?)));
        open.filter(|(_, w)| !tried.contains(&w.id) && w.healthy())
            .max_by_key(|&(s, _)| (cached[s], std::cmp::Reverse(s)))
            .map(|(_, w)| Arc::clone(w))
    }

    /// The healthy decode worker, not among `tried`, with the most admissible pages for a
    /// request needing `need` pages.
    fn other_decode(&self, need: u64, tried: &[WorkerId]) -> Option<Arc<Worker>> {
        let snap = self.workers.snapshot();
        let states: Vec<DecodeState> =
            snap.decode.iter().map(|w| decode_state(w, w.healthy() && !tried.contains(&w.id))).collect();
        let d = lock(&self.placer).decode(need, &states).ok()?;
        Some(Arc::clone(&snap.decode[d]))
    }

    /// Runs attempts until one produces its first message (or ends cleanly), retrying a
    /// failure before the first token on other workers: a failed prefill worker is replaced
    /// by another (or by prefilling on the decode worker), a failed decode worker by another
    /// decode worker. Each retry uses a new room; the failed attempt's calls are dropped, which
    /// frees its pages on both workers.
    async fn first_message(
        &self,
        req: &Prepared,
        key: RoomKey,
        mut target: Option<Arc<Worker>>,
        mut decode: Arc<Worker>,
    ) -> Result<(tonic::Streaming<pb::DecodeResponse>, PrefillTask, FirstMessage, Arc<Worker>), Status> {
        let need = (req.tokens.len() + req.sampling.max_new_tokens as usize)
            .min(self.model.context_length)
            .div_ceil(self.page_size.max(1)) as u64;
        let (mut key, mut tried_prefill, mut tried_decode) = (key, Vec::new(), Vec::new());
        for retry in 0..=MAX_RETRIES {
            let (stage, status) = match self.attempt(req, key, target.clone(), &decode).await {
                Err(s) => (Stage::Decode, s),
                Ok((mut stream, mut task)) => tokio::select! {
                    m = stream.next() => match m {
                        Some(Err(s)) => match tokio::time::timeout(BLAME_GRACE, &mut task).await {
                            // The decode worker failed because its prefill did: blame the prefill.
                            Ok(Ok(Err(p))) => (Stage::Prefill, p),
                            _ => {
                                task.abort();
                                (Stage::Decode, s)
                            }
                        },
                        m => return Ok((stream, task, Some(m), decode)),
                    },
                    r = &mut task => match r {
                        Ok(Err(s)) => (Stage::Prefill, s),
                        other => {
                            // Done: put the outcome back for the end of the request.
                            let task = tokio::spawn(async move {
                                other.unwrap_or_else(|e| Err(Status::internal(e.to_string())))
                            });
                            return Ok((stream, task, None, decode));
                        }
                    },
                },
            };
            if retry == MAX_RETRIES || !retriable(status.code()) {
                if retriable(status.code()) {
                    tracing::warn!(request = %req.request_id, room = %key.room, error = %status, "no attempt left; failing the request");
                }
                return Err(status);
            }
            metrics::counter!(M::ROUTER_RETRIES, "stage" => stage.label()).increment(1);
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
                    if let Some(d) = self.other_decode(need, &tried_decode) {
                        decode = d;
                    }
                }
            }
            key = RoomKey::random();
        }
        unreachable!("the last attempt returns")
    }

    async fn run(
        &self,
        req: Prepared,
        key: RoomKey,
        prefill: Option<(usize, Arc<Worker>, usize)>,
        decode: Arc<Worker>,
        (arrived, mut clock): (Instant, PhaseClock),
        tx: &tokio::sync::mpsc::Sender<Result<Piece, RouterError>>,
    ) -> Result<(), RouterError> {
        let cached_guess = prefill.as_ref().map_or(0, |p| p.2 as u32);
        let (mut stream, prefill_task, first, decode) =
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
            if completion == 0
                && req.sampling.top_logprobs > 0
                && tops.is_empty()
                && let Some(task) = prefill_task.take()
            {
                // Prefilled elsewhere: the first token's alternatives come with the prefill
                // call's answer, which is due about now (the pages have arrived).
                let r = task.await.unwrap_or_else(|e| Err(Status::internal(e.to_string())));
                if let Ok(Some(p)) = &r {
                    tops = vec![p.first_top.clone()];
                }
                prefilled = Some(r);
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
            if tx.send(Ok(Piece { text, tokens: lps, end: None })).await.is_err() {
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
        let _ = tx.send(Ok(Piece { text: tail, tokens: Vec::new(), end: Some(end) })).await;
        Ok(())
    }
}

fn rand_jitter() -> impl Fn(usize) -> f64 {
    let seed: u64 = rand::random();
    move |w| {
        let mut x = seed ^ (w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}
