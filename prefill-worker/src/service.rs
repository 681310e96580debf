//! The prefill daemon's gRPC services: `Prefill`, `Bootstrap`, `KvEvents` and `Load`. Every
//! handler converts and checks its input (through `ferry_cluster::wire`), then hands the
//! engine thread a command and awaits its answer.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use ferry_cluster::{LayoutDescriptor, Refused, RequestId, Room, RoomSecret, wire};
use ferry_proto::v1 as pb;
use ferry_transfer::BackendKind;
use ferry_transfer::backend::TransferConfig;
use ferry_transfer::memory::HostPages;
use ferry_worker::EngineLink;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use crate::cmd::{Cmd, Handshake, Load, NewRequest, Reconnect};
use crate::error::PrefillError;
use crate::rooms::Refusal;
pub use ferry_worker::senders::SenderPool;

const ROLE: &str = "prefill";

/// What every handler shares.
pub struct Shared {
    /// Commands to the engine thread.
    pub engine: EngineLink<Cmd>,
    /// This worker's id.
    pub worker: ferry_cluster::WorkerId,
    /// The KV layout decode nodes must match.
    pub layout: LayoutDescriptor,
    /// The transfer backend in use.
    pub backend: BackendKind,
    /// Its settings.
    pub transfer: TransferConfig,
    /// The page arena pages are sent from.
    pub mem: Arc<HostPages>,
    /// Senders to decode nodes.
    pub senders: Arc<SenderPool>,
    /// Longest destination page list a handshake may carry.
    pub max_dest_pages: usize,
    /// The latest load figures.
    pub load: Arc<Mutex<Load>>,
    /// The model's constraint compiler (the first token obeys the request's constraint).
    pub grammars: Arc<ferry_engine::Grammars>,
}

use ferry_worker::answer;

/// Every prefill failure's gRPC code and stable reason (`ferry-reason`), decided here once.
impl From<PrefillError> for Refused {
    fn from(e: PrefillError) -> Self {
        use PrefillError as E;
        use tonic::Code;
        let (code, reason) = match &e {
            E::Invalid { reason, .. } => (Code::InvalidArgument, *reason),
            E::Refused { why, .. } => (
                match why {
                    Refusal::WrongSecret => Code::PermissionDenied,
                    Refusal::DuplicateRoom | Refusal::DuplicateHandshake | Refusal::RoomClosing => Code::AlreadyExists,
                },
                why.label(),
            ),
            E::PromptOverPool { .. } => (Code::ResourceExhausted, "prompt_over_pool"),
            E::LayoutMismatch(_) => (Code::FailedPrecondition, "layout_mismatch"),
            E::BackendMismatch(_) => (Code::FailedPrecondition, "backend_mismatch"),
            E::DataPlaneUnreachable(_) => (Code::Unavailable, "data_plane_unreachable"),
            E::Aborted(_) => (Code::Aborted, "aborted"),
            E::ShuttingDown => (Code::Unavailable, "shutting_down"),
            E::Timeout(_) => (Code::DeadlineExceeded, "timeout"),
            E::TransferFailed(_) | E::Closed(_) => (Code::Unavailable, "transfer_failed"),
            E::Internal { reason, .. } => (Code::Internal, *reason),
        };
        Refused::new(code, reason, e.to_string())
    }
}

/// `e` as a status, counted among the calls this daemon refused.
fn refused(e: impl Into<PrefillError>) -> Status {
    Refused::from(e.into()).status(ROLE)
}

/// `ferry.v1.Prefill`.
pub struct PrefillSvc(pub Arc<Shared>);

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillSvc {
    async fn prefill(&self, req: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let caller = ferry_cluster::traces::from_metadata(req.metadata());
        let r = req.into_inner();
        let key = wire::room_key(r.room).map_err(refused)?;
        let (span, _) = ferry_cluster::traces::request_span(ROLE, &RequestId::new(r.request_id), key.room, caller);
        tracing::debug!(parent: &span, prompt_tokens = r.token_ids.len(), "prefill request");
        let sampling = wire::sampling_from_proto(r.sampling);
        let guide = ferry_worker::compile_guide(&self.0.grammars, &sampling, ROLE).await?;
        let (reply, rx) = oneshot::channel();
        let room = key.room;
        let pull_from = (!r.pull_from.is_empty()).then_some(r.pull_from);
        let new = NewRequest { tokens: r.token_ids, sampling, guide, priority: r.priority, pull_from, reply, span };
        let secret = key.secret;
        self.0.engine.send(Cmd::Request { room, secret, req: new })?;
        // If the caller goes away before the answer, the room is aborted (and its pages freed).
        let guard = AbortOnDrop { shared: Arc::clone(&self.0), room, secret, armed: true };
        let done = answer(rx, ROLE).await;
        guard.disarm();
        let done = done?;
        let prompt: Vec<wire::PromptLogprob> =
            done.prompt_logprobs.iter().map(|s| (s.token, s.logprob, s.top.clone())).collect();
        let (prompt_logprobs, prompt_top_logprobs) = wire::prompt_to_proto(&prompt);
        Ok(Response::new(pb::PrefillResponse {
            room: room.get(),
            cached_tokens: done.cached_tokens,
            first_token: Some(pb::TokenLogprob { token_id: done.first_token, logprob: done.logprob }),
            first_top: (!done.top.is_empty()).then(|| wire::top_to_proto(&done.top)),
            phases: wire::phases_to_proto(&done.phases),
            prompt_logprobs,
            prompt_top_logprobs,
        }))
    }

    async fn abort(&self, req: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let r = req.into_inner();
        let key = wire::room_key(r.room).map_err(refused)?;
        let (reply, rx) = oneshot::channel();
        self.0.engine.send(Cmd::Abort { room: key.room, secret: key.secret, reason: r.reason, reply })?;
        Ok(Response::new(pb::AbortResponse { found: answer(rx, ROLE).await? }))
    }
}

/// Aborts a room when a Prefill call is cancelled by its caller.
struct AbortOnDrop {
    shared: Arc<Shared>,
    room: Room,
    secret: RoomSecret,
    armed: bool,
}

impl AbortOnDrop {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let (reply, _) = oneshot::channel();
            let reason = "the Prefill caller went away".to_string();
            self.shared.engine.report(Cmd::Abort { room: self.room, secret: self.secret, reason, reply });
        }
    }
}

/// `ferry.v1.Bootstrap`: decode nodes announce where a room's pages go.
pub struct BootstrapSvc(pub Arc<Shared>);

#[tonic::async_trait]
impl pb::bootstrap_server::Bootstrap for BootstrapSvc {
    async fn handshake(&self, req: Request<pb::HandshakeRequest>) -> Result<Response<pb::HandshakeResponse>, Status> {
        let r = req.into_inner();
        let s = &self.0;
        let key = wire::room_key(r.room).map_err(refused)?;
        let layout = wire::layout(r.layout).map_err(refused)?;
        if let Some(why) = s.layout.mismatch(&layout) {
            return Err(refused(PrefillError::LayoutMismatch(why)));
        }
        if r.dest_pages.len() > s.max_dest_pages {
            let why = format!("{} destination pages; at most {} per room", r.dest_pages.len(), s.max_dest_pages);
            return Err(refused(PrefillError::invalid("oversize_page_list", why)));
        }
        if r.transfer_backend != s.backend.as_str() {
            let why = format!("the decode node speaks {:?}; this prefill node {}", r.transfer_backend, s.backend);
            return Err(refused(PrefillError::BackendMismatch(why)));
        }
        let room_key = (key.room, &key.secret);
        let sender = s
            .senders
            .get(s.backend, &r.data_endpoint, &s.mem, &s.transfer, room_key)
            .await
            .map_err(|e| refused(PrefillError::DataPlaneUnreachable(format!("{}: {e}", r.data_endpoint))))?;
        let (reply, rx) = oneshot::channel();
        let reconnect = Reconnect { kind: s.backend, endpoint: r.data_endpoint, cfg: s.transfer.clone() };
        let hs = Handshake { dest: r.dest_pages, held: r.held_pages as usize, sender, reconnect };
        s.engine.send(Cmd::Handshake { room: key.room, secret: key.secret, hs, reply })?;
        answer(rx, ROLE).await?;
        Ok(Response::new(pb::HandshakeResponse { room: key.room.get() }))
    }
}

/// `ferry.v1.Load`.
pub struct LoadSvc(pub Arc<Shared>);

#[tonic::async_trait]
impl pb::load_server::Load for LoadSvc {
    async fn report(&self, _req: Request<pb::LoadRequest>) -> Result<Response<pb::LoadReport>, Status> {
        let l = self.0.load.lock().clone();
        let depth = HashMap::from([
            ("bootstrap".to_string(), l.depth.0 as u32),
            ("waiting".to_string(), l.depth.1 as u32),
            ("inflight".to_string(), l.depth.2 as u32),
        ]);
        Ok(Response::new(pb::LoadReport {
            worker_id: self.0.worker.to_string(),
            queue_depth: depth,
            free_pages: l.free_pages as u32,
            evictable_pages: l.evictable_pages as u32,
            total_pages: l.total_pages as u32,
            queued_prefill_tokens: l.queued_tokens as u64,
            prefill_tokens_per_second: l.tokens_per_second,
        }))
    }
}
