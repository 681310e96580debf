//! The index as the router shares it between placements and the workers' KV events, so that
//! a placement never waits for event ingestion:
//!
//! - what the workers' events say is in a [`PrefixIndex`] kept in two copies
//!   ([`Published`]): ingestion changes the copy placements are not reading, then sends them
//!   to it. Each event is applied twice (once per copy), and the trees cost twice the memory;
//!   the page table, which only ingestion reads (to find an event's pages by hash), is kept
//!   once: the copy that takes an event first looks its pages up there and leaves what it
//!   found in a trace; the other takes the same event from that trace a write later. The
//!   copies make the same node ids for the same events (`RadixTree::walk` orders siblings
//!   by id), so one table names the pages of both;
//! - the router's own placements (provisional marks, which the next placement must see at
//!   once) are in a second [`PrefixIndex`] that only placements and housekeeping lock, for a
//!   match or one insert at a time.
//!
//! A worker matches the longer of its two prefixes: each is prefix-closed, so along a prompt
//! the union of what the events and the marks say is the longer of the two.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::published::{Absorb, Published};
use super::shard::{SHARD_WORKERS, Shard};
use super::table::{PageTable, Trace};
use super::{IndexError, PrefixIndex};

/// A worker's KV event, owned: applied to one copy of the index now and to the other later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A worker cached a run of whole pages.
    Stored {
        /// The worker's slot.
        worker: usize,
        /// The hash of the page the run follows (the root's for a run from the start).
        parent: u64,
        /// Each page's chained hash.
        hashes: Vec<u64>,
        /// The pages' tokens, page after page.
        tokens: Vec<u32>,
    },
    /// A worker evicted pages.
    Removed {
        /// The worker's slot.
        worker: usize,
        /// The pages' hashes.
        hashes: Vec<u64>,
    },
    /// Forget everything a worker holds (it resyncs, restarted, left or died).
    Clear {
        /// The worker's slot.
        worker: usize,
    },
}

impl PrefixIndex {
    /// Applies event `e`.
    pub fn apply(&mut self, e: &Event) -> Result<(), IndexError> {
        match self.shard_of(e) {
            Some((_, s, slot)) => e.apply_to(s, slot),
            None => Ok(()),
        }
    }
}

impl Event {
    fn worker(&self) -> usize {
        match self {
            Event::Stored { worker, .. } | Event::Removed { worker, .. } | Event::Clear { worker } => *worker,
        }
    }

    /// Applies this event to shard `s`, where the worker is slot `slot`.
    fn apply_to(&self, s: &mut Shard, slot: usize) -> Result<(), IndexError> {
        match self {
            Event::Stored { parent, hashes, tokens, .. } => s.stored(slot, *parent, hashes, tokens),
            Event::Removed { hashes, .. } => s.removed(slot, hashes),
            Event::Clear { .. } => s.clear_worker(slot),
        }
    }
}

/// The page tables of the shared events' index, one per shard, which the writer keeps once
/// for both copies.
#[derive(Default)]
pub struct Tables(Vec<PageTable>);

impl PrefixIndex {
    /// The shard event `e` changes, made when new (a clear makes none), and its number and
    /// the worker's slot in it.
    fn shard_of(&mut self, e: &Event) -> Option<(usize, &mut Shard, usize)> {
        let w = e.worker();
        let i = w / SHARD_WORKERS;
        if matches!(e, Event::Clear { .. }) && i >= self.shards.len() {
            return None;
        }
        let (s, slot) = self.shard(w);
        Some((i, s, slot))
    }
}

impl Absorb for PrefixIndex {
    type Op = Event;
    type Error = IndexError;
    type Side = Tables;
    type Trace = Trace;

    fn absorb(&mut self, e: &Event, tables: &mut Tables, trace: &mut Trace) -> Result<(), IndexError> {
        let Some((i, s, slot)) = self.shard_of(e) else { return Ok(()) };
        if tables.0.len() <= i {
            tables.0.resize_with(i + 1, PageTable::default);
        }
        s.recording(&mut tables.0[i], trace, |s| e.apply_to(s, slot))
    }

    fn absorb_again(&mut self, e: &Event, trace: &mut Trace) {
        if let Some((_, s, slot)) = self.shard_of(e) {
            let _ = s.replaying(trace, |s| e.apply_to(s, slot));
        }
    }

    fn reset(trace: &mut Trace) -> bool {
        trace.finish()
    }
}

/// The index's gauges and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Pages some worker's KV events say it holds.
    pub confirmed: usize,
    /// Pages the router placed whose marks have not lapsed (events may confirm some of them
    /// too: they are counted in both).
    pub provisional: usize,
    /// Pages evicted, least recently used first, to make room for new ones.
    pub evicted: u64,
    /// New pages dropped because the index was full and nothing could be evicted.
    pub dropped: u64,
    /// Writes after which the two copies of the events' index may differ (each a bug).
    pub diverged: u64,
}

/// Which workers hold which prefixes, shared: see the module's documentation.
pub struct SharedIndex {
    events: Published<PrefixIndex>,
    /// The pages in the writer's page tables after the last write (the stats read this, not
    /// the tables, which they would wait for a write to read).
    confirmed: AtomicUsize,
    marks: Mutex<PrefixIndex>,
    page_size: usize,
    max_pages: usize,
}

impl SharedIndex {
    /// Empty, over pages of `page_size` tokens; the events' index and the marks each hold at
    /// most `max_pages` pages (the events' twice: it has two copies).
    pub fn new(page_size: usize, max_pages: usize) -> Self {
        let ix = || PrefixIndex::new(page_size, max_pages);
        Self {
            events: Published::new(ix(), ix()),
            confirmed: AtomicUsize::new(0),
            marks: Mutex::new(ix()),
            page_size: page_size.max(1),
            max_pages,
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Most pages the events' index holds, and the marks.
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// For each worker slot `0..workers`, how many tokens of `prompt` it holds (whole pages,
    /// provisional marks included). Never waits for event ingestion.
    pub fn matched(&self, prompt: &[u32], workers: usize) -> Vec<usize> {
        let mut out = vec![0; workers];
        self.events.read().matched_into(prompt, &mut out);
        self.marks.lock().matched_into(prompt, &mut out);
        out
    }

    /// For each worker slot `0..workers`, how many tokens of `prompt` its KV events say it
    /// holds (whole pages; no provisional marks).
    pub fn confirmed_matched(&self, prompt: &[u32], workers: usize) -> Vec<usize> {
        let mut out = vec![0; workers];
        self.events.read().matched_into(prompt, &mut out);
        out
    }

    /// The router placed `prompt` on `worker` at `now`: its whole pages count as held there
    /// for `ttl`, or until the marks are cleared; marks whose time has come go first.
    pub fn provisional(&self, worker: usize, prompt: &[u32], now: Instant, ttl: Duration) -> Result<(), IndexError> {
        self.marks.lock().provisional(worker, prompt, now, ttl)
    }

    /// Drops provisional marks whose time has come.
    pub fn expire(&self, now: Instant) {
        self.marks.lock().expire(now);
    }

    /// When `admit()` (asked with ingestion shut out) says so, applies `events` in order,
    /// stopping at the first the index refuses (a gap in the worker's stream: resync it).
    /// `Ok(false)`: not admitted, nothing applied.
    pub fn apply(
        &self,
        events: impl IntoIterator<Item = Event>,
        admit: impl FnOnce() -> bool,
    ) -> Result<bool, IndexError> {
        let written = self.events.write(events, admit);
        let confirmed = self.events.side(|t| t.0.iter().map(PageTable::len).sum());
        self.confirmed.store(confirmed, Ordering::Relaxed);
        written
    }

    /// Forgets what worker `worker` holds, events and marks, when `admit()` (asked with
    /// ingestion shut out) says so.
    pub fn clear_worker(&self, worker: usize, admit: impl FnOnce() -> bool) -> Result<bool, IndexError> {
        // The marks too with ingestion shut out: a slot handed to a newcomer right after
        // keeps the newcomer's marks.
        let mut marks = Ok(());
        let admitted = self.apply([Event::Clear { worker }], || {
            let yes = admit();
            if yes {
                marks = self.marks.lock().clear_worker(worker);
            }
            yes
        })?;
        marks.map(|()| admitted)
    }

    /// Pages indexed: confirmed by events, and placed only.
    pub fn pages(&self) -> usize {
        let s = self.stats();
        s.confirmed + s.provisional
    }

    /// The gauges and counters.
    pub fn stats(&self) -> IndexStats {
        let (e_evicted, e_dropped) = {
            let e = self.events.read();
            (e.evicted(), e.dropped())
        };
        let confirmed = self.confirmed.load(Ordering::Relaxed);
        let m = self.marks.lock();
        IndexStats {
            confirmed,
            provisional: m.pages(),
            evicted: e_evicted + m.evicted(),
            dropped: e_dropped + m.dropped(),
            diverged: self.events.diverged(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_radix::events::{ROOT_HASH, page_hashes};

    const PS: usize = 4;

    fn stored(worker: usize, tokens: &[u32]) -> Event {
        Event::Stored { worker, parent: ROOT_HASH, hashes: page_hashes(ROOT_HASH, tokens, PS), tokens: tokens.to_vec() }
    }

    #[test]
    fn a_worker_matches_the_longer_of_its_events_and_its_marks() {
        let ix = SharedIndex::new(PS, 1000);
        let t0 = Instant::now();
        let p: Vec<u32> = (0..24).collect();
        assert_eq!(ix.apply([stored(1, &p[..8]), stored(2, &p[..20])], || true), Ok(true));
        ix.provisional(1, &p[..16], t0, Duration::from_secs(1)).expect("placed");
        ix.provisional(3, &p[..4], t0, Duration::from_secs(1)).expect("placed");
        assert_eq!(ix.matched(&p, 4), vec![0, 16, 20, 4]);
        assert_eq!(ix.stats(), IndexStats { confirmed: 5, provisional: 4, evicted: 0, dropped: 0, diverged: 0 });
        ix.expire(t0 + Duration::from_secs(1));
        assert_eq!(ix.matched(&p, 4), vec![0, 8, 20, 0], "marks lapse, events stay");
        assert_eq!(ix.clear_worker(2, || false), Ok(false), "not admitted: kept");
        assert_eq!(ix.matched(&p, 4)[2], 20);
        ix.provisional(2, &p, t0, Duration::from_secs(9)).expect("placed");
        assert_eq!(ix.clear_worker(2, || true), Ok(true));
        assert_eq!(ix.matched(&p, 4), vec![0, 8, 0, 0], "events and marks both forgotten");
        // Both copies took every event: the next writes leave the same answers.
        assert_eq!(
            ix.apply([Event::Removed { worker: 1, hashes: page_hashes(ROOT_HASH, &p[..8], PS)[1..].to_vec() }], || {
                true
            }),
            Ok(true)
        );
        assert_eq!(ix.matched(&p, 4), vec![0, 4, 0, 0]);
        assert_eq!(ix.apply([], || true), Ok(true));
        assert_eq!(ix.matched(&p, 4), vec![0, 4, 0, 0]);
        assert_eq!(ix.pages(), 1);
    }

    /// Both copies of the events' index must change alike (`Absorb`'s contract): random
    /// stores, removals and clears of three workers (in three shards: slots 0, 64, 130), in writes of 1 to 4 events, into a
    /// budget small enough to evict, answer every probe exactly as one index given the same
    /// events does, after every write (each copy is the current one every other write).
    #[test]
    fn both_copies_answer_as_one_index_through_random_traffic() {
        let mut next = crate::testing::rng(0x2545_f491_4f6c_dd1d);
        let (ix, mut one) = (SharedIndex::new(PS, 40), PrefixIndex::new(PS, 40));
        let slots = [0, SHARD_WORKERS, 2 * SHARD_WORKERS + 2];
        let n = slots[2] + 1;
        let mut held: Vec<Vec<Vec<u32>>> = vec![Vec::new(); 3];
        let probes: Vec<Vec<u32>> = (0..32).map(|i| (0..24).map(|k| (i >> (k / PS % 5)) & 1).collect()).collect();
        for _ in 0..1500 {
            let mut batch = Vec::new();
            for _ in 0..1 + next(4) {
                let w = next(3) as usize;
                batch.push(match next(10) {
                    // A run below one of the worker's earlier runs (its parent may be gone:
                    // evicted, then the run is dropped and counted).
                    3 | 4 if !held[w].is_empty() => {
                        let head = held[w][next(held[w].len() as u64) as usize].clone();
                        let parent = *page_hashes(ROOT_HASH, &head, PS).last().expect("a page");
                        let tail: Vec<u32> = (0..(1 + next(3) as usize) * PS).map(|_| next(2) as u32).collect();
                        held[w].push([head, tail.clone()].concat());
                        Event::Stored { worker: slots[w], parent, hashes: page_hashes(parent, &tail, PS), tokens: tail }
                    }
                    5 | 6 if !held[w].is_empty() => {
                        let i = next(held[w].len() as u64) as usize;
                        let t = held[w].swap_remove(i);
                        let hs = page_hashes(ROOT_HASH, &t, PS);
                        Event::Removed { worker: slots[w], hashes: hs[next(hs.len() as u64) as usize..].to_vec() }
                    }
                    7 => {
                        held[w].clear();
                        Event::Clear { worker: slots[w] }
                    }
                    _ => {
                        let t: Vec<u32> = (0..(1 + next(6) as usize) * PS).map(|_| next(2) as u32).collect();
                        held[w].push(t.clone());
                        stored(slots[w], &t)
                    }
                });
            }
            // The one index stops where a write stops: at the first event refused.
            let mut want = Ok(true);
            for e in &batch {
                if let Err(x) = one.apply(e) {
                    want = Err(x);
                    break;
                }
            }
            assert_eq!(ix.apply(batch, || true), want);
            for p in &probes {
                assert_eq!(ix.matched(p, n), one.matched(p, n), "probe {p:?}");
            }
            let s = ix.stats();
            assert_eq!((s.confirmed, s.evicted, s.diverged), (one.confirmed(), one.evicted(), 0));
        }
        let (evicted, dropped) = (one.evicted(), one.dropped());
        assert!(evicted > 100 && dropped > 0, "the traffic filled the budget: {evicted} evicted, {dropped} dropped");
    }

    #[test]
    fn an_event_the_index_refuses_stops_the_batch() {
        let ix = SharedIndex::new(PS, 1000);
        let p: Vec<u32> = (0..8).collect();
        let orphan = Event::Stored { worker: 0, parent: 77, hashes: vec![5], tokens: vec![1, 2, 3, 4] };
        assert_eq!(ix.apply([stored(0, &p[..4]), orphan, stored(1, &p)], || true), Err(IndexError::UnknownParent(77)));
        assert_eq!(ix.matched(&p, 2), vec![4, 0]);
        assert_eq!(ix.apply([], || true), Ok(true));
        assert_eq!(ix.matched(&p, 2), vec![4, 0], "the other copy took the same part");
    }
}
