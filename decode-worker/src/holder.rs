//! `ferry.v1.Holder`: a prefill node pulls the leading prompt pages a room's decode node holds
//! in its prefix cache (issue 20). The engine lends the pages ([`Cmd::Pull`]); they go on the
//! data plane — the same backends and framing as prefill → decode, the peer roles swapped
//! under mutual TLS — into the pages the prefill node allocated, as a room of its pull
//! receiver with the room's own id and secret; then the engine says whether the room held
//! them throughout ([`Cmd::PullDone`]). Only then is the pull answered with success.

use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::wire;
use ferry_proto::v1 as pb;
use ferry_transfer::BackendKind;
use ferry_transfer::backend::TransferConfig;
use ferry_transfer::frame::Aux;
use ferry_transfer::memory::HostPages;
use ferry_worker::senders::SenderPool;
use ferry_worker::{EngineLink, answer};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use crate::cmd::Cmd;
use crate::error::DecodeError;
use crate::service::{ROLE, refused};

/// What the pull handler needs.
pub struct Holder {
    /// Commands to the engine thread.
    pub engine: EngineLink<Cmd>,
    /// The transfer backend (a pull speaks the same).
    pub backend: BackendKind,
    /// Settings for pulls (mutual TLS towards prefill nodes).
    pub transfer: TransferConfig,
    /// The page arena pages are sent from.
    pub mem: Arc<HostPages>,
    /// Senders to prefill nodes' pull receivers.
    pub senders: SenderPool,
    /// Longest a pull's connect and send may take.
    pub timeout: Duration,
    /// Longest page list one pull may ask for.
    pub max_pages: usize,
}

/// `ferry.v1.Holder`.
pub struct HolderSvc(pub Arc<Holder>);

/// Tells the engine a pull ended, also when its call is dropped half way.
struct Done {
    engine: EngineLink<Cmd>,
    id: Option<u64>,
}

impl Done {
    /// Whether the room held the pages throughout.
    async fn settle(mut self) -> bool {
        let Some(id) = self.id.take() else { return false };
        let (reply, rx) = oneshot::channel();
        self.engine.send(Cmd::PullDone { id, reply }).is_ok() && rx.await.unwrap_or(false)
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let (reply, _) = oneshot::channel();
            self.engine.report(Cmd::PullDone { id, reply });
        }
    }
}

#[tonic::async_trait]
impl pb::holder_server::Holder for HolderSvc {
    async fn pull(&self, req: Request<pb::PullRequest>) -> Result<Response<pb::PullResponse>, Status> {
        let r = req.into_inner();
        let h = &self.0;
        let key = wire::room_key(r.room).map_err(refused)?;
        if r.transfer_backend != h.backend.as_str() || !matches!(h.backend, BackendKind::Tcp | BackendKind::Fake) {
            let why = format!(
                "the prefill node pulls over {:?}; this decode node sends over {}",
                r.transfer_backend, h.backend
            );
            return Err(refused(DecodeError::BackendMismatch(why)));
        }
        let n = r.dest_pages.len();
        if n == 0 || n > h.max_pages {
            let why = format!("{n} destination pages; 1 to {} per pull", h.max_pages);
            return Err(refused(DecodeError::invalid("pull_pages", why)));
        }
        let (reply, rx) = oneshot::channel();
        let (room, secret, first) = (key.room, key.secret, r.first_page as usize);
        h.engine.send(Cmd::Pull { room, secret, first, n, reply })?;
        let (id, pages) = answer(rx, ROLE).await?;
        let done = Done { engine: h.engine.clone(), id: Some(id) };
        let send = async {
            let sender = h.senders.get(h.backend, &r.data_endpoint, &h.mem, &h.transfer, (room, &secret)).await?;
            let runs = ferry_transfer::runs::coalesce(&pages, &r.dest_pages);
            let aux = Aux { first_token: 0, logprob: 0.0, room_echo: room.get(), total_pages: n as u32 };
            let sent = sender.send(room, secret, &runs, &h.mem, Some(aux)).await;
            if sent.is_err() {
                h.senders.evict(&sender);
            }
            sent
        };
        let sent = match tokio::time::timeout(h.timeout, send).await {
            Ok(r) => r,
            Err(_) => {
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("not sent within {:?}", h.timeout)))
            }
        };
        let held = done.settle().await;
        if let Err(e) = sent {
            return Err(refused(DecodeError::PullFailed(format!("{}: {e}", r.data_endpoint))));
        }
        if !held {
            return Err(refused(DecodeError::PullSpoiled(room)));
        }
        metrics::counter!(ferry_cluster::metrics::PULL_PAGES, "role" => ROLE).increment(n as u64);
        Ok(Response::new(pb::PullResponse { pages: n as u32 }))
    }
}
