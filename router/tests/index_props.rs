//! The prefix index against a plain model: every worker's set of cached prefixes, fed the
//! same random stored / removed events; every prompt's per-worker match agrees.

use std::collections::BTreeSet;

use ferry_radix::events::{ROOT_HASH, page_hashes};
use ferry_router::index::PrefixIndex;
use proptest::prelude::*;

const PS: usize = 2;
const WORKERS: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    /// Worker caches the path of these pages (tokens from a tiny alphabet, so paths share).
    Store(usize, Vec<u32>),
    /// Worker evicts one of its leaf pages (chosen by index among its leaves).
    Evict(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..WORKERS, prop::collection::vec(0u32..3, PS..=4 * PS)).prop_map(|(w, t)| Op::Store(w, t)),
        (0..WORKERS, 0usize..16).prop_map(|(w, i)| Op::Evict(w, i)),
    ]
}

fn hashes(tokens: &[u32]) -> Vec<u64> {
    page_hashes(ROOT_HASH, tokens, PS)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn matches_agree_with_a_model(ops in prop::collection::vec(op(), 1..60), probes in prop::collection::vec(prop::collection::vec(0u32..3, 0..10), 8)) {
        let mut ix = PrefixIndex::new(PS, 10_000);
        // Model: each worker's cached prefixes (whole pages).
        let mut held: Vec<BTreeSet<Vec<u32>>> = vec![BTreeSet::new(); WORKERS];
        for op in ops {
            match op {
                Op::Store(w, t) => {
                    let t = &t[..t.len() / PS * PS];
                    let hs = hashes(t);
                    let have = (1..=hs.len()).take_while(|&k| held[w].contains(&t[..k * PS])).count();
                    if have == hs.len() {
                        continue;
                    }
                    let parent = if have == 0 { ROOT_HASH } else { hs[have - 1] };
                    ix.stored(w, parent, &hs[have..], &t[have * PS..]).expect("stored");
                    for k in have + 1..=hs.len() {
                        held[w].insert(t[..k * PS].to_vec());
                    }
                }
                Op::Evict(w, i) => {
                    let leaves: Vec<Vec<u32>> = held[w]
                        .iter()
                        .filter(|p| !held[w].iter().any(|q| q.len() > p.len() && q.starts_with(p)))
                        .cloned()
                        .collect();
                    if leaves.is_empty() {
                        continue;
                    }
                    let leaf = &leaves[i % leaves.len()];
                    let h = *hashes(leaf).last().expect("a page");
                    ix.removed(w, &[h]).expect("removed");
                    held[w].remove(leaf);
                }
            }
        }
        for p in probes {
            let want: Vec<usize> = (0..WORKERS)
                .map(|w| (1..=p.len() / PS).take_while(|&k| held[w].contains(&p[..k * PS])).count() * PS)
                .collect();
            prop_assert_eq!(ix.matched(&p, WORKERS), want, "probe {:?}", p);
        }
        let all: BTreeSet<Vec<u32>> = held.iter().flatten().cloned().collect();
        prop_assert_eq!(ix.pages(), all.len(), "exactly the pages someone holds are indexed");
    }
}
