//! One request through the cluster: admit it, place it, mint a room, call the decode
//! worker's `Generate` and the prefill worker's `Prefill` at once (`generate/attempt.rs`,
//! retried on other workers before the first token), and turn the decode stream into text
//! (`generate/stream.rs`: detokenized incrementally, cut at stop strings, with usage on the
//! last message). Dropping the returned stream (a client gone) drops both calls, which frees
//! the request's pages on both workers.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_cluster::metrics as M;
use ferry_cluster::phases::PhaseClock;
use ferry_cluster::{RequestId, RoomKey, TraceContext, traces};
use ferry_tokenize::{FinishReason, SamplingParams, ServedModel};
use futures::Stream;
use tracing::Instrument as _;

mod attempt;
mod migrate;
mod packed;
mod stream;

use crate::admission::Admission;
use crate::error::RouterError;
use crate::index::SharedIndex;
use crate::placement::{DecodeState, NoDecode, Path, Placer, jitter};
use crate::workers::{Pending, Registry, Worker};

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
    /// The request's clock when phases ran before [`Ctx::generate`] (admission's `queue`,
    /// `tokenize`); None: it starts there.
    pub clock: Option<PhaseClock>,
}

/// What every request shares.
pub struct Ctx {
    /// The served model's tokenizer and limits.
    pub model: ServedModel,
    /// Output constraints compiled (and kept) here first, so a bad one is refused before any
    /// worker sees it.
    pub grammars: Arc<ferry_grammar::Grammars>,
    /// The workers.
    pub workers: Arc<Registry>,
    /// Who holds which prefix.
    pub index: Arc<SharedIndex>,
    /// Placement.
    pub placer: Mutex<Placer>,
    /// Prompts with fewer uncached tokens are prefilled on the decode worker.
    pub local_prefill_below: usize,
    /// `--local-prefill-max`.
    pub local_prefill_max: usize,
    /// Tokens per KV page (for the decode worker's room estimate).
    pub page_size: usize,
    /// Keys accepted as `Authorization: Bearer <key>`; empty: no key needed.
    pub api_keys: Vec<String>,
    /// Bounds on stop strings.
    pub limits: crate::limits::Limits,
    /// `--migration-limit`: moves of one stream to another decode worker.
    pub migration_limit: u32,
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

    /// A prompt's token ids, reusing the tokenizer's head cache; its figures go to metrics.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ferry_tokenize::TokenizeError> {
        let ids = self.model.tokenizer.encode(text)?;
        if let Some(c) = self.model.tokenizer.head_cache() {
            use ferry_cluster::metrics as M;
            let s = c.stats();
            metrics::counter!(M::ROUTER_TOKENIZER_CACHE_TOKENS, "kind" => "hit").absolute(s.hit_tokens);
            metrics::counter!(M::ROUTER_TOKENIZER_CACHE_TOKENS, "kind" => "miss").absolute(s.miss_tokens);
            metrics::gauge!(M::ROUTER_TOKENIZER_CACHE_BYTES).set(s.bytes as f64);
        }
        Ok(ids)
    }
}

/// The prefill worker placement chose for a request's prompt.
pub(super) struct Chosen {
    /// Its slot on the board.
    slot: usize,
    worker: Arc<Worker>,
    /// The prompt tokens it holds, as placement saw them.
    held: usize,
    /// The rest, pending on it for placement until the prompt is computed.
    computing: Option<Pending>,
}

/// One piece of output, of one of the request's sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// Its sequence (0 .. n-1; pieces of different sequences interleave).
    pub index: u32,
    /// New text.
    pub text: String,
    /// New tokens with their logprobs.
    pub tokens: Vec<Scored>,
    /// On the first piece, when the sampling asked for `prompt_logprobs`: each prompt token
    /// after the first with its logprob and alternatives.
    pub prompt: Vec<Scored>,
    /// On the last piece of its sequence: why it ended and the usage (the prompt on every
    /// sequence's, the sequence's own completion tokens).
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

    /// Compiles the request's output constraint (a cache hit after the first time), refusing
    /// one that does not compile. CPU work in proportion to the schema: call it off the async
    /// threads.
    pub fn check_constraint(&self, sampling: &SamplingParams) -> Result<(), RouterError> {
        let Some(c) = &sampling.constraint else { return Ok(()) };
        self.grammars.matcher(c).map(drop).map_err(|e| RouterError::invalid("invalid_constraint", e.to_string()))
    }

    /// KV pages a request needs on its decode worker: its prompt and `max_tokens`, within the
    /// context, for each of its `n` sequences (which share the prompt's full pages).
    pub fn pages_needed(&self, prompt: usize, sampling: &SamplingParams) -> u64 {
        let context = (prompt + sampling.max_new_tokens as usize).min(self.model.context_length);
        ferry_cluster::fork_pages(prompt, context, sampling.n as usize, self.page_size) as u64
    }

    /// Places and starts `req`, admitted in `slot` ([`Admission::admit`], taken before the
    /// request was parsed and tokenized: that work is admission-controlled too); the stream
    /// yields its output and holds the slot until it ends.
    pub async fn generate(
        self: &Arc<Self>,
        mut req: Prepared,
        slot: crate::admission::Slot,
    ) -> Result<impl Stream<Item = Result<Piece, RouterError>> + use<>, RouterError> {
        let mut clock = req.clock.take().unwrap_or_else(|| PhaseClock::start("router", Instant::now()));
        let len = req.tokens.len();
        let snap = self.workers.snapshot();
        let now = Instant::now();
        let board = self.workers.prefill_board();
        let cached = self.index.matched(&req.tokens[..len - 1], board.len());
        let mut pending = Vec::new();
        self.workers.prefill_pending(&board, &mut pending);
        let choice = self.placer.lock().prefill(len, (&cached, &pending), &board, now, jitter(rand::random()));
        // What each decode worker's cache holds of the prompt (its KV events: finished
        // requests, a conversation's earlier turns and answers among them).
        let decode_slots = snap.decode.iter().map(|w| w.slot + 1).max().unwrap_or(0);
        let decode_cached = self.workers.decode_index().matched(&req.tokens[..len - 1], decode_slots);
        // A decode worker computes the whole prompt of a request with several sequences
        // (they must own the pages they share) or asking for prompt logprobs: its cache
        // saves such a request nothing there, and draws it nowhere.
        let reads_cache = req.sampling.n <= 1 && req.sampling.prompt_logprobs.is_none();
        let held_on = |w: &Worker| if reads_cache { decode_cached[w.slot] } else { 0 };
        let decode_states: Vec<DecodeState> =
            snap.decode.iter().map(|w| w.decode_state(now, false, held_on(w))).collect();
        let need = self.pages_needed(len, &req.sampling);
        let d = self.placer.lock().decode(need, len, &decode_states).map_err(|e| {
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
        let held = decode_states[d].cached_tokens;
        let path = self.placer.lock().path(
            len,
            choice.map(|c| (c, board.state(c.worker, now))),
            held,
            self.local_prefill_below,
            self.local_prefill_max,
        );
        if held > choice.map_or(0, |c| c.cached_tokens) && choice.is_some() {
            let label = match path {
                Path::Local(_) => "local",
                Path::Prefill(_) => "prefill",
                Path::Pull(_) => "pull",
            };
            metrics::counter!(M::ROUTER_DECODE_PREFIX, "choice" => label).increment(1);
        }
        let pull = matches!(path, Path::Pull(_));
        let prefill = match path {
            Path::Prefill(c) | Path::Pull(c) => {
                // The board and the members are read apart: the slot may have changed hands
                // between the reads (then the prompt is computed where it decodes).
                snap.prefill_scored(&board, c.worker).map(|w| Chosen {
                    slot: c.worker,
                    worker: Arc::clone(w),
                    held: c.cached_tokens,
                    // What it computes of the prompt, pending there until the first token.
                    computing: self.workers.prefill_started(w, (len - c.cached_tokens) as u64),
                })
            }
            Path::Local(_) => None,
        };
        let decode = snap.decode[d].placed();
        metrics::counter!(M::ROUTER_DECODE_PLACEMENTS, "worker" => decode.id.clone()).increment(1);
        match &prefill {
            Some(c) => metrics::counter!(M::ROUTER_PLACEMENTS, "target" => "prefill", "worker" => c.worker.id.clone()),
            None => metrics::counter!(M::ROUTER_PLACEMENTS, "target" => "local", "worker" => decode.id.clone()),
        }
        .increment(1);
        let arrived = Instant::now();
        clock.lap("placement", arrived);
        let key = RoomKey::random();
        if let Some(c) = &prefill {
            let _ = self.index.provisional(c.slot, &req.tokens, Instant::now(), PROVISIONAL_TTL);
        }
        let me = Arc::clone(self);
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        // The router's span: a child of the caller's; every line about the request carries it.
        let (span, own) = traces::request_span("router", &req.request_id, key.room, req.trace);
        let req = Prepared { trace: Some(own), ..req };
        tokio::spawn(
            async move {
                let _slot = slot; // held while the request runs
                // A client gone while the workers are silent (waiting for the KV, say) ends
                // the request at once: dropping the calls frees its pages on both workers.
                // Otherwise only the next piece sent would notice.
                let out = tokio::select! {
                    out = me.run(req, key, (prefill, pull), decode, (arrived, clock), &tx) => out,
                    () = tx.closed() => {
                        metrics::counter!(M::ROUTER_REQUESTS, "outcome" => "cancelled").increment(1);
                        Ok(())
                    }
                };
                if let Err(s) = out {
                    metrics::counter!(M::ROUTER_REQUESTS, "outcome" => "error").increment(1);
                    let _ = tx.send(Err(s)).await;
                }
            }
            .instrument(span),
        );
        Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}
