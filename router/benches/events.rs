//! Router index benchmark, issue 17's workload W2: the prefix index fed by the workers' KV
//! events (`PrefixIndex::stored` / `removed`) and matched (`PrefixIndex::matched`), the path
//! every event and every placement's first step take. Pages of 16 tokens, token ids uniform in
//! [0, 50,000) from a fixed seed; page hashes are the workers' (`page_hashes`), computed before
//! the clock starts, as a worker computes them.
//!
//! - **Store**: W ∈ {10, 100, 500} workers each send one stored chain of B ∈ {64, 256, 1,024}
//!   pages into an empty index; time per page. First of all, the index's memory per million
//!   pages at W = 500, B = 1,024 (live heap bytes, counted by this bench's allocator): alone,
//!   and as the router keeps it (`SharedIndex`: two copies of the tree, one page table).
//! - **Match**: the index holds W × 1,024 pages, the first 8 shared by all; a query is one
//!   worker's first Q ∈ {32, 128, 512} pages; mean time per query (smg, Q = 128: 1.08 / 4.17 /
//!   27.3 µs at W = 10 / 100 / 500).
//! - **Mixed replay**: 256 workers, 20,000 sessions × 5 turns (a session on worker `s % 256`);
//!   each turn a 128-page query whose part the index holds grows by 6 pages a turn (the rest
//!   fresh), then a 64-page stored event chained to the session's previous one; after every 4
//!   stores one removed event takes the last chain of a finished session (a cache evicts
//!   leaves first). Page-ops per second, a page-op being a page queried, stored or removed
//!   (smg: about 12.5 M page-ops/s on 2 cores). Run twice: on the index itself, then as the
//!   router runs it (`SharedIndex`: a placement's match, each turn's events one write, which
//!   applies them to both copies of the events' index).
//!
//! `cargo bench -p ferry-router --bench events`; `FERRY_BENCH_QUICK=1` divides the counts by
//! 20 (CI smoke run).

#[path = "common/rng.rs"]
mod rng;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use rng::Rng;

use ferry_radix::events::{ROOT_HASH, page_hashes};
use ferry_router::index::{Event, PrefixIndex, SharedIndex};

const PS: usize = 16;
/// Big enough for every workload here: an operator sizes the index to what the workers hold.
const MAX_PAGES: usize = 16 << 20;

/// The heap's live bytes, counted by the allocator below.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting live bytes (the index's memory, without what freed event
/// buffers it reuses would hide from a resident-memory measure).
struct Counting;

// SAFETY: every call is passed to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One worker's chain: its tokens and their hashes from the root.
struct Chain {
    tokens: Vec<u32>,
    hashes: Vec<u64>,
}

fn chain(rng: &mut Rng, head: &[u32], pages: usize) -> Chain {
    let mut tokens = head.to_vec();
    tokens.extend(rng.tokens(pages * PS - head.len()));
    let hashes = page_hashes(ROOT_HASH, &tokens, PS);
    Chain { tokens, hashes }
}

fn memory(rng: &mut Rng) {
    let chains: Vec<Chain> = (0..500).map(|_| chain(rng, &[], 1024)).collect();
    let events: Vec<Event> = chains
        .into_iter()
        .enumerate()
        .map(|(worker, c)| Event::Stored { worker, parent: ROOT_HASH, hashes: c.hashes, tokens: c.tokens })
        .collect();
    let before = LIVE.load(Ordering::Relaxed);
    let mut alone = PrefixIndex::new(PS, MAX_PAGES);
    for e in &events {
        alone.apply(e).expect("stored");
    }
    let one = LIVE.load(Ordering::Relaxed) - before;
    let pages = alone.pages();
    drop(alone);
    let before = LIVE.load(Ordering::Relaxed);
    let shared = SharedIndex::new(PS, MAX_PAGES);
    // Copies, made and let go within the measure: the originals are not the index's.
    assert_eq!(shared.apply(events.iter().cloned(), || true), Ok(true));
    // The second copy takes them at the next write (which lets the batch go).
    assert_eq!(shared.apply([], || true), Ok(true));
    let both = LIVE.load(Ordering::Relaxed).saturating_sub(before);
    let mb = |bytes: usize| bytes as f64 / pages as f64;
    println!(
        "index memory: {:.0} MB per million pages as the router keeps them (two copies of the tree, one page table), {:.0} MB for the index alone ({pages} pages from 500 workers' chains of 1,024; live heap bytes)",
        mb(both),
        mb(one),
    );
}

fn store(rng: &mut Rng) {
    for workers in [10, 100, 500] {
        for pages in [64, 256, 1024] {
            let chains: Vec<Chain> = (0..workers).map(|_| chain(rng, &[], pages)).collect();
            let mut ix = PrefixIndex::new(PS, MAX_PAGES);
            let t = Instant::now();
            for (w, c) in chains.iter().enumerate() {
                ix.stored(w, ROOT_HASH, &c.hashes, &c.tokens).expect("stored");
            }
            let per_page = t.elapsed().as_secs_f64() / (workers * pages) as f64;
            println!(
                "store W={workers:>3} B={pages:>4}: {:.0} ns/page, {:.1} M pages/s",
                per_page * 1e9,
                1e-6 / per_page
            );
        }
    }
}

fn matches(rng: &mut Rng, div: usize) {
    const SMG: [f64; 3] = [1.08, 4.17, 27.3];
    for (i, workers) in [10, 100, 500].into_iter().enumerate() {
        let shared = rng.tokens(8 * PS);
        let chains: Vec<Chain> = (0..workers).map(|_| chain(rng, &shared, 1024)).collect();
        let mut ix = PrefixIndex::new(PS, MAX_PAGES);
        for (w, c) in chains.iter().enumerate() {
            ix.stored(w, ROOT_HASH, &c.hashes, &c.tokens).expect("stored");
        }
        for q in [32, 128, 512] {
            let n = 20_000 / div;
            let mut sink = 0;
            let t = Instant::now();
            for k in 0..n {
                let c = &chains[k % workers];
                sink += ix.matched(&c.tokens[..q * PS], workers)[k % workers];
            }
            assert_eq!(sink, n * q * PS, "each query matches its worker's chain");
            let us = t.elapsed().as_secs_f64() / n as f64 * 1e6;
            let smg = if q == 128 {
                format!(" | smg {:.2} µs: ratio Ferry/smg {:.2}", SMG[i], us / SMG[i])
            } else {
                String::new()
            };
            println!("match W={workers:>3} Q={q:>3}: {us:.2} µs per query{smg}");
        }
    }
}

/// The index a replay runs on: alone, or as the router shares it.
enum Ix {
    Plain(PrefixIndex),
    Shared(Box<SharedIndex>),
}

impl Ix {
    fn matched(&self, q: &[u32], workers: usize) -> Vec<usize> {
        match self {
            Ix::Plain(ix) => ix.matched(q, workers),
            Ix::Shared(ix) => ix.matched(q, workers),
        }
    }

    /// Applies one turn's events.
    fn apply(&mut self, events: Vec<Event>) {
        match self {
            Ix::Plain(ix) => {
                for e in &events {
                    ix.apply(e).expect("applied");
                }
            }
            Ix::Shared(ix) => assert_eq!(ix.apply(events, || true), Ok(true)),
        }
    }

    fn pages(&self) -> usize {
        match self {
            Ix::Plain(ix) => ix.pages(),
            Ix::Shared(ix) => ix.pages(),
        }
    }
}

fn replay(rng: &mut Rng, div: usize, mut ix: Ix) {
    const WORKERS: usize = 256;
    const TURNS: usize = 5;
    let sessions = 20_000 / div;
    let how = match ix {
        Ix::Plain(_) => "the index alone",
        Ix::Shared(_) => "as the router shares it",
    };
    // Finished sessions' chains, last first: (worker, page hashes).
    let mut finished: VecDeque<(usize, Vec<u64>)> = VecDeque::new();
    let (mut ops, mut stores, mut busy) = (0u64, 0u64, 0f64);
    for s in 0..sessions {
        let w = s % WORKERS;
        // The whole conversation, made before the clock starts: TURNS chains of 64 pages.
        let conv = chain(rng, &[], TURNS * 64);
        let queries: Vec<Vec<u32>> = (0..TURNS)
            .map(|t| {
                let mut q = conv.tokens[..6 * t * PS].to_vec();
                q.extend(rng.tokens((128 - 6 * t) * PS));
                q
            })
            .collect();
        let mut chains = Vec::with_capacity(TURNS);
        for (t, q) in queries.iter().enumerate() {
            let run = t * 64..(t + 1) * 64;
            let parent = if t == 0 { ROOT_HASH } else { conv.hashes[run.start - 1] };
            let hashes = conv.hashes[run.clone()].to_vec();
            let tokens = conv.tokens[run.start * PS..run.end * PS].to_vec();
            // The events arrive owned (decoded from the worker's stream): made before the clock.
            let mut events = vec![Event::Stored { worker: w, parent, hashes: hashes.clone(), tokens }];
            stores += 1;
            ops += 128 + 64;
            if stores % 4 == 0
                && let Some((fw, hs)) = finished.pop_front()
            {
                ops += hs.len() as u64;
                events.push(Event::Removed { worker: fw, hashes: hs });
            }
            let start = Instant::now();
            let m = ix.matched(q, WORKERS);
            ix.apply(events);
            busy += start.elapsed().as_secs_f64();
            assert!(m[w] >= 6 * t * PS, "the session's earlier turns are indexed");
            chains.push(hashes);
        }
        // Leaves first: the last chain goes first.
        finished.extend(chains.into_iter().rev().map(|hs| (w, hs)));
    }
    println!(
        "mixed replay, {how}: {WORKERS} workers, {sessions} sessions x {TURNS} turns: {:.1} M page-ops/s ({ops} page-ops in {:.2} s; index {} pages) | smg ~12.5 M page-ops/s on 2 cores",
        ops as f64 / busy / 1e6,
        busy,
        ix.pages()
    );
}

fn main() {
    let div = if ferry_core::bench::quick() { 20 } else { 1 };
    let mut rng = Rng(0x5eed);
    memory(&mut rng);
    store(&mut rng);
    matches(&mut rng, div);
    replay(&mut rng, div, Ix::Plain(PrefixIndex::new(PS, MAX_PAGES)));
    replay(&mut rng, div, Ix::Shared(Box::new(SharedIndex::new(PS, MAX_PAGES))));
}
