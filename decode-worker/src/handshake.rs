//! Handshakes with prefill nodes: after preallocating a room's pages, the decode node tells
//! the prefill node where they are (`Bootstrap.Handshake`). Runs on the async runtime; a
//! failure goes back to the engine thread, which frees the room.

use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::dial::Channels;
use ferry_cluster::mtls::InternalTls;
use ferry_cluster::roles::PeerRole;
use ferry_cluster::{LayoutDescriptor, Room, RoomKey};
use ferry_proto::v1 as pb;
use tonic::Code;
use tracing::Instrument as _;

use crate::cmd::Cmd;
use crate::error::DecodeError;
use ferry_worker::EngineLink;

/// One handshake to make.
#[derive(Debug, Clone)]
pub struct HandshakeJob {
    /// The room.
    pub room: Room,
    /// Its key.
    pub key: RoomKey,
    /// The prefill node's bootstrap address.
    pub bootstrap: String,
    /// Preallocated destination pages, in prompt order, after the held ones.
    pub dest: Vec<u32>,
    /// Leading prompt pages this node's prefix cache holds: not sent (delta transfer).
    pub held: u32,
    /// Where pages are to be sent.
    pub data_endpoint: String,
    /// Our transfer backend.
    pub backend: &'static str,
    /// Our KV layout.
    pub layout: LayoutDescriptor,
    /// The request's span.
    pub span: tracing::Span,
    /// The request's trace context on this node (the handshake call's parent).
    pub trace: ferry_cluster::TraceContext,
}

/// Starts handshakes and keeps one gRPC channel per prefill node ([`Channels`]: connecting
/// within the handshake timeout, a prefill address that never answers delays only the
/// handshakes sent to it).
#[derive(Clone)]
pub struct Handshakes {
    rt: tokio::runtime::Handle,
    channels: Arc<Channels>,
    engine: EngineLink<Cmd>,
    timeout: Duration,
}

impl Handshakes {
    /// Handshakes on `rt` (over mutual TLS when `tls` is given), reporting failures to
    /// `engine`, each bounded by `timeout`.
    pub fn new(
        rt: tokio::runtime::Handle,
        engine: EngineLink<Cmd>,
        timeout: Duration,
        tls: Option<Arc<InternalTls>>,
    ) -> Self {
        Self { rt, channels: Arc::new(Channels::new(PeerRole::Prefill, tls, timeout)), engine, timeout }
    }

    /// Starts `job` in the background.
    pub fn start(&self, job: HandshakeJob) {
        let me = self.clone();
        let span = job.span.clone();
        self.rt.spawn(
            async move {
                let room = job.room;
                let r = tokio::time::timeout(me.timeout, me.call(job)).await;
                let why = match r {
                    Ok(Ok(())) => return,
                    Ok(Err(why)) => why,
                    Err(_) => DecodeError::HandshakeTimeout,
                };
                me.engine.report(Cmd::HandshakeFailed { room, why });
            }
            .instrument(span),
        );
    }

    async fn call(&self, job: HandshakeJob) -> Result<(), DecodeError> {
        // Under mutual TLS the bootstrap address must present a prefill worker's certificate.
        let ch =
            self.channels.get(&job.bootstrap).map_err(|e| DecodeError::invalid("bad_bootstrap_addr", e.to_string()))?;
        let req = pb::HandshakeRequest {
            room: Some(ferry_cluster::wire::room_key_to_proto(&job.key)),
            dest_pages: job.dest,
            data_endpoint: job.data_endpoint,
            transfer_backend: job.backend.to_string(),
            layout: Some(ferry_cluster::wire::layout_to_proto(&job.layout)),
            registration: Vec::new(),
            held_pages: job.held,
        };
        let req = ferry_cluster::traces::request_with(req, &job.trace);
        match pb::bootstrap_client::BootstrapClient::new(ch).handshake(req).await {
            Ok(_) => Ok(()),
            // The channel connects on first use: a connect failure is this call's.
            Err(s) if s.code() == Code::Unavailable && s.message().contains("transport error") => {
                self.channels.forget(&job.bootstrap);
                Err(DecodeError::PrefillUnreachable(format!("prefill node {}: {}", job.bootstrap, s.message())))
            }
            // A connection that broke or never answered (HTTP/2 keepalive unanswered: a
            // frozen host, a port that accepts and says nothing) is not a refusal.
            Err(s) if s.code() == Code::Unavailable => {
                self.channels.forget(&job.bootstrap);
                let why = format!("prefill node {} did not answer the handshake: {}", job.bootstrap, s.message());
                Err(DecodeError::PrefillUnreachable(why))
            }
            Err(s) => Err(DecodeError::HandshakeRefused { code: s.code(), message: s.message().to_string() }),
        }
    }
}
