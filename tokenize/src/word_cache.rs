//! The fast BPE path's memory of the pre-tokens it has merged: a word's bytes to its ids.
//!
//! Most pre-tokens of prose are short (` the`, ` cache`, `.`) and merge to one id. Those of
//! up to 8 bytes with up to 3 ids live in an open-addressed table keyed by their bytes packed
//! into a `u64`: one multiply to hash, one probe that usually hits, two compares, no pointer
//! to follow and no allocation per word. The rest live in a hash map of boxed slices. (A
//! lookup in the map alone was most of the tokenizer's time on plain prose: hash, probe,
//! `memcmp` of the bytes behind a pointer.)

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;
use std::sync::mpsc::{self, SyncSender};

/// Longest word kept in the short table.
const SHORT_BYTES: usize = 8;
/// Most ids a word in the short table has.
const SHORT_IDS: usize = 3;
/// Cleared maps waiting for the freeing thread at most ([`free_elsewhere`]).
const FREEING: usize = 2;
/// Slots a short table starts with once a word is added.
const FIRST_SLOTS: usize = 1 << 10;

/// A word's bytes to its ids (see the module documentation).
#[derive(Default)]
pub(crate) struct WordCache {
    short: Short,
    long: LongWords,
}

impl WordCache {
    /// The ids of `word`, if it is here. (The short table's lookup is inlined into the
    /// tokenizer's loop; the map's is not.)
    #[inline(always)]
    pub(crate) fn get(&self, word: &[u8]) -> Option<&[u32]> {
        if let Some(ids) = pack(word).and_then(|key| self.short.get(key, word.len() as u8)) {
            return Some(ids);
        }
        // A short word with more ids than a slot holds is in the map.
        self.get_long(word)
    }

    #[inline(never)]
    fn get_long(&self, word: &[u8]) -> Option<&[u32]> {
        self.long.get(word).map(|ids| &ids[..])
    }

    /// Remembers `ids` as the ids of `word` (replacing what was there).
    pub(crate) fn insert(&mut self, word: &[u8], ids: &[u32]) {
        match pack(word).filter(|_| ids.len() <= SHORT_IDS) {
            Some(key) => self.short.insert(key, word.len() as u8, ids),
            None => {
                self.long.insert(word.into(), ids.into());
            }
        }
    }

    /// Words remembered.
    pub(crate) fn len(&self) -> usize {
        self.short.used + self.long.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every word. The short table keeps its slots; the map of long words is swapped
    /// for an empty one of the same capacity and handed, boxes and all, to a thread that frees
    /// it ([`free_elsewhere`]). So the text whose words filled the cache, and every tokenization
    /// waiting for the cache's lock meanwhile, wait neither for some 65,000 pairs of boxes to
    /// be freed nor for a new map to grow again.
    pub(crate) fn clear(&mut self) {
        self.short.clear();
        if !self.long.is_empty() {
            let empty = HashMap::with_capacity_and_hasher(self.long.capacity(), Default::default());
            free_elsewhere(std::mem::replace(&mut self.long, empty));
        }
    }

    /// Adds every word of `other`.
    pub(crate) fn extend(&mut self, other: WordCache) {
        for s in other.short.slots.iter().filter(|s| s.len > 0) {
            self.short.insert(s.key, s.len, &s.ids[..s.n as usize]);
        }
        self.long.extend(other.long);
    }
}

/// Words of more than [`SHORT_BYTES`] bytes or [`SHORT_IDS`] ids.
type LongWords = HashMap<Box<[u8]>, Box<[u32]>, foldhash::fast::RandomState>;

/// Frees `words` on the process's one freeing thread (started with the first), or here when
/// that thread cannot start or already has [`FREEING`] maps waiting. Clears come one per
/// 65,536 new words at most, so the thread is idle nearly always.
fn free_elsewhere(words: LongWords) {
    static FREER: OnceLock<Option<SyncSender<LongWords>>> = OnceLock::new();
    let freer = FREER.get_or_init(|| {
        let (tx, rx) = mpsc::sync_channel::<LongWords>(FREEING);
        let thread = std::thread::Builder::new().name("ferry-word-free".into());
        thread.spawn(move || rx.into_iter().for_each(drop)).ok().map(|_| tx)
    });
    match freer {
        // Full, or the thread gone: the words come back in the error, freed here.
        Some(tx) => drop(tx.try_send(words)),
        None => drop(words),
    }
}

/// `word`'s bytes in a `u64` when it is short enough: with its length (kept beside the key)
/// the packing is one-to-one. Up to 3 bytes: the first, middle and last byte; 4 to 8 bytes:
/// the first four and the last four (overlapping, together every byte).
#[inline]
fn pack(word: &[u8]) -> Option<u64> {
    let n = word.len();
    match n {
        1..=3 => Some(word[0] as u64 | (word[n / 2] as u64) << 8 | (word[n - 1] as u64) << 16),
        4..=SHORT_BYTES => {
            let lo = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            let hi = u32::from_le_bytes([word[n - 4], word[n - 3], word[n - 2], word[n - 1]]);
            Some(lo as u64 | (hi as u64) << 32)
        }
        _ => None,
    }
}

#[derive(Clone, Copy, Default)]
struct Slot {
    key: u64,
    /// The word's length in bytes; 0: an empty slot.
    len: u8,
    /// How many of `ids` are the word's.
    n: u8,
    ids: [u32; SHORT_IDS],
}

/// Open addressing, linear probing, at most half full; the multiplier is random per table
/// (multiply-shift hashing), so no fixed set of words collides everywhere.
struct Short {
    slots: Vec<Slot>,
    used: usize,
    /// `64 - log2(slots.len())`.
    shift: u32,
    mul: u64,
}

impl Default for Short {
    /// Empty, allocating nothing (the multiplier is drawn with the first slots): one is made
    /// for every text encoded, for the words it merges.
    fn default() -> Self {
        Self { slots: Vec::new(), used: 0, shift: 64, mul: 1 }
    }
}

impl Short {
    #[inline]
    fn home(&self, key: u64, len: u8) -> usize {
        ((key ^ (len as u64) << 56).wrapping_mul(self.mul) >> self.shift) as usize
    }

    #[inline]
    fn get(&self, key: u64, len: u8) -> Option<&[u32]> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key, len);
        loop {
            let s = &self.slots[i];
            if s.len == 0 {
                return None;
            }
            if s.key == key && s.len == len {
                return Some(&s.ids[..s.n as usize]);
            }
            i = (i + 1) & mask;
        }
    }

    fn insert(&mut self, key: u64, len: u8, ids: &[u32]) {
        if (self.used + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mut slot = Slot { key, len, n: ids.len() as u8, ids: [0; SHORT_IDS] };
        slot.ids[..ids.len()].copy_from_slice(ids);
        let mask = self.slots.len() - 1;
        let mut i = self.home(key, len);
        loop {
            let s = &mut self.slots[i];
            if s.len == 0 {
                *s = slot;
                self.used += 1;
                return;
            }
            if s.key == key && s.len == len {
                *s = slot;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    fn grow(&mut self) {
        if self.slots.is_empty() {
            self.mul = RandomState::new().hash_one(0u64) | 1;
        }
        let size = (self.slots.len() * 2).max(FIRST_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); size]);
        self.shift = 64 - size.trailing_zeros();
        self.used = 0;
        for s in old.into_iter().filter(|s| s.len > 0) {
            self.insert(s.key, s.len, &s.ids[..s.n as usize]);
        }
    }

    fn clear(&mut self) {
        self.slots.fill(Slot::default());
        self.used = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every word of every length from 0 to 12 over a small alphabet (so that many share
    /// bytes), with 1 to 4 ids each: each is found with its own ids after all are added,
    /// through growth, after `extend` and after a clear; none that was not added is found.
    #[test]
    fn finds_each_word_with_its_own_ids() {
        let alphabet = [b'a', b' ', 0u8, 0xff];
        let mut words: Vec<Vec<u8>> = vec![Vec::new()];
        let mut all = Vec::new();
        for _ in 0..12 {
            words = words
                .iter()
                .flat_map(|w| alphabet.iter().map(move |&b| [w.as_slice(), &[b]].concat()))
                .filter(|w| w.len() <= 4 || w.iter().map(|&b| b as u32).sum::<u32>() % 7 == 0)
                .collect();
            all.extend(words.iter().cloned());
        }
        let ids = |w: &[u8]| -> Vec<u32> { (0..1 + w.len() % 4).map(|k| w.len() as u32 * 1000 + k as u32).collect() };
        let (added, absent) = all.split_at(all.len() / 2 + 1);
        let mut cache = WordCache::default();
        for w in added {
            cache.insert(w, &ids(w));
        }
        let check = |c: &WordCache| {
            assert_eq!(c.len(), added.len());
            for w in added {
                assert_eq!(c.get(w), Some(&ids(w)[..]), "{w:?}");
            }
            for w in absent {
                assert_eq!(c.get(w), None, "{w:?} was never added");
            }
        };
        check(&cache);
        let mut moved = WordCache::default();
        moved.extend(cache);
        check(&moved);
        let capacity = moved.long.capacity();
        moved.clear();
        assert!(moved.is_empty() && moved.get(&added[1]).is_none());
        // A cleared cache keeps its map's size (the old map went to the freeing thread) and
        // works as before.
        assert!(moved.long.capacity() >= capacity && capacity > 0);
        for w in added {
            moved.insert(w, &ids(w));
        }
        check(&moved);
        moved.clear();
        assert!(moved.is_empty());
    }
}
