//! The prefill scheduler: chunking, policies, the in-queue prefix check, incremental
//! matching, aborts — with page accounting checked after every scenario.

use ferry_engine::scheduler::{Chunk, Policy, Prefilled, Scheduler, SchedulerConfig};
use ferry_engine::{PagePool, RadixCache};
use ferry_kernels::KvLayout;
use ferry_kernels::cpu::CpuBackend;

const PS: usize = 4;

fn pool(pages: usize) -> PagePool<CpuBackend> {
    PagePool::new(
        &CpuBackend::default(),
        KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, page_size: PS },
        pages,
    )
    .expect("pool")
}

fn sched(policy: Policy, chunk: usize, threshold: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig { policy, chunk_size: chunk, in_queue_threshold: threshold }, PS)
}

/// Runs passes until nothing is left; returns (tokens computed, completion order).
fn drain(s: &mut Scheduler, cache: &mut RadixCache, pool: &PagePool<CpuBackend>) -> (usize, Vec<u64>) {
    let mut computed = 0;
    let mut order = Vec::new();
    for _ in 0..10_000 {
        if s.waiting_len() == 0 && s.prefilling_len() == 0 {
            return (computed, order);
        }
        let chunks: Vec<Chunk> = s.schedule(cache, pool);
        assert!(!chunks.is_empty(), "a pass with work pending scheduled nothing");
        computed += chunks.iter().map(|c| c.end - c.start).sum::<usize>();
        for p in s.complete(&chunks, cache) {
            order.push(p.id);
            release(cache, p);
        }
    }
    panic!("did not finish");
}

fn release(cache: &mut RadixCache, p: Prefilled) {
    cache.unlock(p.node);
    drop(p.tail);
}

fn seq(prefix: u32, len: usize, tail: u32) -> Vec<u32> {
    (0..len as u32).map(|i| if i < len as u32 - 8 { prefix * 1000 + i } else { tail * 1000 + i }).collect()
}

#[test]
fn long_prompts_are_chunked_and_pages_come_back() {
    let pool = pool(64);
    let mut cache = RadixCache::new(PS, 1);
    let mut s = sched(Policy::Lpm, 32, 32);
    s.add(1, (0..100).collect(), &cache);
    let mut spans = Vec::new();
    loop {
        let chunks = s.schedule(&mut cache, &pool);
        if chunks.is_empty() {
            break;
        }
        spans.extend(chunks.iter().map(|c| (c.start, c.end, c.last)));
        assert_eq!(chunks[0].pages.len(), 25, "pages for the whole prompt");
        for p in s.complete(&chunks, &mut cache) {
            assert_eq!(p.pages.len(), 25);
            assert_eq!(p.cached, 0);
            release(&mut cache, p);
        }
    }
    assert_eq!(spans, vec![(0, 32, false), (32, 64, false), (64, 96, false), (96, 100, true)]);
    assert_eq!(cache.cached_pages(), 25);
    assert_eq!(pool.free_pages() + cache.cached_pages(), 64);
}

#[test]
fn a_sibling_waits_for_the_shared_prefix_instead_of_computing_it_twice() {
    for (threshold, want_computed) in [(32, 100 + 8), (0, 200)] {
        let pool = pool(128);
        let mut cache = RadixCache::new(PS, 1);
        let mut s = sched(Policy::Lpm, 1000, threshold);
        s.add(1, seq(7, 100, 1), &cache);
        s.add(2, seq(7, 100, 2), &cache);
        let first = s.schedule(&mut cache, &pool);
        assert_eq!(first.len(), if threshold > 0 { 1 } else { 2 });
        let mut computed: usize = first.iter().map(|c| c.end - c.start).sum();
        for p in s.complete(&first, &mut cache) {
            release(&mut cache, p);
        }
        computed += drain(&mut s, &mut cache, &pool).0;
        // With the check the second prompt computes only its last 8 tokens (rounded to pages).
        assert_eq!(computed, want_computed, "threshold {threshold}");
        assert_eq!(pool.free_pages() + cache.cached_pages(), 128);
    }
}

#[test]
fn lpm_prefers_cached_prefixes_and_fcfs_keeps_arrival_order() {
    for (policy, want) in [(Policy::Lpm, vec![2, 1]), (Policy::Fcfs, vec![1, 2]), (Policy::DfsWeight, vec![2, 1])] {
        let pool = pool(128);
        let mut cache = RadixCache::new(PS, 1);
        let mut warm = sched(policy, 1000, 0);
        warm.add(0, seq(5, 64, 0), &cache);
        drain(&mut warm, &mut cache, &pool);
        let mut s = sched(policy, 60, 0);
        s.add(1, seq(9, 64, 1), &cache); // nothing cached
        s.add(2, seq(5, 64, 2), &cache); // 56 tokens cached
        let (_, order) = drain(&mut s, &mut cache, &pool);
        assert_eq!(order, want, "{policy:?}");
    }
}

#[test]
fn dfs_weight_groups_requests_by_shared_prefix() {
    let pool = pool(256);
    let mut cache = RadixCache::new(PS, 1);
    let mut warm = sched(Policy::Fcfs, 1000, 0);
    warm.add(100, seq(1, 40, 0), &cache);
    warm.add(101, seq(2, 40, 0), &cache);
    drain(&mut warm, &mut cache, &pool);
    let mut s = sched(Policy::DfsWeight, 1000, 0);
    // Interleaved arrivals: prefix 1, 2, 2, 1, 2: the heavier prefix-2 group runs first, together.
    for (id, p) in [(1, 1), (2, 2), (3, 2), (4, 1), (5, 2)] {
        s.add(id, seq(p, 40, id as u32 + 10), &cache);
    }
    let chunks = s.schedule(&mut cache, &pool);
    let ids: Vec<u64> = chunks.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![2, 3, 5, 1, 4]);
    for p in s.complete(&chunks, &mut cache) {
        release(&mut cache, p);
    }
}

#[test]
fn passes_without_cache_changes_rematch_nothing() {
    let pool = pool(4096);
    let mut cache = RadixCache::new(PS, 1);
    let mut s = sched(Policy::Lpm, 64, 32);
    for i in 0..500u64 {
        s.add(i, seq((i % 10) as u32, 200, i as u32), &cache);
    }
    let c = s.schedule(&mut cache, &pool);
    let before = s.rematch_count();
    // Nothing completed: the cache did not change, so the next pass re-matches nothing.
    let c2 = s.schedule(&mut cache, &pool);
    assert_eq!(s.rematch_count(), before);
    assert_eq!(c, c2);
    // Request 0's chunks complete one pass at a time: the cache does not change, nothing is
    // re-matched. Then request 0 completes: exactly the 49 other waiting requests of its
    // prefix group (every tenth of the 500) are re-matched, none of the 450 others.
    let mut chunks = c2;
    for _ in 0..10 {
        let before = s.rematch_count();
        let mut done = Vec::new();
        for p in s.complete(&chunks, &mut cache) {
            done.push(p.id);
            release(&mut cache, p);
        }
        chunks = s.schedule(&mut cache, &pool);
        let rematched = s.rematch_count() - before;
        if done.contains(&0) {
            assert_eq!(rematched, 49, "re-matched when request 0 completed (done: {done:?})");
            return;
        }
        assert_eq!((done.len(), rematched), (0, 0), "a pass that completed no request re-matched");
    }
    panic!("request 0 never completed");
}

#[test]
fn abort_anywhere_returns_every_page() {
    let pool = pool(64);
    let mut cache = RadixCache::new(PS, 1);
    let mut s = sched(Policy::Lpm, 16, 0);
    s.add(1, (0..50).collect(), &cache);
    s.add(2, (100..150).collect(), &cache);
    let chunks = s.schedule(&mut cache, &pool);
    assert_eq!(chunks.len(), 1, "budget 16 admits one");
    assert!(s.abort(1, &mut cache), "abort while prefilling");
    assert!(s.abort(2, &mut cache), "abort while waiting");
    assert!(!s.abort(3, &mut cache));
    assert_eq!(cache.protected_pages(), 0);
    assert_eq!(pool.free_pages() + cache.cached_pages(), 64);
    assert_eq!(pool.free_pages(), 64);
}

#[test]
fn admission_evicts_cached_pages_and_waits_when_nothing_can_go() {
    let pool = pool(30);
    let mut cache = RadixCache::new(PS, 1);
    let mut s = sched(Policy::Fcfs, 1000, 0);
    for i in 0..4u64 {
        s.add(i, seq(i as u32, 64, 0), &cache);
        drain(&mut s, &mut cache, &pool);
    }
    assert!(cache.cached_pages() <= 30, "older prompts were evicted to fit newer ones");
    assert_eq!(cache.tree().match_prefix(&seq(3, 64, 0)).tokens, 64);
    // A prompt bigger than the pool waits (and can be aborted).
    s.add(9, (0..200).collect(), &cache);
    assert!(s.schedule(&mut cache, &pool).is_empty());
    assert_eq!(s.waiting_len(), 1);
    assert!(s.abort(9, &mut cache));
    assert_eq!(pool.free_pages() + cache.cached_pages(), 30);
}

#[test]
fn incremental_matches_stay_exact_under_inserts_splits_and_evictions() {
    let pool = pool(120);
    let mut cache = RadixCache::new(PS, 1);
    let mut s = sched(Policy::Lpm, 48, 16);
    let mut next = 0u64;
    let mut x = 12345u64;
    let mut rand = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for step in 0..300 {
        match rand(4) {
            0 | 1 => {
                // Prompts over a few shared stems, so splits and extensions happen.
                let stem = rand(3) as u32;
                let len = 8 + rand(60) as usize;
                let branch = rand(4) as u32;
                let t: Vec<u32> = (0..len as u32)
                    .map(|i| if i < 12 { stem * 100 + i } else { stem * 100 + branch * 1000 + i })
                    .collect();
                next += 1;
                s.add(next, t, &cache);
            }
            2 => {
                let chunks = s.schedule(&mut cache, &pool);
                for p in s.complete(&chunks, &mut cache) {
                    release(&mut cache, p);
                }
            }
            _ => {
                cache.evict(rand(20) as usize);
            }
        }
        assert_eq!(s.stale_matches(&mut cache), 0, "step {step}");
    }
    drain(&mut s, &mut cache, &pool);
    assert_eq!(pool.free_pages() + cache.cached_pages(), 120);
}
