//! The prefix cache's page accounting under random interleavings, and its eviction rules.

use ferry_engine::{PageAlloc, PagePool, RadixCache};
use ferry_kernels::KvLayout;
use ferry_kernels::cpu::CpuBackend;
use ferry_radix::NodeId;
use ferry_radix::events::EventKind;
use proptest::prelude::*;

const PS: usize = 2;
const POOL: usize = 40;

fn pool() -> PagePool<CpuBackend> {
    PagePool::new(&CpuBackend::default(), KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, page_size: PS }, POOL)
        .expect("pool")
}

/// A request holding a locked match: its node, tokens and the pages it saw.
struct Held {
    node: NodeId,
    tokens: Vec<u32>,
    pages: Vec<u32>,
}

/// Matches `tokens`, allocates pages for the rest (evicting as needed), and inserts them.
fn prefill(cache: &mut RadixCache, pool: &PagePool<CpuBackend>, tokens: &[u32]) -> bool {
    let m = cache.match_prefix(tokens);
    cache.lock(m.node);
    let need = tokens.len() / PS - m.tokens / PS;
    let ok = match cache.alloc(pool, need) {
        Ok(a) => {
            let (node, _) = cache.insert(tokens, m.tokens / PS, a, 0);
            assert!(node != NodeId::ROOT || tokens.len() < PS);
            true
        }
        Err(_) => false,
    };
    cache.unlock(m.node);
    ok
}

#[derive(Debug, Clone)]
enum Op {
    Prefill(Vec<u32>),
    MatchLock(Vec<u32>),
    Unlock(usize),
    Evict(usize),
    Alloc(usize),
    Free(usize),
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(0u32..3, 0..24)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => tokens().prop_map(Op::Prefill),
        2 => tokens().prop_map(Op::MatchLock),
        2 => (0usize..8).prop_map(Op::Unlock),
        1 => (0usize..20).prop_map(Op::Evict),
        1 => (0usize..15).prop_map(Op::Alloc),
        1 => (0usize..8).prop_map(Op::Free),
    ]
}

proptest! {
    #[test]
    fn no_page_is_lost_and_locked_pages_survive(ops in proptest::collection::vec(op(), 1..80)) {
        let pool = pool();
        let mut cache = RadixCache::new(PS, 1);
        let mut held: Vec<Held> = Vec::new();
        let mut owned: Vec<PageAlloc> = Vec::new();
        for op in ops {
            match op {
                Op::Prefill(t) => { prefill(&mut cache, &pool, &t); }
                Op::MatchLock(t) => {
                    let m = cache.match_prefix(&t);
                    cache.lock(m.node);
                    held.push(Held { node: m.node, tokens: t[..m.tokens].to_vec(), pages: m.pages });
                }
                Op::Unlock(i) => {
                    if i < held.len() {
                        let h = held.swap_remove(i);
                        cache.unlock(h.node);
                    }
                }
                Op::Evict(n) => { cache.evict(n); }
                Op::Alloc(n) => { if let Ok(a) = cache.alloc(&pool, n) { owned.push(a); } }
                Op::Free(i) => { if i < owned.len() { owned.swap_remove(i); } }
            }
            let cached: usize = cache.tree().walk().iter().map(|&n| cache.node_pages(n).len()).sum();
            prop_assert_eq!(cache.evictable_pages() + cache.protected_pages(), cached);
            let in_use: usize = owned.iter().map(PageAlloc::len).sum();
            prop_assert_eq!(pool.free_pages() + cached + in_use, POOL, "a page was lost");
            for h in &held {
                // A locked prefix is still cached, with the same pages.
                let m = cache.tree().match_prefix(&h.tokens);
                prop_assert_eq!(m.tokens, h.tokens.len());
                prop_assert!(cache.lock_ref(h.node) > 0 || h.node == NodeId::ROOT);
                let mut pages = Vec::new();
                for (n, k) in m.path { pages.extend_from_slice(&cache.node_pages(n)[..k]); }
                prop_assert_eq!(&pages, &h.pages);
            }
        }
        for h in held.drain(..) { cache.unlock(h.node); }
        prop_assert_eq!(cache.protected_pages(), 0);
        cache.evict(usize::MAX);
        drop(owned);
        prop_assert_eq!(cache.cached_pages(), 0);
        prop_assert_eq!(pool.free_pages(), POOL);
    }
}

#[test]
fn eviction_cascades_to_childless_parents_but_spares_locked_ones() {
    let pool = pool();
    let mut cache = RadixCache::new(PS, 7);
    let base = [1, 1, 2, 2];
    let long = [1, 1, 2, 2, 3, 3, 4, 4];
    let other = [1, 1, 2, 2, 5, 5];
    assert!(prefill(&mut cache, &pool, &long));
    assert!(prefill(&mut cache, &pool, &other));
    // Tree: [1 1 2 2] → {[3 3 4 4], [5 5]}: 5 pages cached.
    assert_eq!(cache.cached_pages(), 5);
    // Lock the interior node; evict everything that can go.
    let m = cache.match_prefix(&base);
    cache.lock(m.node);
    assert_eq!(cache.protected_pages(), 2);
    let freed = cache.evict(usize::MAX);
    assert_eq!(freed, 3, "both leaves go");
    assert_eq!(cache.cached_pages(), 2, "the locked interior node survives");
    assert_eq!(cache.peek(&long), 4);
    // Unlocked, the now-childless node is a candidate and goes too (cascade).
    cache.unlock(m.node);
    assert_eq!(cache.evict(1), 2);
    assert_eq!(cache.cached_pages(), 0);
    assert_eq!(pool.free_pages(), POOL);
    // The events tell the story: three stores (two new runs + the split does not publish),
    // then removals of every page.
    let events = cache.drain_events();
    let stored: usize = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Stored(s) => Some(s.page_hashes.len()),
            _ => None,
        })
        .sum();
    let removed: usize = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Removed { page_hashes } => Some(page_hashes.len()),
            _ => None,
        })
        .sum();
    assert_eq!((stored, removed), (5, 5));
    assert!(events.windows(2).all(|w| w[1].sequence == w[0].sequence + 1 && w[0].epoch == 7));
}

#[test]
fn lru_evicts_the_least_recently_used_leaf_first() {
    let pool = pool();
    let mut cache = RadixCache::new(PS, 1);
    let (a, b) = ([1, 1, 1, 1], [2, 2, 2, 2]);
    assert!(prefill(&mut cache, &pool, &a));
    assert!(prefill(&mut cache, &pool, &b));
    let _ = cache.match_prefix(&a); // a is now more recent than b
    assert_eq!(cache.evict(1), 2);
    assert_eq!((cache.peek(&a), cache.peek(&b)), (4, 0));
}

#[test]
fn snapshot_lists_parents_before_children_with_chained_hashes() {
    let pool = pool();
    let mut cache = RadixCache::new(PS, 1);
    assert!(prefill(&mut cache, &pool, &[1, 1, 2, 2, 3, 3]));
    assert!(prefill(&mut cache, &pool, &[1, 1, 9, 9]));
    let EventKind::Snapshot(runs) = cache.snapshot().kind else { panic!("snapshot") };
    let mut seen = std::collections::HashSet::from([ferry_radix::events::ROOT_HASH]);
    let mut pages = 0;
    for r in &runs {
        assert!(seen.contains(&r.parent_hash), "parent before child");
        seen.extend(r.page_hashes.iter().copied());
        pages += r.page_hashes.len();
    }
    assert_eq!(pages, cache.cached_pages());
}

#[test]
fn lower_priority_prefixes_are_evicted_first() {
    let pool = pool();
    let mut cache = RadixCache::new(PS, 1);
    let (important, cheap) = ([1, 1, 1, 1], [2, 2, 2, 2]);
    for (t, prio) in [(&important, 5), (&cheap, 0)] {
        let a = cache.alloc(&pool, 2).expect("pages");
        cache.insert(t, 0, a, prio);
    }
    let _ = cache.match_prefix(&important);
    let _ = cache.match_prefix(&cheap); // cheap is the most recent, yet goes first
    assert_eq!(cache.evict(1), 2);
    assert_eq!((cache.peek(&important), cache.peek(&cheap)), (4, 0));
}
