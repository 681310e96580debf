//! A router (re)starting against workers with big caches rebuilds its index from their KV
//! snapshots. A snapshot is one gRPC message: tonic's default 4 MB decoding limit refused
//! any cache past ~80,000 pages, and the router resubscribed forever with an empty index.

#[path = "common/snapshots.rs"]
mod snapshots;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_cluster::WorkerId;
use ferry_cluster::discovery::{Role, Worker};
use ferry_router::index::SharedIndex;
use ferry_router::workers::Registry;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_past_4_mb_fills_the_index() {
    let pages = 128_000;
    let batch = snapshots::snapshot(pages, 7);
    let bytes = prost::Message::encoded_len(&batch);
    assert!(bytes > 6 << 20, "the snapshot is {bytes} bytes, well past 4 MB");
    let addr = snapshots::serve(batch).await;
    let index = Arc::new(SharedIndex::new(snapshots::PS, 1 << 20));
    let registry = Registry::new(Arc::clone(&index));
    let id = WorkerId::new("prefill-big").expect("id");
    registry.upsert(&Worker { id, role: Role::Prefill, addr }).expect("joined");
    // Not a timing test: the bound only keeps a broken build from hanging CI.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let have = index.pages();
        if have == pages {
            break;
        }
        assert!(Instant::now() < deadline, "the index holds {have} of the snapshot's {pages} pages");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = index.matched(&[0; 16], 1);
    assert_eq!(m, vec![0], "and matches as usual");
}
