//! The public gRPC service `ferry.v1.Router`.

use std::pin::Pin;
use std::sync::Arc;

use ferry_cluster::phases::PhaseClock;
use ferry_cluster::wire;
use ferry_proto::v1 as pb;
use ferry_tokenize::ChatMessage;
use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::generate::{Ctx, Prepared};

/// `ferry.v1.Router`.
pub struct RouterSvc(pub Arc<Ctx>);

type Out = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

fn bad(reason: &'static str, message: impl Into<String>) -> Status {
    ferry_cluster::Refused::invalid(reason, message).status("router")
}

fn chat(ctx: &Ctx, messages: &[pb::ChatMessage]) -> Result<Vec<u32>, Status> {
    let msgs: Vec<ChatMessage> = messages.iter().map(|m| ChatMessage::new(m.role.clone(), m.content.clone())).collect();
    let t = ctx.model.tokenizer.chat_template().map_err(|e| bad("no_chat_template", e.to_string()))?;
    let text = t.render(&msgs, true).map_err(|e| bad("bad_chat", e.to_string()))?;
    encode(ctx, &text)
}

fn encode(ctx: &Ctx, text: &str) -> Result<Vec<u32>, Status> {
    ctx.encode(text).map_err(|e| bad("tokenize", e.to_string()))
}

impl RouterSvc {
    /// A text or chat prompt's tokens, computed off the async threads
    /// ([`crate::offload`]); busy: RESOURCE_EXHAUSTED.
    async fn tokens(&self, input: Input) -> Result<Vec<u32>, Status> {
        let ctx = Arc::clone(&self.0);
        let bytes = match &input {
            Input::Text(t) => t.len(),
            Input::Chat(c) => c.iter().map(|m| m.role.len() + m.content.len()).sum(),
        };
        let job = move || match input {
            Input::Text(t) => encode(&ctx, &t),
            Input::Chat(c) => chat(&ctx, &c),
        };
        crate::offload::Pool::global().run_sized(bytes, job).await.map_err(|busy| {
            metrics::counter!(ferry_cluster::metrics::BAD_REQUESTS, "role" => "router", "reason" => "tokenizer_busy")
                .increment(1);
            Status::resource_exhausted(busy.to_string())
        })?
    }
}

/// The status ending a stream with the `ferry-phases` trailer.
fn phases_trailer(phases: &[(&str, f64)]) -> Option<Result<pb::GenerateResponse, Status>> {
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert("ferry-phases", ferry_cluster::phases::header_value(phases).parse().ok()?);
    Some(Err(Status::with_metadata(tonic::Code::Ok, "", md)))
}

/// A prompt to tokenize.
enum Input {
    Text(String),
    Chat(Vec<pb::ChatMessage>),
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterSvc {
    type GenerateStream = Out;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<Out>, Status> {
        let trace = ferry_cluster::traces::from_metadata(req.metadata());
        let mut clock = PhaseClock::start("router", std::time::Instant::now());
        let r = req.into_inner();
        // Before any work for the request: the id is echoed and logged, stops scanned per token.
        let id = crate::limits::check_request_id(r.request_id).map_err(|e| bad(e.reason, e.message))?;
        self.0.limits.check_stop(&r.stop).map_err(|e| bad(e.reason, e.message))?;
        // Admitted before tokenizing or compiling anything: work for a request the router
        // cannot run now is not done.
        let slot = self.0.admission.admit().await.map_err(|e| e.status())?;
        clock.lap("queue", std::time::Instant::now());
        let tokens = match r.prompt {
            Some(pb::generate_request::Prompt::Text(t)) => self.tokens(Input::Text(t)).await?,
            Some(pb::generate_request::Prompt::Chat(c)) => self.tokens(Input::Chat(c.messages)).await?,
            Some(pb::generate_request::Prompt::TokenIds(t)) => t.ids,
            None => return Err(bad("empty_prompt", "the prompt is missing")),
        };
        let sampling = wire::sampling_from_proto(r.sampling);
        let counted = |e: crate::error::RouterError| {
            metrics::counter!(ferry_cluster::metrics::BAD_REQUESTS, "role" => "router", "reason" => e.reason().to_string())
                .increment(1);
            e.status()
        };
        self.0.validate(&tokens, &sampling).map_err(counted)?;
        let sampling = if sampling.constraint.is_some() {
            let ctx = Arc::clone(&self.0);
            let job = move || ctx.check_constraint(&sampling).map(|()| sampling);
            crate::offload::Pool::global()
                .run(job)
                .await
                .map_err(|b| Status::resource_exhausted(b.to_string()))?
                .map_err(counted)?
        } else {
            sampling
        };
        clock.lap("tokenize", std::time::Instant::now());
        let (ids, phases, n) = (r.return_token_ids, r.return_phases, sampling.n.max(1));
        let prepared = Prepared { request_id: id.clone(), tokens, sampling, stop: r.stop, trace, clock: Some(clock) };
        // Sequences ended: the last to end carries the request's phases.
        let mut ended = 0;
        // The one mapping of the router's errors to gRPC. The last message is followed, when
        // asked, by the phases as trailing metadata: a stream's trailers go out with its status,
        // and an OK status carrying them ends the stream as its end would.
        let out = self.0.generate(prepared, slot).await.map_err(|e| e.status())?.flat_map(move |p| {
            let mut trailer = None;
            let m = p.map_err(|e| e.status()).map(|p| {
                let mut m = pb::GenerateResponse {
                    request_id: id.to_string(),
                    text: p.text,
                    index: p.index,
                    ..Default::default()
                };
                if ids {
                    m.token_ids = p.tokens.iter().map(|t| t.id).collect();
                }
                m.logprobs = p.tokens.iter().map(|t| pb::TokenLogprob { token_id: t.id, logprob: t.logprob }).collect();
                if p.tokens.iter().any(|t| !t.top.is_empty()) {
                    m.top_logprobs = p.tokens.iter().map(|t| wire::top_to_proto(&t.top)).collect();
                }
                if !p.prompt.is_empty() {
                    let prompt: Vec<wire::PromptLogprob> =
                        p.prompt.iter().map(|t| (t.id, t.logprob, t.top.clone())).collect();
                    (m.prompt_logprobs, m.prompt_top_logprobs) = wire::prompt_to_proto(&prompt);
                }
                if let Some(e) = p.end {
                    m.finish_reason = wire::finish_to_proto(e.finish) as i32;
                    m.prompt_tokens = e.prompt_tokens;
                    m.completion_tokens = e.completion_tokens;
                    m.cached_tokens = e.cached_tokens;
                    ended += 1;
                    if phases && ended == n {
                        m.phases = wire::phases_to_proto(&e.phases);
                        trailer = phases_trailer(&e.phases);
                    }
                }
                m
            });
            futures::stream::iter(std::iter::once(m).chain(trailer))
        });
        Ok(Response::new(Box::pin(out)))
    }

    async fn tokenize(&self, req: Request<pb::TokenizeRequest>) -> Result<Response<pb::TokenizeResponse>, Status> {
        // A slot of the admission queue while it tokenizes, as a request would take.
        let _slot = self.0.admission.admit().await.map_err(|e| e.status())?;
        let token_ids = match req.into_inner().input {
            Some(pb::tokenize_request::Input::Text(t)) => self.tokens(Input::Text(t)).await?,
            Some(pb::tokenize_request::Input::Chat(c)) => self.tokens(Input::Chat(c.messages)).await?,
            None => return Err(bad("empty_input", "nothing to tokenize")),
        };
        Ok(Response::new(pb::TokenizeResponse { token_ids }))
    }

    async fn list_workers(
        &self,
        _req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        let w = self.0.workers.snapshot();
        let info = |x: &crate::workers::Worker, role: pb::WorkerRole| pb::WorkerInfo {
            worker_id: x.id.to_string(),
            role: role as i32,
            address: x.addr.clone(),
            healthy: x.healthy(),
            load: x.load(),
        };
        let mut workers: Vec<pb::WorkerInfo> =
            w.prefill.iter().flatten().map(|x| info(x, pb::WorkerRole::Prefill)).collect();
        workers.extend(w.decode.iter().map(|x| info(x, pb::WorkerRole::Decode)));
        Ok(Response::new(pb::ListWorkersResponse { workers }))
    }
}
