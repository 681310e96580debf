//! `ferry.v1.KvEvents`, as every worker with a prefix cache serves it (prefill nodes; decode
//! nodes, whose cache holds finished conversations): a snapshot of the cache, then its events
//! as the engine publishes them. The router follows both into its prefix indexes.

use std::pin::Pin;
use std::sync::Arc;

use ferry_cluster::{Shutdown, WorkerId, wire};
use ferry_proto::v1 as pb;
use ferry_radix::events::KvEvent;
use futures::Stream;
use tokio::sync::{broadcast, oneshot};
use tonic::{Request, Response, Status};

/// Asks the engine thread for a snapshot of its cache (the receiver gets it; an error when
/// the engine is gone).
pub type SnapshotFn = dyn Fn() -> Result<oneshot::Receiver<KvEvent>, Status> + Send + Sync;

/// The service.
pub struct KvEventsSvc {
    /// KV events as the engine publishes them.
    pub events: broadcast::Sender<Vec<KvEvent>>,
    /// A snapshot of the cache.
    pub snapshot: Arc<SnapshotFn>,
    /// This worker's id (every batch names it).
    pub worker: WorkerId,
    /// Ends the streams when the daemon stops.
    pub shutdown: Shutdown,
}

impl KvEventsSvc {
    /// The service of a daemon whose engine, reached through `link`, answers the command
    /// `snapshot` makes with a snapshot of its cache.
    pub fn new<C: Send + 'static>(
        events: broadcast::Sender<Vec<KvEvent>>,
        link: crate::EngineLink<C>,
        snapshot: fn(oneshot::Sender<KvEvent>) -> C,
        worker: WorkerId,
        shutdown: Shutdown,
    ) -> Self {
        let snapshot = Arc::new(move || {
            let (reply, rx) = oneshot::channel();
            link.send(snapshot(reply))?;
            Ok(rx)
        });
        Self { events, snapshot, worker, shutdown }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::KvEventBatch, Status>> + Send>>;

#[tonic::async_trait]
impl pb::kv_events_server::KvEvents for KvEventsSvc {
    type SubscribeStream = EventStream;

    async fn subscribe(&self, req: Request<pb::SubscribeRequest>) -> Result<Response<EventStream>, Status> {
        let r = req.into_inner();
        // Subscribe before the snapshot, so nothing falls between them.
        let mut live = self.events.subscribe();
        let snapshot = (self.snapshot)()?.await.map_err(|_| Status::unavailable("the engine has stopped"))?;
        let epoch = snapshot.epoch;
        let worker = self.worker.clone();
        let stop = self.shutdown.clone();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<pb::KvEventBatch, Status>>(64);
        tokio::spawn(async move {
            // A subscriber that asks for a snapshot, or knows another epoch, or is behind what
            // we can replay (we keep no history), starts from the snapshot.
            let resync = r.want_snapshot || r.epoch != epoch || r.after_sequence < snapshot.sequence;
            let mut after = snapshot.sequence;
            if resync && tx.send(Ok(wire::kv_events_to_proto(&worker, epoch, &[snapshot]))).await.is_err() {
                return;
            }
            let stop = stop.wait();
            tokio::pin!(stop);
            loop {
                let next = tokio::select! {
                    () = &mut stop => return,
                    n = live.recv() => n,
                };
                match next {
                    Ok(events) => {
                        let fresh: Vec<KvEvent> = events.into_iter().filter(|e| e.sequence > after).collect();
                        let Some(last) = fresh.last() else { continue };
                        after = last.sequence;
                        if tx.send(Ok(wire::kv_events_to_proto(&worker, epoch, &fresh))).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx.send(Err(Status::data_loss(format!("{n} event batches lost; resubscribe")))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}
