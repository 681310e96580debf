//! The OpenAI-compatible HTTP API: `POST /v1/completions` (one prompt or a batch of them)
//! and `POST /v1/chat/completions` (streamed over SSE or not), `GET /v1/models`,
//! `GET /v1/models/{id}`, `GET /health`, `GET /metrics`; any other path a 404, and another
//! method on these paths a 405, naming it.
//!
//! Bad input gets a 4xx with an OpenAI-shaped error body (`{"error": {"message", "type",
//! "code"}}`) and is counted in `ferry_bad_requests_total{role="router"}`: malformed JSON,
//! fields asking for what is not served yet (`suffix`, `functions`), bad `tools`, a `response_format` or
//! schema that does not compile, an unknown model, invalid sampling values, an empty prompt or one over the
//! context, a body that is not UTF-8 or over the size limit. No room anywhere gives 429 with a
//! `Retry-After` header; so does a full admission queue, before the body is parsed. A client that disconnects drops the request on both workers. With
//! API keys configured, `/v1/*` needs `Authorization: Bearer <key>` (else 401); `/health` and
//! `/metrics` stay open.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ferry_cluster::trace::TRACEPARENT;
use ferry_cluster::{RequestId, TraceContext};
use ferry_tokenize::{Constraint, SamplingParams};
use futures::StreamExt;
use serde_json::json;

use crate::error::RouterError;
use crate::generate::{Ctx, Prepared};

mod body;
mod messages;
mod reply;
pub mod tools;
use body::{Common, PromptIn, StopIn, asks_for_nothing, common, other_fields};
use reply::{Reply, sse, whole};

/// Largest request body.
pub const MAX_BODY: usize = 4 << 20;

/// Most prompts in one completions request (a batch; each also takes an admission slot).
pub const MAX_PROMPTS: usize = 256;

fn err(status: StatusCode, reason: &'static str, message: impl Into<String>) -> Response {
    metrics::counter!(ferry_cluster::metrics::BAD_REQUESTS, "role" => "router", "reason" => reason).increment(1);
    let kind = if status == StatusCode::TOO_MANY_REQUESTS { "rate_limit_error" } else { "invalid_request_error" };
    body(status, kind, reason, &message.into())
}

fn body(status: StatusCode, kind: &str, code: &str, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "code": code}});
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// The one mapping of the router's errors to the OpenAI API: the HTTP status and error type
/// by kind, the stable reason as `code`, `Retry-After` (seconds) on refusals that hint one.
fn from_error(e: &RouterError) -> Response {
    if let RouterError::Invalid { reason, message } = e {
        return err(StatusCode::BAD_REQUEST, reason, message.clone());
    }
    let (code, kind) = e.http();
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let mut r = body(status, kind, e.reason(), &e.to_string());
    if let Some(after) = e.retry_after().filter(|_| status == StatusCode::TOO_MANY_REQUESTS) {
        let secs = (after.as_millis() as u64).div_ceil(1000).max(1);
        if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    r
}

/// A completion's prompt, put before it (`echo`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Echo {
    /// The prompt as the client wrote it.
    pub text: String,
    /// Its token ids.
    pub ids: Vec<u32>,
    /// `max_tokens: 0`: the answer is the prompt alone (one token is generated and left out).
    pub prompt_only: bool,
}

/// What a request asked of its response, besides the tokens.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Shape {
    /// The response's id (a batch's requests are named after it).
    pub id: String,
    /// Server-sent events.
    pub stream: bool,
    /// Logprobs of the generated tokens.
    pub logprobs: bool,
    /// Tool calls to find in the output (chat with tools).
    pub tools: Option<tools::Tools>,
    /// Completions with `echo`: each prompt, to put before its choices (else empty).
    pub echo: Vec<Echo>,
}

/// Whether logprobs were asked for, and how many alternatives per token: chat takes
/// `logprobs: true` and `top_logprobs: k`; completions `logprobs: k`.
fn logprobs_asked(c: &Common, kind: Kind) -> Result<(bool, u32), FieldError> {
    use serde_json::Value;
    match kind {
        Kind::Chat => {
            let on = match &c.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(format!("`logprobs` must be true or false on chat completions, not {v}").into()),
            };
            match c.top_logprobs {
                Some(k) if k > 0 && !on => Err("`top_logprobs` needs `logprobs: true`".into()),
                k => Ok((on, k.unwrap_or(0))),
            }
        }
        Kind::Completion => {
            if c.top_logprobs.is_some_and(|k| k > 0) {
                return Err("`top_logprobs` is a chat field: completions take `logprobs: <alternatives>`".into());
            }
            match &c.logprobs {
                None | Some(Value::Null) => Ok((false, 0)),
                Some(v) => match v.as_u64() {
                    // Named as the client wrote it (the sampler's field is `top_logprobs`).
                    Some(k) if k > u64::from(ferry_tokenize::MAX_TOP_LOGPROBS) => {
                        Err(format!("`logprobs` must be at most {}, not {k}", ferry_tokenize::MAX_TOP_LOGPROBS).into())
                    }
                    Some(k) => Ok((true, k as u32)),
                    None => {
                        Err(format!("`logprobs` must be a number of alternatives (0–20) on completions, not {v}")
                            .into())
                    }
                },
            }
        }
    }
}

/// The output constraint asked for: `response_format` (OpenAI) or one of vLLM's `guided_json`,
/// `guided_regex`, `guided_choice` — at most one. Errors name the field.
fn constraint_asked(c: &Common) -> Result<Option<Constraint>, FieldError> {
    use serde_json::Value;
    let mut asked = Vec::new();
    if let Some(rf) = c.response_format.as_ref().filter(|v| !v.is_null()) {
        let kind = rf.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => {}
            Some("json_object") => asked.push(Constraint::JsonObject),
            Some("json_schema") => {
                let schema = rf.get("json_schema").and_then(|j| j.get("schema"));
                match schema {
                    Some(s @ (Value::Object(_) | Value::Bool(_))) => asked.push(Constraint::JsonSchema(s.to_string())),
                    Some(other) => {
                        return Err(format!(
                            "`response_format.json_schema.schema` must be a JSON Schema object, not {other}"
                        )
                        .into());
                    }
                    None => return Err("`response_format.json_schema.schema` is required".into()),
                }
            }
            Some(other) => {
                return Err(format!(
                    "`response_format.type` {other:?} is not one of \"text\", \"json_object\", \"json_schema\""
                )
                .into());
            }
            None => return Err("`response_format.type` is required".into()),
        }
    }
    match &c.guided_json {
        None | Some(Value::Null) => {}
        // vLLM takes the schema as an object or as its JSON text.
        Some(Value::String(s)) => asked.push(Constraint::JsonSchema(s.clone())),
        Some(s) => asked.push(Constraint::JsonSchema(s.to_string())),
    }
    if let Some(r) = &c.guided_regex {
        asked.push(Constraint::Regex(r.clone()));
    }
    if let Some(ch) = &c.guided_choice {
        asked.push(Constraint::Choice(ch.clone()));
    }
    if asked.len() > 1 {
        return Err("at most one of `response_format` (json), `guided_json`, `guided_regex`, `guided_choice`".into());
    }
    Ok(asked.pop())
}

/// What is wrong with one field of a request body, in words that name the field (a 400's
/// message; the caller adds its stable reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FieldError(pub String);

impl From<String> for FieldError {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl From<&str> for FieldError {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The HTTP routes over `ctx`.
pub fn routes(ctx: Arc<Ctx>) -> Router {
    Router::new()
        .route(
            "/v1/completions",
            post(|s: State<Arc<Ctx>>, h: HeaderMap, b: Result<Bytes, BytesRejection>| {
                handle(s, h, b, Kind::Completion)
            }),
        )
        .route(
            "/v1/chat/completions",
            post(|s: State<Arc<Ctx>>, h: HeaderMap, b: Result<Bytes, BytesRejection>| handle(s, h, b, Kind::Chat)),
        )
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(|| async { ferry_cluster::exporter::handle().map(|h| h.render()).unwrap_or_default() }))
        .fallback(not_served)
        .method_not_allowed_fallback(not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(ctx)
}

/// A request's path as an error names it: its first 200 characters.
fn shown(uri: &axum::http::Uri) -> String {
    uri.path().chars().take(200).collect()
}

/// Any other path: a 404 naming it, in the API's error shape.
async fn not_served(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let served = "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics";
    let why = format!("{method} {} is not served here; this server serves {served}", shown(&uri));
    err(StatusCode::NOT_FOUND, "not_found", why)
}

/// A served path asked with another method: a 405 naming both, in the API's error shape.
async fn not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    err(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", format!("{method} is not allowed on {}", shown(&uri)))
}

fn unauthorized(ctx: &Ctx, headers: &HeaderMap) -> Option<Response> {
    let h = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    (!ctx.authorized(h)).then(|| {
        err(StatusCode::UNAUTHORIZED, "invalid_api_key", "a valid API key is required: Authorization: Bearer <key>")
    })
}

async fn models(State(ctx): State<Arc<Ctx>>, headers: HeaderMap) -> Response {
    if let Some(r) = unauthorized(&ctx, &headers) {
        return r;
    }
    let body = json!({"object": "list", "data": [{"id": ctx.model.name, "object": "model", "created": 0, "owned_by": "ferry"}]});
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

async fn model(
    State(ctx): State<Arc<Ctx>>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if let Some(r) = unauthorized(&ctx, &headers) {
        return r;
    }
    if id != ctx.model.name {
        return err(StatusCode::NOT_FOUND, "model_not_found", format!("model {id:?} is not served here"));
    }
    let body = json!({"id": ctx.model.name, "object": "model", "created": 0, "owned_by": "ferry"});
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

async fn health(State(ctx): State<Arc<Ctx>>) -> Response {
    if ctx.workers.snapshot().decode.iter().any(|w| w.healthy()) {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no healthy decode worker").into_response()
    }
}

// The error is the finished HTTP response, returned once per request: its size is no concern.
#[allow(clippy::result_large_err)]
fn prepare(ctx: &Ctx, c: &Common, kind: Kind) -> Result<(Vec<Prepared>, Shape), Response> {
    if c.model != ctx.model.name {
        return Err(err(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("model {:?} is not served here (try {:?})", c.model, ctx.model.name),
        ));
    }
    let bad = |reason, m: String| err(StatusCode::BAD_REQUEST, reason, m);
    // Before any work for the request: stop strings are scanned at every token.
    let stop = match &c.stop {
        None => Vec::new(),
        Some(StopIn::One(s)) => vec![s.clone()],
        Some(StopIn::Many(v)) => v.clone(),
    };
    ctx.limits.check_stop(&stop).map_err(|e| bad(e.reason, e.message))?;
    let (logprobs, top_logprobs) = logprobs_asked(c, kind).map_err(|e| bad("bad_logprobs", e.0))?;
    let mut constraint = constraint_asked(c).map_err(|e| bad("bad_response_format", e.0))?;
    let tools = match kind {
        Kind::Chat => tools::parse(c.tools.as_ref(), c.tool_choice.as_ref()).map_err(|e| bad("bad_tools", e.0))?,
        Kind::Completion if c.tools.as_ref().is_some_and(|t| !asks_for_nothing(t)) => {
            return Err(bad("bad_tools", "`tools` is a chat completions field".into()));
        }
        Kind::Completion if c.tool_choice.as_ref().is_some_and(|t| !asks_for_nothing(t)) => {
            return Err(bad("bad_tools", "`tool_choice` is a chat completions field".into()));
        }
        Kind::Completion => None,
    };
    if let Some(tc) = tools.as_ref().and_then(tools::Tools::constraint) {
        if constraint.is_some() {
            return Err(bad(
                "bad_tools",
                "`tool_choice` asks for a call: it cannot be combined with `response_format`".into(),
            ));
        }
        constraint = Some(tc);
    }
    if c.echo && kind == Kind::Chat {
        return Err(bad("unsupported", "`echo` is served on completions, not chat".into()));
    }
    let encode = |t: &str| ctx.encode(t).map_err(|e| bad("tokenize", e.to_string()));
    // A completion may carry several prompts (a list of strings or of token-id lists): each
    // is a request of its own, its `n` choices after those of the prompts before it. Each
    // prompt as the client wrote it (text), when it wrote text.
    let count = match (kind, &c.prompt) {
        (Kind::Completion, Some(PromptIn::Texts(ts))) => ts.len(),
        (Kind::Completion, Some(PromptIn::IdLists(ls))) => ls.len(),
        _ => 1,
    };
    if count > MAX_PROMPTS {
        let why = format!("`prompt` has {count} prompts; at most {MAX_PROMPTS} are accepted");
        return Err(bad("too_many_prompts", why));
    }
    // Before tokenizing them: a batch larger than can run at once never will.
    ctx.admission.can_run(count).map_err(|e| from_error(&e))?;
    let prompts: Vec<(Vec<u32>, Option<&str>)> = match (kind, &c.prompt, &c.messages) {
        (Kind::Completion, Some(PromptIn::Text(t)), None) => vec![(encode(t)?, Some(t.as_str()))],
        (Kind::Completion, Some(PromptIn::Texts(ts)), None) => {
            ts.iter().map(|t| Ok((encode(t)?, Some(t.as_str())))).collect::<Result<_, Response>>()?
        }
        (Kind::Completion, Some(PromptIn::Ids(ids)), None) => vec![(ids.clone(), None)],
        (Kind::Completion, Some(PromptIn::IdLists(ls)), None) => ls.iter().map(|ids| (ids.clone(), None)).collect(),
        (Kind::Completion, _, _) => {
            let why = "`prompt` is required (and `messages` is not accepted): a string, a list of strings, a list of token ids or a list of such lists";
            return Err(bad("bad_prompt", why.into()));
        }
        (Kind::Chat, None, Some(ms)) => {
            let t = ctx.model.tokenizer.chat_template().map_err(|e| bad("no_chat_template", e.to_string()))?;
            let text = messages::render(t, ms, tools.as_ref()).map_err(|e| bad("bad_messages", e.0))?;
            vec![(encode(&text)?, None)]
        }
        (Kind::Chat, _, _) => {
            return Err(bad("bad_messages", "`messages` is required (and `prompt` is not accepted)".into()));
        }
    };
    if prompts.is_empty() {
        return Err(bad("bad_prompt", "`prompt` is an empty list".into()));
    }
    let d = SamplingParams::default();
    let max_tokens = c.max_completion_tokens.or(c.max_tokens).unwrap_or(d.max_new_tokens);
    // By token id, ascending; ranges are checked with the rest of the sampling.
    let mut logit_bias = std::collections::BTreeMap::<u32, f32>::new();
    for (k, &b) in c.logit_bias.iter().flatten() {
        let Ok(id) = k.trim().parse::<u32>() else {
            return Err(bad("bad_logit_bias", format!("`logit_bias` key {k:?} is not a token id")));
        };
        // "7" and "07" are one id: which bias would win is the map's order, so neither does.
        if logit_bias.insert(id, b).is_some() {
            return Err(bad("bad_logit_bias", format!("`logit_bias` names token {id} twice (key {k:?})")));
        }
    }
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(1.0),
        top_p: c.top_p.unwrap_or(d.top_p),
        top_k: c.top_k.unwrap_or(0),
        min_p: c.min_p.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        seed: c.seed,
        max_new_tokens: if c.echo { max_tokens.max(1) } else { max_tokens },
        prompt_logprobs: (c.echo && logprobs).then_some(top_logprobs),
        ignore_eos: c.ignore_eos,
        top_logprobs,
        constraint,
        n: c.n.unwrap_or(1),
        logit_bias: logit_bias.into_iter().collect(),
        ..d
    };
    let batch = prompts.len() > 1;
    for (i, (tokens, _)) in prompts.iter().enumerate() {
        ctx.validate(tokens, &sampling).map_err(|e| match e {
            // The prompt's own faults name it; the sampling's are the whole request's.
            RouterError::Invalid { reason, message } if batch && reason != "bad_sampling" => {
                err(StatusCode::BAD_REQUEST, reason, format!("prompt[{i}]: {message}"))
            }
            e => from_error(&e),
        })?;
    }
    // This runs on the tokenizer pool: compiling a schema is no work for the async threads.
    // A schema that came from the tools is named as theirs.
    ctx.check_constraint(&sampling).map_err(|e| match (&e, &tools) {
        (RouterError::Invalid { reason, message }, Some(t)) if t.constraint().is_some() => {
            let message = message.replacen("response_format.json_schema.schema", "tools[].function.parameters", 1);
            err(StatusCode::BAD_REQUEST, reason, message)
        }
        _ => from_error(&e),
    })?;
    let id = format!("ferry-{:016x}", rand::random::<u64>());
    let echo = if c.echo {
        let text = |ids: &[u32], t: Option<&str>| {
            t.map_or_else(|| ctx.model.tokenizer.decode(ids, false).unwrap_or_default(), str::to_string)
        };
        // `max_tokens: 0` (an evaluation harness scoring the prompt): one token is made and
        // left out of the answer.
        prompts
            .iter()
            .map(|(ids, t)| Echo { text: text(ids, *t), ids: ids.clone(), prompt_only: max_tokens == 0 })
            .collect()
    } else {
        Vec::new()
    };
    // The last prompt (the only one, mostly) takes the sampling itself, the others copies.
    let k = prompts.len();
    let prepared = prompts
        .into_iter()
        .zip(std::iter::repeat_n((sampling, stop), k))
        .enumerate()
        .map(|(i, ((tokens, _), (sampling, stop)))| Prepared {
            // A batch's requests are named after the response: `ferry-…-0`, `ferry-…-1`, ...
            request_id: RequestId::new(if batch { format!("{id}-{i}") } else { id.clone() }),
            tokens,
            sampling,
            stop,
            trace: None,
            clock: None,
        })
        .collect();
    Ok((prepared, Shape { id, stream: c.stream, logprobs, tools, echo }))
}

async fn handle(
    State(ctx): State<Arc<Ctx>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Response {
    if let Some(r) = unauthorized(&ctx, &headers) {
        return r;
    }
    let body = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return err(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", format!("the body is over {MAX_BODY} bytes"));
        }
        Err(e) => return err(StatusCode::BAD_REQUEST, "bad_body", e.body_text()),
    };
    // Admitted first: parsing and tokenizing take CPU in proportion to the body, and a
    // request the router cannot run now must not take it (then off the async threads).
    let mut clock = ferry_cluster::phases::PhaseClock::start("router", std::time::Instant::now());
    let slot = match ctx.admission.admit().await {
        Ok(s) => s,
        Err(e) => return from_error(&e),
    };
    clock.lap("queue", std::time::Instant::now());
    let parsed = {
        let ctx = Arc::clone(&ctx);
        // The refusal is the finished response, once per request: its size is no concern.
        let len = body.len();
        #[allow(clippy::result_large_err)]
        let job = move || parse(&ctx, &body, kind);
        crate::offload::Pool::global().run_sized(len, job).await
    };
    let (ps, shape) = match parsed {
        Ok(Ok(x)) => {
            clock.lap("tokenize", std::time::Instant::now());
            x
        }
        Ok(Err(r)) => return r,
        Err(busy) => {
            let mut r = err(StatusCode::TOO_MANY_REQUESTS, "tokenizer_busy", busy.to_string());
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return r;
        }
    };
    // A batch takes one slot per prompt, all at once (its first given back while it waits).
    let slots = if ps.len() == 1 {
        vec![slot]
    } else {
        drop(slot);
        let slots = match ctx.admission.admit_many(ps.len()).await {
            Ok(s) => s,
            Err(e) => return from_error(&e),
        };
        clock.lap("queue", std::time::Instant::now());
        slots
    };
    // The caller's trace, when its `traceparent` header is well-formed.
    let trace = headers.get(TRACEPARENT).and_then(|v| v.to_str().ok()).and_then(TraceContext::parse);
    let (prompts, n) = (ps.len(), ps[0].sampling.n.max(1));
    // Each of a batch's requests goes on from the clock so far (the phases that answer says
    // are those of its last request to end).
    let started = ps.into_iter().zip(slots).zip(std::iter::repeat_n(clock, prompts)).map(|((mut p, slot), clock)| {
        (p.trace, p.clock) = (trace, Some(clock));
        ctx.generate(p, slot)
    });
    let mut streams = match futures::future::try_join_all(started).await {
        Ok(s) => s,
        Err(e) => return from_error(&e),
    };
    let stream = match streams.pop() {
        Some(s) if streams.is_empty() => s.boxed(),
        last => reply::merged(streams.into_iter().chain(last).map(StreamExt::boxed).collect(), n),
    };
    let phases = headers.get(reply::PHASES).is_some_and(|v| v == "1" || v == "true");
    let reply = Reply {
        ctx: Arc::clone(&ctx),
        id: shape.id,
        model: ctx.model.name.clone(),
        kind,
        logprobs: shape.logprobs,
        phases,
        tools: shape.tools,
        echo: shape.echo,
        n: n as usize,
        prompts,
    };
    if shape.stream { sse(stream, reply).into_response() } else { whole(stream, reply).await }
}

/// Reads a request body: UTF-8, JSON with known fields only, the model, the prompt or
/// messages (tokenized), sampling and stop strings, all checked. Returns the request and
/// what it asked of the response, or the finished 4xx response.
// The error is the finished HTTP response, returned once per request: its size is no concern.
#[allow(clippy::result_large_err)]
pub fn parse(ctx: &Ctx, body: &[u8], kind: Kind) -> Result<(Vec<Prepared>, Shape), Response> {
    let Ok(text) = std::str::from_utf8(body) else {
        return Err(err(StatusCode::BAD_REQUEST, "invalid_utf8", "the body is not UTF-8"));
    };
    let c = common(text).map_err(|e| err(StatusCode::BAD_REQUEST, "bad_json", format!("invalid request JSON: {e}")))?;
    other_fields(&c.other)?;
    prepare(ctx, &c, kind)
}
