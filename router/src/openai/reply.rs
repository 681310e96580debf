//! The OpenAI response shapes: a whole completion or chat completion, or its server-sent
//! events, with usage and (when asked) logprobs.

use std::convert::Infallible;
use std::sync::Arc;

use axum::http::header;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use serde_json::json;

use super::tools::{Call, Holdback, Tools, to_json};
use super::{Echo, Kind, from_error, now};
use crate::error::RouterError;
use crate::generate::{Ctx, End, Piece, Scored};

/// Who a response goes to and what it carries.
pub(super) struct Reply {
    pub(super) ctx: Arc<Ctx>,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) kind: Kind,
    pub(super) logprobs: bool,
    /// The client sent `ferry-phases: 1`: say where the request's time went.
    pub(super) phases: bool,
    /// Chat with tools: calls are looked for in the output.
    pub(super) tools: Option<Tools>,
    /// Completions with `echo`: each prompt's (else empty).
    pub(super) echo: Vec<Echo>,
    /// Choices per prompt (`n`).
    pub(super) n: usize,
    /// Prompts (a completions batch; else 1): choice `i` answers prompt `i / n`.
    pub(super) prompts: usize,
}

/// The request header asking for the phases, and the response header carrying them.
pub(super) const PHASES: &str = "ferry-phases";

impl Reply {
    fn object(&self, streamed: bool) -> &'static str {
        match (self.kind, streamed) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// Choices in all.
    fn choices(&self) -> usize {
        self.n * self.prompts
    }

    /// The prompt that choice `i` answers.
    fn prompt_of(&self, i: usize) -> usize {
        i / self.n.max(1)
    }

    /// What choice `i` echoes, if anything.
    fn echo(&self, i: usize) -> Option<&Echo> {
        self.echo.get(self.prompt_of(i))
    }

    /// Choice `i`'s `logprobs` for `tokens` (null when not asked for); `offset` carries a
    /// completion's text offset from chunk to chunk. `prompt`: an echoed prompt's logprobs
    /// go first (the first piece of an `echo`).
    fn logprobs(
        &self,
        i: usize,
        tokens: &[Scored],
        prompt: Option<&[Scored]>,
        offset: &mut usize,
    ) -> serde_json::Value {
        if !self.logprobs {
            return serde_json::Value::Null;
        }
        let tok = &self.ctx.model.tokenizer;
        match (self.kind, prompt, self.echo(i)) {
            (Kind::Chat, _, _) => crate::logprobs::chat(tok, tokens),
            (Kind::Completion, Some(p), Some(e)) if !e.ids.is_empty() => {
                crate::logprobs::completion_echo(tok, e.ids[0], p, tokens, offset)
            }
            (Kind::Completion, _, _) => crate::logprobs::completion(tok, tokens, offset),
        }
    }

    /// Whether the generated tokens are left out (`echo` with `max_tokens: 0`).
    fn prompt_only(&self) -> bool {
        self.echo.first().is_some_and(|e| e.prompt_only)
    }
}

/// The phases as the `ferry_phases` field: `{"decode": seconds, ...}`, in the breakdown's
/// order (serde_json keeps insertion order: llguidance turns on its `preserve_order`).
fn phases(e: &End) -> serde_json::Value {
    e.phases.iter().map(|&(p, s)| (p.to_string(), json!(s))).collect::<serde_json::Map<_, _>>().into()
}

/// A request's usage: each prompt once (however many choices it has), the completion
/// tokens of all its sequences.
struct Usage {
    prompt_tokens: u32,
    cached_tokens: u32,
    completion_tokens: u32,
    /// Whether each prompt is counted yet.
    counted: Vec<bool>,
}

impl Usage {
    fn new(prompts: usize) -> Self {
        Self { prompt_tokens: 0, cached_tokens: 0, completion_tokens: 0, counted: vec![false; prompts] }
    }

    /// Counts a sequence's end, of prompt `prompt`.
    fn add(&mut self, prompt: usize, e: &End) {
        self.completion_tokens += e.completion_tokens;
        if !std::mem::replace(&mut self.counted[prompt], true) {
            self.prompt_tokens += e.prompt_tokens;
            self.cached_tokens += e.cached_tokens;
        }
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// One choice of a whole response, as its pieces arrive.
#[derive(Default)]
struct Choice {
    text: String,
    tokens: Vec<Scored>,
    end: Option<End>,
}

/// A batch's streams of pieces as one: prompt `i`'s choices numbered from `i × n`. The first
/// error ends it: the other requests are dropped (cancelled on their workers), as a whole
/// answer's are.
pub(super) fn merged(
    streams: Vec<BoxStream<'static, Result<Piece, RouterError>>>,
    n: u32,
) -> BoxStream<'static, Result<Piece, RouterError>> {
    futures::stream::select_all(streams.into_iter().enumerate().map(|(i, s)| {
        let first = i as u32 * n;
        s.map(move |r| r.map(|p| Piece { index: first + p.index, ..p })).boxed()
    }))
    .scan(false, |failed, r| std::future::ready((!std::mem::replace(failed, r.is_err())).then_some(r)))
    .boxed()
}

pub(super) async fn whole(mut s: impl Stream<Item = Result<Piece, RouterError>> + Unpin, r: Reply) -> Response {
    let mut choices: Vec<Choice> = (0..r.choices()).map(|_| Choice::default()).collect();
    // A prompt's logprobs (`echo`) come once, with its first sequence; each of its choices
    // shows them.
    let mut prompt: Vec<Vec<Scored>> = vec![Vec::new(); r.prompts];
    // The last sequence to end carries the request's phases.
    let mut last = None;
    while let Some(p) = s.next().await {
        match p {
            Ok(p) => {
                let Some(c) = choices.get_mut(p.index as usize) else {
                    return from_error(&RouterError::Internal(format!("a piece of sequence {}", p.index)));
                };
                c.text.push_str(&p.text);
                if r.logprobs {
                    c.tokens.extend(p.tokens);
                    prompt[r.prompt_of(p.index as usize)].extend(p.prompt);
                }
                if p.end.is_some() {
                    c.end = p.end;
                    last = p.end;
                }
            }
            Err(e) => return from_error(&e),
        }
    }
    let (Some(e), true) = (last, choices.iter().all(|c| c.end.is_some())) else {
        return from_error(&RouterError::Internal("the request ended without a finish reason".into()));
    };
    let mut usage = Usage::new(r.prompts);
    let choices: Vec<serde_json::Value> = choices
        .into_iter()
        .enumerate()
        .filter_map(|(i, c)| Some((i, c.text, c.tokens, c.end?)))
        .map(|(i, mut text, mut tokens, mut e)| {
            if r.prompt_only() {
                (text, tokens) = (String::new(), Vec::new());
                (e.completion_tokens, e.finish) = (0, ferry_tokenize::FinishReason::Length);
            }
            usage.add(r.prompt_of(i), &e);
            if let Some(echo) = r.echo(i) {
                text.insert_str(0, &echo.text);
            }
            let logprobs = r.logprobs(i, &tokens, Some(&prompt[r.prompt_of(i)]), &mut 0);
            match r.kind {
                Kind::Completion => {
                    json!({"index": i, "text": text, "finish_reason": e.finish.as_str(), "logprobs": logprobs})
                }
                Kind::Chat => {
                    let (content, calls) = match &r.tools {
                        Some(t) => t.extract(&text, e.finish == ferry_tokenize::FinishReason::Stop),
                        None => (Some(text), Vec::new()),
                    };
                    let mut message = json!({"role": "assistant", "content": content});
                    if !calls.is_empty() {
                        message["tool_calls"] = to_json(&calls, false);
                    }
                    json!({"index": i, "message": message, "finish_reason": finish_reason(&e, &calls), "logprobs": logprobs})
                }
            }
        })
        .collect();
    let mut body = json!({
        "id": r.id, "object": r.object(false), "created": now(), "model": r.model, "choices": choices,
        "usage": usage.json(),
    });
    let mut resp = ([(header::CONTENT_TYPE, "application/json")], String::new()).into_response();
    if r.phases {
        body["ferry_phases"] = phases(&e);
        if let Ok(v) = header::HeaderValue::from_str(&ferry_cluster::phases::header_value(&e.phases)) {
            resp.headers_mut().insert(PHASES, v);
        }
    }
    *resp.body_mut() = body.to_string().into();
    resp
}

/// `tool_calls` when the answer ended by itself with calls, else the finish reason.
fn finish_reason(e: &End, calls: &[Call]) -> &'static str {
    match e.finish {
        ferry_tokenize::FinishReason::Stop if !calls.is_empty() => "tool_calls",
        f => f.as_str(),
    }
}

/// A streamed choice's state.
struct Streamed {
    /// Its first chunk is still to go (it carries the role, an echo's prompt).
    first: bool,
    /// A completion's text offset, from chunk to chunk.
    offset: usize,
    /// Text held back while it may be a tool call.
    holdback: Option<Holdback>,
}

pub(super) fn sse(
    s: impl Stream<Item = Result<Piece, RouterError>> + Send + 'static,
    r: Reply,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let created = now();
    let mut choices: Vec<Streamed> = (0..r.choices())
        .map(|_| Streamed { first: true, offset: 0, holdback: r.tools.clone().map(Holdback::new) })
        .collect();
    // A prompt's logprobs (`echo`) come with its first sequence's first piece; each of its
    // choices' first chunk shows them.
    let mut prompt: Vec<Vec<Scored>> = vec![Vec::new(); r.prompts];
    // Sequences ended, and the usage so far: the chunk ending the last carries it.
    let (mut ended, mut usage) = (0, Usage::new(r.prompts));
    let events = s
        .map(move |p| {
            let data = match p {
                Ok(mut p) => {
                    let Some(c) = choices.get_mut(p.index as usize) else {
                        let e = RouterError::Internal(format!("a piece of sequence {}", p.index));
                        return Ok(Event::default().data(error_json(&e).to_string()));
                    };
                    if r.prompt_only() {
                        (p.text, p.tokens) = (String::new(), Vec::new());
                        if let Some(e) = &mut p.end {
                            (e.completion_tokens, e.finish) = (0, ferry_tokenize::FinishReason::Length);
                        }
                    }
                    let (first, i) = (c.first, p.index as usize);
                    let g = r.prompt_of(i);
                    if first && let Some(echo) = r.echo(i) {
                        p.text.insert_str(0, &echo.text);
                    }
                    if !p.prompt.is_empty() {
                        prompt[g] = std::mem::take(&mut p.prompt);
                    }
                    let mut finish = p.end.as_ref().map(|e| e.finish.as_str());
                    let logprobs = r.logprobs(i, &p.tokens, first.then_some(&prompt[g][..]), &mut c.offset);
                    let (mut text, mut calls) = (p.text.clone(), Vec::new());
                    if let Some(h) = &mut c.holdback {
                        text = h.push(&p.text);
                        if let Some(e) = &p.end {
                            let (rest, found) = h.finish(e.finish == ferry_tokenize::FinishReason::Stop);
                            text.push_str(&rest.unwrap_or_default());
                            finish = Some(finish_reason(e, &found));
                            calls = found;
                        }
                    }
                    let index = p.index;
                    let choice = match r.kind {
                        Kind::Completion => {
                            json!({"index": index, "text": p.text, "finish_reason": finish, "logprobs": logprobs})
                        }
                        Kind::Chat => {
                            let mut delta = if first {
                                json!({"role": "assistant", "content": text})
                            } else {
                                json!({"content": text})
                            };
                            if !calls.is_empty() {
                                delta["tool_calls"] = to_json(&calls, true);
                            }
                            json!({"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs})
                        }
                    };
                    c.first = false;
                    let mut chunk = json!({
                        "id": r.id, "object": r.object(true), "created": created, "model": r.model, "choices": [choice],
                    });
                    if let Some(e) = p.end {
                        ended += 1;
                        usage.add(g, &e);
                        if ended == r.choices() {
                            chunk["usage"] = usage.json();
                            if r.phases {
                                chunk["ferry_phases"] = phases(&e);
                            }
                        }
                    }
                    chunk
                }
                Err(e) => error_json(&e),
            };
            Ok(Event::default().data(data.to_string()))
        })
        .chain(futures::stream::once(async { Ok(Event::default().data("[DONE]")) }));
    Sse::new(events)
}

/// An error as a streamed event's data.
fn error_json(e: &RouterError) -> serde_json::Value {
    json!({"error": {"message": e.to_string(), "type": e.http().1, "code": e.reason()}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(index: u32, text: &str) -> Result<Piece, RouterError> {
        Ok(Piece { index, text: text.into(), tokens: Vec::new(), prompt: Vec::new(), end: None })
    }

    #[tokio::test]
    async fn a_batch_numbers_its_prompts_choices_on_and_ends_at_its_first_error() {
        let a = futures::stream::iter([piece(0, "a0"), piece(1, "a1")]).boxed();
        let b = futures::stream::iter([piece(1, "b1"), piece(0, "b0")]).boxed();
        let mut got: Vec<(u32, String)> =
            merged(vec![a, b], 2).map(|p| p.map(|p| (p.index, p.text)).expect("a piece")).collect().await;
        got.sort();
        let want = [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")].map(|(i, t)| (i, t.to_string()));
        assert_eq!(got, want);

        let failing = futures::stream::iter([piece(0, "x"), Err(RouterError::Internal("broke".into()))]).boxed();
        let endless = futures::stream::repeat_with(|| piece(0, "y")).boxed();
        let out: Vec<_> = merged(vec![failing, endless], 1).take(10_000).collect().await;
        assert!(out.len() < 10_000, "the stream ended");
        assert!(out.last().is_some_and(Result::is_err), "with the error");
        assert_eq!(out.iter().filter(|r| r.is_err()).count(), 1);
    }
}
