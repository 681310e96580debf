//! Inputs the `kv_events` fuzz target once failed on, replayed the way it feeds them
//! (`[slot, length, KvEventBatch]`… through `workers::apply_batch`).

use ferry_proto::v1 as pb;
use ferry_router::index::SharedIndex;
use ferry_router::workers::apply_batch;
use prost::Message;

fn replay(mut rest: &[u8]) -> SharedIndex {
    let ix = SharedIndex::new(4, 256);
    let mut at = [None; 3];
    while rest.len() >= 2 {
        let slot = usize::from(rest[0] % 3);
        let len = usize::from(rest[1]).min(rest.len() - 2);
        let (frame, tail) = rest[2..].split_at(len);
        rest = tail;
        let Ok(batch) = pb::KvEventBatch::decode(frame) else { continue };
        if apply_batch(&ix, slot, batch, &mut at[slot], &|| true).is_err() {
            at[slot] = None;
            let _ = ix.clear_worker(slot, || true);
        }
        let prompt: Vec<u32> = frame.iter().map(|&b| u32::from(b % 8)).collect();
        let _ = ix.matched(&prompt, 3);
    }
    ix
}

/// A stream whose pages' parent links came to form a loop: walking up from a page never
/// reached the root and ran out of memory. Now the walk stops and the event is refused.
#[test]
fn a_parent_loop_in_kv_events_is_refused_not_followed() {
    let ix = replay(include_bytes!("fuzz-regressions/kv-events-parent-loop.bin"));
    assert!(ix.pages() <= 256);
}
