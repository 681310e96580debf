//! The router's prefix index: which prefill workers hold which prefixes.
//!
//! Any number of worker slots: slot `w` lives in shard `w / 64` as bit `w % 64` of its pages
//! ([`shard`]: a radix tree over token ids and a table of pages keyed by their chained hash,
//! fed by the workers' KV events and by the router's own placements). A match asks every
//! shard; one whose workers hold nothing of the prompt answers after a single lookup at its
//! root, so a thousand workers cost little more than 64. A shared prefix held in several
//! shards is indexed once per shard.
//!
//! Memory is bounded by `max_pages` over all shards together: past it, a shard evicts its
//! least recently used pages (those only placed before those a worker confirmed) to make room,
//! and drops new pages (counted) only when it has nothing left to evict.

mod lru;
mod published;
mod shard;
mod shared;
mod table;

pub use shared::{Event, IndexStats, SharedIndex};

use std::time::{Duration, Instant};

use shard::{SHARD_WORKERS, Shard};

/// An event the index cannot apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// A stored run's parent page is unknown: the worker's stream has a gap; resync it.
    #[error("unknown parent page {0:#x}: resync the worker")]
    UnknownParent(u64),
    /// The run's hashes or tokens do not fit the page size.
    #[error("malformed stored run: {0}")]
    Malformed(String),
    /// A slot past a shard's 64 (an internal error: the index maps slots to shards).
    #[error("worker slot {0} is past the {SHARD_WORKERS} of a shard")]
    Slot(usize),
}

/// Which workers hold which prefixes.
pub struct PrefixIndex {
    shards: Vec<Shard>,
    page_size: usize,
    max_pages: usize,
}

impl PrefixIndex {
    /// An empty index over pages of `page_size` tokens holding at most `max_pages` pages.
    pub fn new(page_size: usize, max_pages: usize) -> Self {
        Self { shards: Vec::new(), page_size: page_size.max(1), max_pages }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Most pages it holds, over all shards.
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// Pages indexed (a page held in several shards counts once per shard).
    pub fn pages(&self) -> usize {
        self.shards.iter().map(Shard::pages).sum()
    }

    /// New pages dropped because the index was full and nothing could be evicted.
    pub fn dropped(&self) -> u64 {
        self.shards.iter().map(Shard::dropped).sum()
    }

    /// Pages evicted, least recently used first, to make room for new ones.
    pub fn evicted(&self) -> u64 {
        self.shards.iter().map(Shard::evicted).sum()
    }

    /// Pages some worker's KV events confirm (the rest of [`Self::pages`] are the router's
    /// provisional placements). Counted in its page tables: 0 for a copy of the shared
    /// events' index, which keeps none ([`SharedIndex::stats`] counts the writer's).
    pub fn confirmed(&self) -> usize {
        self.shards.iter().map(Shard::confirmed).sum()
    }

    /// The shard of `worker` (made when new), its budget set to what the others leave, and
    /// the worker's slot in it.
    fn shard(&mut self, worker: usize) -> (&mut Shard, usize) {
        let i = worker / SHARD_WORKERS;
        while self.shards.len() <= i {
            self.shards.push(Shard::new(self.page_size, self.max_pages));
        }
        let others = self.pages() - self.shards[i].pages();
        let s = &mut self.shards[i];
        s.max_pages = self.max_pages.saturating_sub(others);
        (s, worker % SHARD_WORKERS)
    }

    /// A worker's KV event: it cached `tokens` (whole pages with `hashes`) below `parent`.
    pub fn stored(&mut self, worker: usize, parent: u64, hashes: &[u64], tokens: &[u32]) -> Result<(), IndexError> {
        let (s, slot) = self.shard(worker);
        s.stored(slot, parent, hashes, tokens)
    }

    /// A worker's KV event: it evicted these pages.
    pub fn removed(&mut self, worker: usize, hashes: &[u64]) -> Result<(), IndexError> {
        let (s, slot) = self.shard(worker);
        s.removed(slot, hashes)
    }

    /// Forgets everything `worker` holds (it resyncs, restarted, or died).
    pub fn clear_worker(&mut self, worker: usize) -> Result<(), IndexError> {
        match self.shards.get_mut(worker / SHARD_WORKERS) {
            Some(s) => s.clear_worker(worker % SHARD_WORKERS),
            None => Ok(()),
        }
    }

    /// The router placed `prompt` on `worker` at `now`: its whole pages count as held there
    /// for `ttl` (the worker's own events confirm them sooner). Marks whose time has come in
    /// that worker's shard are dropped first.
    pub fn provisional(
        &mut self,
        worker: usize,
        prompt: &[u32],
        now: Instant,
        ttl: Duration,
    ) -> Result<(), IndexError> {
        let (s, slot) = self.shard(worker);
        s.provisional(slot, prompt, now, ttl)
    }

    /// Drops provisional marks whose time has come, in every shard.
    pub fn expire(&mut self, now: Instant) {
        for s in &mut self.shards {
            s.expire(now);
        }
    }

    /// For each worker slot `0..workers`, how many tokens of `prompt` it holds (whole pages,
    /// provisional marks included).
    pub fn matched(&self, prompt: &[u32], workers: usize) -> Vec<usize> {
        let mut out = vec![0; workers];
        self.matched_into(prompt, &mut out);
        out
    }

    /// [`Self::matched`] for slots `0..out.len()`, into `out`: each slot's entry becomes the
    /// larger of what it held and what this index says.
    pub fn matched_into(&self, prompt: &[u32], out: &mut [usize]) {
        let workers = out.len();
        for (i, s) in self.shards.iter().enumerate() {
            let base = i * SHARD_WORKERS;
            if base >= workers {
                break;
            }
            s.matched_into(prompt, &mut out[base..workers.min(base + SHARD_WORKERS)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_radix::events::{ROOT_HASH, page_hashes};

    const PS: usize = 4;

    /// Issue 17: workers were bits of one u64, and a router refused a 65th prefill worker.
    /// Slots now go to shards of 64: a thousand workers each hold their own prefixes, and
    /// the page budget is the whole index's.
    #[test]
    fn a_thousand_workers_each_match_their_own_prefixes() {
        let t0 = Instant::now();
        let mut ix = PrefixIndex::new(PS, 10_000);
        let prompt = |w: usize| -> Vec<u32> { (0..8).map(|i| (w * 8 + i) as u32).collect() };
        for w in 0..1024 {
            let p = prompt(w);
            ix.stored(w, ROOT_HASH, &page_hashes(ROOT_HASH, &p, PS), &p).expect("stored");
        }
        assert_eq!(ix.pages(), 2048);
        for w in [0, 63, 64, 700, 1023] {
            let m = ix.matched(&prompt(w), 1024);
            assert_eq!(m.len(), 1024);
            assert_eq!(m.iter().enumerate().filter(|&(_, &n)| n > 0).collect::<Vec<_>>(), vec![(w, &8)], "worker {w}");
        }
        let shared: Vec<u32> = (9000..9012).collect();
        ix.provisional(1000, &shared, t0, Duration::from_secs(1)).expect("placed");
        ix.provisional(3, &shared, t0, Duration::from_secs(1)).expect("placed");
        let m = ix.matched(&shared, 1024);
        assert_eq!((m[3], m[1000], m.iter().sum::<usize>()), (12, 12, 24));
        ix.expire(t0 + Duration::from_secs(1));
        assert_eq!(ix.matched(&shared, 1024).iter().sum::<usize>(), 0, "every shard's marks lapse");
        ix.clear_worker(700).expect("cleared");
        assert_eq!(ix.matched(&prompt(700), 1024)[700], 0);
        assert_eq!(ix.pages(), 2046);
    }

    #[test]
    fn the_page_budget_is_the_whole_index() {
        let mut ix = PrefixIndex::new(PS, 3);
        let a: Vec<u32> = (0..8).collect();
        let b: Vec<u32> = (100..108).collect();
        ix.stored(1, ROOT_HASH, &page_hashes(ROOT_HASH, &a, PS), &a).expect("shard 0");
        ix.stored(70, ROOT_HASH, &page_hashes(ROOT_HASH, &b, PS), &b).expect("shard 1: dropped, not an error");
        assert_eq!((ix.pages(), ix.dropped()), (2, 2), "2 + 2 pages do not fit 3");
        ix.removed(1, &page_hashes(ROOT_HASH, &a, PS)).expect("removed");
        ix.stored(70, ROOT_HASH, &page_hashes(ROOT_HASH, &b, PS), &b).expect("fits now");
        assert_eq!(ix.matched(&b, 71)[70], 8);
    }
}
