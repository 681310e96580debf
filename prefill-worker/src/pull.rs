//! Pulling held pages from a decode node (issue 20). When the router lets a request pull
//! (`PrefillRequest.pull_from`: a conversation's decode node holds its earlier turns and
//! answers, which no prefill node has) and the handshake says the decode node holds more
//! leading pages than this node's cache, the engine allocates pages for the difference and a
//! [`Puller`] fetches them: it opens them as a room of this node's pull receiver (the room's
//! own id and secret), calls `Holder.Pull` on the decode node, which sends them over the data
//! plane, and waits for the room to complete. The engine then caches the pages under the
//! prompt's tokens and queues the prompt, which finds them: only the rest is computed.
//!
//! A pull that fails for any reason (refused, spoiled because the decode node let the pages
//! go, connection lost, timeout) costs only time: its pages are freed once no write into
//! them is pending, and the prompt is computed as if nothing had been pulled.

use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::dial::Channels;
use ferry_cluster::mtls::InternalTls;
use ferry_cluster::roles::PeerRole;
use ferry_cluster::{Room, RoomSecret, wire};
use ferry_engine::{NodeId, PageAlloc};
use ferry_proto::v1 as pb;
use ferry_transfer::Receiver;
use ferry_transfer::table::Outcome;
use tokio::sync::oneshot;

use crate::cmd::Cmd;
use crate::error::PullError;

/// A pull for the engine to start.
pub struct PullJob {
    /// The room (and the pull receiver's room).
    pub room: Room,
    /// Its secret.
    pub secret: RoomSecret,
    /// Which pull of the engine's this is.
    pub ticket: u64,
    /// The decode node's gRPC address.
    pub from: String,
    /// Index of the first prompt page pulled (the pages before it are cached here).
    pub first: usize,
    /// The pages they go into.
    pub pages: PageAlloc,
    /// The cache node of the pages before them, locked for the pull.
    pub node: NodeId,
    /// The prompt's tokens up to the last pulled page.
    pub tokens: Vec<u32>,
}

/// A pull that ended: the job back, with how it went.
pub struct Pulled {
    /// The job.
    pub job: PullJob,
    /// Pages received, or why not.
    pub result: Result<usize, PullError>,
}

/// Starts pulls and keeps one gRPC channel per decode node.
pub struct Puller {
    rt: tokio::runtime::Handle,
    receiver: Arc<Receiver>,
    endpoint: String,
    backend: &'static str,
    timeout: Duration,
    engine: ferry_worker::EngineLink<Cmd>,
    /// To decode nodes, whose certificates must name a decode worker.
    channels: Channels,
}

impl Puller {
    /// Pulls into `receiver` (advertised as `endpoint`, speaking `backend`), each bounded by
    /// `timeout`, reporting to `engine`.
    pub fn new(
        rt: tokio::runtime::Handle,
        (receiver, endpoint, backend): (Arc<Receiver>, String, &'static str),
        tls: Option<Arc<InternalTls>>,
        timeout: Duration,
        engine: ferry_worker::EngineLink<Cmd>,
    ) -> Self {
        let channels = Channels::new(PeerRole::Decode, tls, timeout);
        Self { rt, receiver, endpoint, backend, timeout, engine, channels }
    }

    /// Starts `job` in the background; its end comes back as [`Cmd::Pulled`].
    pub fn start(self: &Arc<Self>, job: PullJob) {
        let me = Arc::clone(self);
        self.rt.spawn(async move {
            let (room, receiver) = (job.room, &me.receiver);
            let result = match receiver.open(room, job.secret, job.pages.pages()) {
                // Another room of this id is still open here: it is not this pull's to close.
                Err(refused) => Err(PullError::ReceiverRefused(refused)),
                Ok(outcome) => {
                    let result = match tokio::time::timeout(me.timeout, me.pull(&job, outcome)).await {
                        Ok(r) => r,
                        Err(_) => Err(PullError::Timeout(me.timeout)),
                    };
                    // Complete or not, the room leaves the receiver; failed, its pages are freed
                    // only once no write into them is pending.
                    receiver.close(room);
                    if result.is_err()
                        && let Some(released) = receiver.inbox().released(room)
                    {
                        let _ = released.await;
                    }
                    result
                }
            };
            me.engine.report(Cmd::Pulled(Box::new(Pulled { job, result })));
        });
    }

    async fn pull(&self, job: &PullJob, outcome: oneshot::Receiver<Outcome>) -> Result<usize, PullError> {
        let dest = job.pages.pages().to_vec();
        let ch = self
            .channels
            .get(&job.from)
            .map_err(|e| PullError::Address { from: job.from.clone(), why: e.to_string() })?;
        let req = pb::PullRequest {
            room: Some(wire::room_key_to_proto(&ferry_cluster::RoomKey { room: job.room, secret: job.secret })),
            first_page: job.first as u32,
            dest_pages: dest.clone(),
            data_endpoint: self.endpoint.clone(),
            transfer_backend: self.backend.to_string(),
        };
        if let Err(s) = pb::holder_client::HolderClient::new(ch).pull(req).await {
            if s.code() == tonic::Code::Unavailable {
                self.channels.forget(&job.from);
            }
            return Err(PullError::Refused { from: job.from.clone(), message: s.message().to_string() });
        }
        match outcome.await {
            Ok(Outcome::Success(_)) => Ok(dest.len()),
            Ok(Outcome::Failed(why)) => Err(PullError::Transfer(why)),
            Err(_) => Err(PullError::Dropped),
        }
    }
}
