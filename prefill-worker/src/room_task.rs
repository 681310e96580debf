//! A room's transfer task: sends the chunks the engine hands it, in order, and reports the
//! end (success, failure, or abandonment) back to the engine thread.

use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::{Room, RoomSecret};
use ferry_transfer::frame::Aux;
use ferry_transfer::memory::HostPages;
use ferry_transfer::{SendRoom, Sender};
use tokio::sync::mpsc;

use crate::cmd::{Cmd, Reconnect};
use crate::error::TaskError;
use crate::service::SenderPool;

/// One chunk's pages for a room task.
pub(crate) struct ChunkMsg {
    /// Index of the first page in the room's destination list.
    pub first: usize,
    /// The pages, in prompt order.
    pub pages: Vec<u32>,
    /// Set on the last chunk: the first token and the room echo.
    pub last: Option<Aux>,
}

/// What a room's task needs besides the room.
pub(crate) struct RoomTask {
    /// The memory pages are sent from.
    pub mem: Arc<HostPages>,
    /// Where the end is reported.
    pub engine: ferry_worker::EngineLink<Cmd>,
    /// Longest wait for one chunk's progress.
    pub limit: Duration,
    /// The senders, to evict this one when it breaks.
    pub senders: Arc<SenderPool>,
    /// The sender to the room's decode node.
    pub sender: Arc<Sender>,
    /// That node's data plane, to abort the room over a new connection when this one breaks.
    pub reconnect: Reconnect,
    /// The room's secret (an abort carries it).
    pub secret: RoomSecret,
}

impl RoomTask {
    /// Aborts the room on the decode node over a new connection (the pool's, once the broken
    /// one is evicted).
    async fn abort_anew(&self, room: Room, why: &str) -> std::io::Result<()> {
        let r = &self.reconnect;
        let fresh = self.senders.get(r.kind, &r.endpoint, &self.mem, &r.cfg, (room, &self.secret)).await?;
        fresh.abort(room, self.secret, &format!("the prefill node's connection broke: {why}")).await
    }

    /// Sends one room's chunks in order; aborts the room when the engine drops the channel
    /// before the last chunk, or when a chunk makes no progress within the transfer timeout;
    /// reports the end to the engine.
    pub(crate) async fn run(self, mut room: SendRoom, mut chunks: mpsc::UnboundedReceiver<ChunkMsg>) {
        let id = room.id();
        let limit = self.limit;
        let result = loop {
            let Some(msg) = chunks.recv().await else {
                // Bounded: a peer that stopped reading must not hold the room (or a shutdown) up.
                let _ = tokio::time::timeout(limit, room.abort("the prefill node abandoned the room")).await;
                break Err(TaskError::Abandoned);
            };
            let last = msg.last.is_some();
            match tokio::time::timeout(limit, room.send(msg.first, &msg.pages, &self.mem, msg.last)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.senders.evict(&self.sender);
                    let why = format!("{e:?}");
                    let e = TaskError::Send(e);
                    // The decode node would otherwise wait for the rest of the room until its
                    // own timeouts (a direct caller has no router to cancel its call).
                    let told = tokio::time::timeout(limit, self.abort_anew(id, &why)).await;
                    if !matches!(told, Ok(Ok(()))) {
                        tracing::debug!(room = %id, "the abort did not reach the decode node; it will time out");
                    }
                    break Err(e);
                }
                Err(_) => {
                    let _ = tokio::time::timeout(limit, room.abort("transfer stalled")).await;
                    break Err(TaskError::Stalled(limit));
                }
            }
            if last {
                break Ok(());
            }
            self.engine.report(Cmd::Progress { room: id });
        };
        self.engine.report(Cmd::Sent { room: id, result });
    }
}
