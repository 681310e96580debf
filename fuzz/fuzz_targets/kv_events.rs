//! The router's KV event path: arbitrary bytes decoded as a stream of `KvEventBatch`es
//! (length-prefixed) and applied to a bounded prefix index (`workers::apply_batch`), with
//! matches in between. Errors (gaps, refused events) are fine; panics and unbounded growth
//! are not.
#![no_main]

use ferry_proto::v1 as pb;
use ferry_router::index::SharedIndex;
use ferry_router::workers::apply_batch;
use libfuzzer_sys::fuzz_target;
use prost::Message;

const MAX_PAGES: usize = 256;

fuzz_target!(|data: &[u8]| {
    let ix = SharedIndex::new(4, MAX_PAGES);
    let mut at = [None; 3];
    let mut rest = data;
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
        assert!(ix.pages() <= MAX_PAGES, "the index grew past its bound: {}", ix.pages());
        let prompt: Vec<u32> = frame.iter().map(|&b| u32::from(b % 8)).collect();
        let m = ix.matched(&prompt, 3);
        assert!(m.iter().all(|&n| n <= prompt.len()));
    }
});
