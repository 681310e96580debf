//! Following a worker's KV events into its role's prefix index: subscribe with a snapshot,
//! apply batches in sequence, resubscribe after any gap, epoch change or error.
//!
//! Placements never wait for ingestion ([`SharedIndex`]: it writes the copy they are not
//! reading), but ingestion waits for ingestion: a batch is one write, and a snapshot (a
//! worker's whole cache, a million pages on a big one) [`SNAPSHOT_PAGES_PER_WRITE`] pages a
//! write, so that other workers' events go in between and placements see it arrive.

use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1 as pb;

use super::Worker;
use crate::index::{Event, SharedIndex};

/// Why the router stops following a worker's KV event stream and resubscribes.
#[derive(Debug, thiserror::Error)]
pub enum StreamEnd {
    /// The call or the stream failed.
    #[error("{0}")]
    Status(#[from] tonic::Status),
    /// The worker closed the stream.
    #[error("stream closed")]
    Closed,
    /// An event out of sequence: a gap, or a new epoch without a snapshot.
    #[error("gap: {at:?} then {sequence} in epoch {epoch}")]
    Gap {
        /// (epoch, sequence) applied last.
        at: Option<(u64, u64)>,
        /// The event's sequence.
        sequence: u64,
        /// The batch's epoch.
        epoch: u64,
    },
    /// The index refused an event (a parent it does not know: a gap).
    #[error("{0}")]
    Index(#[from] crate::index::IndexError),
    /// The worker left the cluster meanwhile.
    #[error("left the cluster")]
    LeftCluster,
}

/// The largest KV event batch the router takes from a worker. A snapshot of a worker's whole
/// cache is one batch, ~60 MB for a million pages of 16 tokens: tonic's default (4 MB)
/// refused any cache past ~80,000 pages, and the router resubscribed forever.
pub const MAX_EVENT_BATCH_BYTES: usize = 1 << 30;

/// Snapshot pages applied per write of the index (~0.5 ms of work per copy).
pub const SNAPSHOT_PAGES_PER_WRITE: usize = 4096;

/// Keeps `index` fed with worker `slot`'s KV events, forever: subscribes with a
/// snapshot, applies batches in sequence, and on any gap, epoch change or error forgets the
/// worker's entries and resubscribes.
pub async fn follow_events(w: Arc<Worker>, slot: usize, index: Arc<SharedIndex>) {
    let member = || w.member.load(std::sync::atomic::Ordering::SeqCst);
    while member() {
        if let Err(why) = follow_once(&w, slot, &index).await {
            tracing::debug!(worker = %w.id, %why, "KV event stream ended; resyncing");
        }
        let _ = index.clear_worker(slot, member);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn follow_once(w: &Worker, slot: usize, index: &SharedIndex) -> Result<(), StreamEnd> {
    let mut c =
        pb::kv_events_client::KvEventsClient::new(w.channel.clone()).max_decoding_message_size(MAX_EVENT_BATCH_BYTES);
    let req = pb::SubscribeRequest { epoch: 0, after_sequence: 0, want_snapshot: true };
    let mut stream = c.subscribe(req).await?.into_inner();
    let mut at: Option<(u64, u64)> = None; // (epoch, last sequence)
    // Applied only while the worker is still a member, asked with ingestion shut out: a worker
    // removed has its entries cleared by a later write, and nothing of it may follow.
    let member = || w.member.load(std::sync::atomic::Ordering::SeqCst);
    while let Some(batch) = stream.message().await? {
        apply_batch(index, slot, batch, &mut at, &member)?;
    }
    Err(StreamEnd::Closed)
}

/// Checks that `e` follows `at` (the (epoch, last sequence) applied so far; None: nothing yet,
/// so it must be a snapshot) and moves `at` to it.
fn in_sequence(at: &mut Option<(u64, u64)>, epoch: u64, e: &pb::KvEvent) -> Result<(), StreamEnd> {
    let fresh = match (*at, &e.kind) {
        (_, Some(pb::kv_event::Kind::Snapshot(_))) => true,
        (Some((was, seq)), _) => was == epoch && e.sequence == seq.wrapping_add(1),
        (None, _) => false,
    };
    if !fresh {
        return Err(StreamEnd::Gap { at: *at, sequence: e.sequence, epoch });
    }
    *at = Some((epoch, e.sequence));
    Ok(())
}

/// Applies one batch of worker `slot`'s KV events to `ix`, in sequence, while `admit()` (asked
/// at each write, with ingestion shut out) says so: `at` is the (epoch, last sequence) applied
/// so far (None: nothing yet, so the batch must start with a snapshot). A gap, an epoch
/// change without a snapshot, an event the index refuses or a refusal to admit is an error,
/// after which the caller forgets the worker's entries and resubscribes.
pub fn apply_batch(
    ix: &SharedIndex,
    slot: usize,
    batch: pb::KvEventBatch,
    at: &mut Option<(u64, u64)>,
    admit: &dyn Fn() -> bool,
) -> Result<(), StreamEnd> {
    let write = |events: Vec<Event>| match ix.apply(events, admit) {
        Ok(true) => Ok(()),
        Ok(false) => Err(StreamEnd::LeftCluster),
        Err(e) => Err(StreamEnd::Index(e)),
    };
    let stored = |s: pb::KvStored| Event::Stored {
        worker: slot,
        parent: s.parent_hash,
        hashes: s.page_hashes,
        tokens: s.token_ids,
    };
    let mut run = Vec::new();
    for e in batch.events {
        in_sequence(at, batch.epoch, &e)?;
        match e.kind {
            Some(pb::kv_event::Kind::Stored(s)) => run.push(stored(s)),
            Some(pb::kv_event::Kind::Removed(r)) => run.push(Event::Removed { worker: slot, hashes: r.page_hashes }),
            Some(pb::kv_event::Kind::Snapshot(all)) => {
                run.push(Event::Clear { worker: slot });
                let mut pages = 0;
                for s in all.pages {
                    pages += s.page_hashes.len().max(1);
                    run.push(stored(s));
                    if pages >= SNAPSHOT_PAGES_PER_WRITE {
                        write(std::mem::take(&mut run))?;
                        pages = 0;
                    }
                }
            }
            None => {}
        }
    }
    write(run)
}
