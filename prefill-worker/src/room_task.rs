//! A room's transfer task: sends the chunks the engine hands it, in order, and reports the
//! end (success, failure, or abandonment) back to the engine thread.

use std::sync::Arc;
use std::sync::mpsc::Sender as CmdSender;
use std::time::Duration;

use ferry_transfer::frame::Aux;
use ferry_transfer::memory::HostPages;
use ferry_transfer::{SendRoom, Sender};
use tokio::sync::mpsc;

use crate::engine::Cmd;
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
    pub engine: CmdSender<Cmd>,
    /// Longest wait for one chunk's progress.
    pub limit: Duration,
    /// The senders, to evict this one when it breaks.
    pub senders: Arc<SenderPool>,
    /// The sender to the room's decode node.
    pub sender: Arc<Sender>,
}

impl RoomTask {
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
                break Err("abandoned".to_string());
            };
            let last = msg.last.is_some();
            match tokio::time::timeout(limit, room.send(msg.first, &msg.pages, &self.mem, msg.last)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.senders.evict(&self.sender);
                    break Err(format!("{e:?}"));
                }
                Err(_) => {
                    let _ = tokio::time::timeout(limit, room.abort("transfer stalled")).await;
                    break Err(format!("no progress for {limit:?}"));
                }
            }
            if last {
                break Ok(());
            }
            let _ = self.engine.send(Cmd::Progress { room: id });
        };
        let _ = self.engine.send(Cmd::Sent { room: id, result });
    }
}
