//! The decode daemon's gRPC services: `Decode` (a token stream per request) and `Load`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use parking_lot::Mutex;

use ferry_cluster::{Refused, RequestId, wire};
use ferry_proto::v1 as pb;
use ferry_transfer::room::FailReason;
use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};

use crate::cmd::{Cmd, Generate, Load};
use crate::error::DecodeError;
use crate::queues::Refusal;
use crate::wake;
use ferry_worker::EngineLink;

/// The role this daemon's metrics and refusals name.
pub(crate) const ROLE: &str = "decode";

/// Every decode failure's gRPC code and stable reason (`ferry-reason`), decided here once.
impl From<DecodeError> for Refused {
    fn from(e: DecodeError) -> Self {
        use DecodeError as E;
        use tonic::Code;
        let (code, reason) = match &e {
            E::Invalid { reason, .. } => (Code::InvalidArgument, *reason),
            E::Refused { why, .. } => (
                match why {
                    Refusal::NOverBatch { .. } | Refusal::OverPool { .. } => Code::OutOfRange,
                    Refusal::ForkConstraints { .. } => Code::Internal,
                    Refusal::DuplicateRoom | Refusal::RoomClosing => Code::AlreadyExists,
                },
                why.label(),
            ),
            E::Aborted(_) => (Code::Aborted, "aborted"),
            E::WrongSecret(_) => (Code::PermissionDenied, "wrong_secret"),
            E::ClientGone => (Code::Cancelled, "client_cancelled"),
            E::ShuttingDown => (Code::Unavailable, "shutting_down"),
            E::NoRoom => (Code::ResourceExhausted, "no_room"),
            E::Timeout(_) => (Code::DeadlineExceeded, "timeout"),
            E::OutOfPages(_) => (Code::ResourceExhausted, "out_of_pages"),
            E::Transfer(r) => (
                match r {
                    FailReason::Timeout(_) => Code::DeadlineExceeded,
                    FailReason::Aborted(_) => Code::Aborted,
                    FailReason::Corrupt(_) | FailReason::PeerGone(_) => Code::Unavailable,
                    FailReason::Refused(_) => Code::FailedPrecondition,
                },
                r.label(),
            ),
            E::RoomRefused(r) => (
                match r {
                    ferry_transfer::table::Refusal::DuplicateRoom | ferry_transfer::table::Refusal::RoomClosing => {
                        Code::AlreadyExists
                    }
                    _ => Code::Internal,
                },
                "room_refused",
            ),
            E::RoomLost => (Code::Internal, "room_lost"),
            E::PrefillUnreachable(_) => (Code::Unavailable, "prefill_unreachable"),
            E::HandshakeTimeout => (Code::DeadlineExceeded, "handshake_timeout"),
            E::HandshakeRefused { code, .. } => (*code, "handshake_refused"),
            E::NoSuchRoom(_) => (Code::NotFound, "no_room"),
            E::NotTransferring(_) => (Code::FailedPrecondition, "not_transferring"),
            E::BackendMismatch(_) => (Code::FailedPrecondition, "backend_mismatch"),
            E::PullFailed(_) => (Code::Unavailable, "pull_failed"),
            E::PullSpoiled(_) => (Code::Aborted, "pull_spoiled"),
            E::Internal { reason, .. } => (Code::Internal, *reason),
        };
        Refused::new(code, reason, e.to_string())
    }
}

/// `e` as a status, counted among the calls this daemon refused.
pub(crate) fn refused(e: impl Into<DecodeError>) -> Status {
    Refused::from(e.into()).status(ROLE)
}

/// What every handler shares.
pub struct Shared {
    /// Commands to the engine thread.
    pub engine: EngineLink<Cmd>,
    /// This worker's id.
    pub worker: ferry_cluster::WorkerId,
    /// The latest load figures.
    pub load: Arc<Mutex<Load>>,
    /// The model's constraint compiler (structured outputs).
    pub grammars: Arc<ferry_engine::Grammars>,
}

use ferry_worker::answer;

/// `ferry.v1.Decode`.
pub struct DecodeSvc(pub Arc<Shared>);

type TokenStream = Pin<Box<dyn Stream<Item = Result<pb::DecodeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeSvc {
    type GenerateStream = TokenStream;

    async fn generate(&self, req: Request<pb::DecodeRequest>) -> Result<Response<TokenStream>, Status> {
        let caller = ferry_cluster::traces::from_metadata(req.metadata());
        let r = req.into_inner();
        let key = wire::room_key(r.room).map_err(refused)?;
        let (span, trace) = ferry_cluster::traces::request_span(ROLE, &RequestId::new(r.request_id), key.room, caller);
        tracing::debug!(parent: &span, prompt_tokens = r.token_ids.len(), "decode request");
        let params = wire::sampling_from_proto(r.sampling);
        let guide = ferry_worker::compile_guide(&self.0.grammars, &params, ROLE).await?;
        // Each other sequence of a request with n > 1 gets its own (a cache hit).
        let mut forks = Vec::new();
        for _ in 1..params.n.max(1) {
            forks.push(if guide.is_some() {
                ferry_worker::compile_guide(&self.0.grammars, &params, ROLE).await?
            } else {
                None
            });
        }
        let bootstrap = (!r.prefill_bootstrap_addr.is_empty()).then_some(r.prefill_bootstrap_addr);
        let (out, rx) = mpsc::unbounded_channel();
        let (accepted, ok) = oneshot::channel();
        let incarnation = wake::next_incarnation();
        // Made before the request goes in: a call dropped while waiting for acceptance ends it
        // too.
        let gone = wake::Gone::new(self.0.engine.clone(), key.room, incarnation);
        let g = Generate {
            key,
            incarnation,
            bootstrap,
            prompt: r.token_ids,
            params,
            guide,
            forks,
            out,
            accepted,
            span,
            trace,
        };
        self.0.engine.send(Cmd::Generate(Box::new(g)))?;
        answer(ok, ROLE).await?;
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |m| {
            // The stream owns the guard: dropping the stream tells the engine.
            let _ = &gone;
            match m {
                Ok(e) => {
                    let mut m = wire::token_to_proto(e.sampled.token, e.sampled.logprob, &e.sampled.top, e.finish);
                    m.phases = wire::phases_to_proto(&e.phases);
                    m.index = e.index;
                    m.cached_tokens = e.cached;
                    if !e.prompt.is_empty() {
                        let prompt: Vec<wire::PromptLogprob> =
                            e.prompt.iter().map(|s| (s.token, s.logprob, s.top.clone())).collect();
                        (m.prompt_logprobs, m.prompt_top_logprobs) = wire::prompt_to_proto(&prompt);
                    }
                    Ok(m)
                }
                Err(e) => Err(Refused::from(e).into_status()),
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn abort(&self, req: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let r = req.into_inner();
        let key = wire::room_key(r.room).map_err(refused)?;
        let (reply, rx) = oneshot::channel();
        let sequence = r.sequence;
        self.0.engine.send(Cmd::Abort { room: key.room, secret: key.secret, reason: r.reason, sequence, reply })?;
        Ok(Response::new(pb::AbortResponse { found: answer(rx, ROLE).await? }))
    }
}

/// `ferry.v1.Load`.
pub struct LoadSvc(pub Arc<Shared>);

#[tonic::async_trait]
impl pb::load_server::Load for LoadSvc {
    async fn report(&self, _req: Request<pb::LoadRequest>) -> Result<Response<pb::LoadReport>, Status> {
        let l = self.0.load.lock().clone();
        let depth: HashMap<String, u32> = l.depth.iter().map(|&(k, v)| (k.to_string(), v as u32)).collect();
        Ok(Response::new(pb::LoadReport {
            worker_id: self.0.worker.to_string(),
            queue_depth: depth,
            // Admissible pages, the prefix cache's evictable ones apart (as a prefill
            // worker's: free + evictable is what a request can be given).
            free_pages: l.admissible_pages.saturating_sub(l.evictable_pages) as u32,
            evictable_pages: l.evictable_pages.min(l.admissible_pages) as u32,
            total_pages: l.total_pages as u32,
            queued_prefill_tokens: 0,
            prefill_tokens_per_second: 0.0,
        }))
    }
}
