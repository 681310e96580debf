//! Following a worker's KV events into its role's prefix index: subscribe with a snapshot,
//! apply batches in sequence, resubscribe after any gap, epoch change or error.
//!
//! The index is shared with every placement, so events are applied one lock hold at a time
//! and a snapshot (a worker's whole cache, a million pages on a big one) a slice of runs at a
//! time: a placement waits for at most [`SNAPSHOT_PAGES_PER_LOCK`] pages of ingestion, not for
//! the whole snapshot.

use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1 as pb;

use super::Worker;
use crate::index::{IndexError, PrefixIndex, SharedIndex};

/// The largest KV event batch the router takes from a worker. A snapshot of a worker's whole
/// cache is one batch, ~60 MB for a million pages of 16 tokens: tonic's default (4 MB)
/// refused any cache past ~80,000 pages, and the router resubscribed forever.
pub const MAX_EVENT_BATCH_BYTES: usize = 1 << 30;

/// Snapshot pages applied per hold of the index lock (~0.1 ms of work).
pub const SNAPSHOT_PAGES_PER_LOCK: usize = 1024;

/// Keeps `index` fed with worker `slot`'s KV events, forever: subscribes with a
/// snapshot, applies batches in sequence, and on any gap, epoch change or error forgets the
/// worker's entries and resubscribes.
pub async fn follow_events(w: Arc<Worker>, slot: usize, index: SharedIndex) {
    while w.member.load(std::sync::atomic::Ordering::SeqCst) {
        if let Err(why) = follow_once(&w, slot, &index).await {
            tracing::debug!(worker = %w.id, %why, "KV event stream ended; resyncing");
        }
        {
            let mut ix = index.lock();
            if w.member.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = ix.clear_worker(slot);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn follow_once(w: &Worker, slot: usize, index: &SharedIndex) -> Result<(), String> {
    let mut c =
        pb::kv_events_client::KvEventsClient::new(w.channel.clone()).max_decoding_message_size(MAX_EVENT_BATCH_BYTES);
    let req = pb::SubscribeRequest { epoch: 0, after_sequence: 0, want_snapshot: true };
    let mut stream = c.subscribe(req).await.map_err(|s| s.to_string())?.into_inner();
    let mut at: Option<(u64, u64)> = None; // (epoch, last sequence)
    // The index, locked, while the worker is still a member (a worker removed has its
    // entries cleared under this lock: nothing of it may be applied after).
    let locked = || {
        let ix = index.lock();
        if w.member.load(std::sync::atomic::Ordering::SeqCst) { Ok(ix) } else { Err("left the cluster".to_string()) }
    };
    while let Some(batch) = stream.message().await.map_err(|s| s.to_string())? {
        for e in batch.events {
            in_sequence(&mut at, batch.epoch, &e)?;
            match e.kind {
                Some(pb::kv_event::Kind::Snapshot(all)) => {
                    locked()?.clear_worker(slot).map_err(|x| x.to_string())?;
                    let mut runs = all.pages.into_iter().peekable();
                    while runs.peek().is_some() {
                        let mut ix = locked()?;
                        let mut pages = 0;
                        while pages < SNAPSHOT_PAGES_PER_LOCK
                            && let Some(s) = runs.next()
                        {
                            pages += s.page_hashes.len().max(1);
                            ix.stored(slot, s.parent_hash, &s.page_hashes, &s.token_ids).map_err(|x| x.to_string())?;
                        }
                        // Hand the lock to a waiting placement, if any: a plain unlock lets
                        // this loop take it back at once, slice after slice (measured: 30-90
                        // ms waits behind a million-page snapshot).
                        parking_lot::MutexGuard::unlock_fair(ix);
                    }
                }
                kind => apply(&mut *locked()?, slot, kind).map_err(|x| x.to_string())?,
            }
        }
    }
    Err("stream closed".into())
}

/// Checks that `e` follows `at` (the (epoch, last sequence) applied so far; None: nothing yet,
/// so it must be a snapshot) and moves `at` to it.
fn in_sequence(at: &mut Option<(u64, u64)>, epoch: u64, e: &pb::KvEvent) -> Result<(), String> {
    let fresh = match (*at, &e.kind) {
        (_, Some(pb::kv_event::Kind::Snapshot(_))) => true,
        (Some((was, seq)), _) => was == epoch && e.sequence == seq.wrapping_add(1),
        (None, _) => false,
    };
    if !fresh {
        return Err(format!("gap: {:?} then {} in epoch {}", at, e.sequence, epoch));
    }
    *at = Some((epoch, e.sequence));
    Ok(())
}

/// Applies one batch of worker `slot`'s KV events to `ix`, in sequence: `at` is the (epoch,
/// last sequence) applied so far (None: nothing yet, so the batch must start with a snapshot).
/// A gap, an epoch change without a snapshot or an event the index refuses is an error, after
/// which the caller forgets the worker's entries and resubscribes.
pub fn apply_batch(
    ix: &mut PrefixIndex,
    slot: usize,
    batch: pb::KvEventBatch,
    at: &mut Option<(u64, u64)>,
) -> Result<(), String> {
    for e in batch.events {
        in_sequence(at, batch.epoch, &e)?;
        apply(ix, slot, e.kind).map_err(|x| x.to_string())?;
    }
    Ok(())
}

fn apply(ix: &mut PrefixIndex, slot: usize, kind: Option<pb::kv_event::Kind>) -> Result<(), IndexError> {
    match kind {
        Some(pb::kv_event::Kind::Stored(s)) => ix.stored(slot, s.parent_hash, &s.page_hashes, &s.token_ids),
        Some(pb::kv_event::Kind::Removed(r)) => ix.removed(slot, &r.page_hashes),
        Some(pb::kv_event::Kind::Snapshot(all)) => {
            ix.clear_worker(slot)?;
            for s in all.pages {
                ix.stored(slot, s.parent_hash, &s.page_hashes, &s.token_ids)?;
            }
            Ok(())
        }
        None => Ok(()),
    }
}
