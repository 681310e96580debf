//! Byte-level BPE without HF `tokenizers`' per-byte bookkeeping: the same ids as its `encode`
//! for the tokenizers Ferry builds from GGUF vocabularies (GPT-2, SmolLM2, Llama 3, Qwen2
//! pre-tokenizers) and HF directories of the same shape, several times faster.
//!
//! HF's pipeline keeps an alignment entry per byte of every piece it cuts and allocates for
//! every piece; on the router's 4,500-token prompts that is most of a request's CPU. Here:
//! 1. added tokens are cut out with the rule HF uses (leftmost-longest over their texts, all
//!    of them matched as written — the only shape accepted);
//! 2. the pieces between them are pre-tokenized with `regex-automata` (the `regex` crate's
//!    engine: a lazy DFA, not a backtracking VM), each match anchored where the last ended (the
//!    patterns match at every character, so no reverse scan is needed to find a start). The
//!    patterns' one look-around, `\s+(?!\S)`, is dropped and restored by hand: a run of
//!    whitespace matched by the plain `\s+` that more text follows gives up its last
//!    character, which is exactly what the backtracking `\s+(?!\S)` matches first. GPT-2's,
//!    Llama 3's and Qwen2's patterns are decided by hand instead ([`gpt2_by_hand`],
//!    [`llama3_by_hand`]), in every script and in emoji; the regex is left the contraction
//!    `'ſ` under Llama 3's and Qwen2's;
//! 3. each pre-token's bytes are merged lowest rank first, leftmost among equals — HF's
//!    `Word::merge_all` — and remembered (a bounded cache of words).
//!
//! [`FastBpe::new`] accepts only what it reproduces exactly and returns `None` otherwise (the
//! tokenizer then uses HF). Tests compare the two on many texts, every pre-tokenizer.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use aho_corasick::{AhoCorasick, MatchKind};

use crate::char_class::Classes;
use crate::gguf_vocab::{LLAMA3_PATTERN, QWEN2_PATTERN};
use crate::gpt2_by_hand;
use crate::llama3_by_hand;
use crate::token_bytes::{byte_chars, byte_level_byte};
use crate::word_cache::WordCache;
use parking_lot::{RwLock, RwLockReadGuard};
use serde_json::Value as Json;

/// GPT-2's pre-tokenizer pattern (HF's `ByteLevel` with `use_regex`).
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// The look-around alternative each accepted pattern has once, just before plain `\s+`.
const LOOKAHEAD: &str = r"\s+(?!\S)|";
/// Words remembered before the cache starts again.
const MAX_CACHED_WORDS: usize = 1 << 16;
/// Words of at most this many bytes are merged on the stack ([`FastBpe::merge_short`]).
const SHORT_MERGE: usize = 64;
/// Longer words are not remembered (HF's limit too): a prompt of long runs cannot pin memory.
const MAX_CACHED_WORD: usize = 256;
/// Words looked up between chances for a waiting writer to take the cache.
const LOOKUPS_PER_YIELD: u32 = 256;

/// The pre-tokenizer patterns the fast path accepts, each also cut by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pattern {
    /// GPT-2's ([`gpt2_by_hand`]).
    Gpt2,
    /// Llama 3's: up to three numbers a pre-token ([`llama3_by_hand`]).
    Llama3,
    /// Qwen2's: one number a pre-token ([`llama3_by_hand`]).
    Qwen2,
}

impl Pattern {
    fn regex(self) -> &'static str {
        match self {
            Pattern::Gpt2 => GPT2_PATTERN,
            Pattern::Llama3 => LLAMA3_PATTERN,
            Pattern::Qwen2 => QWEN2_PATTERN,
        }
    }
}

/// How pieces are cut before BPE.
#[derive(Debug)]
struct Pre {
    /// The pattern without its look-around: where the hand leaves a pre-token to it.
    re: regex_automata::meta::Regex,
    pattern: Pattern,
    /// Digits are cut one by one first (SmolLM2's `Digits { individual_digits }`).
    digits: bool,
    /// The Unicode classes the hand and the digit split read.
    classes: Classes,
}

/// The word cache as one encode reads it: one read lock for the whole text (yielded now and
/// then to a waiting writer, and released while a new word is merged), and the words it had
/// to merge, added when the text is done.
struct Words<'a> {
    cache: RwLockReadGuard<'a, WordCache>,
    fresh: WordCache,
    lookups: u32,
}

/// Appends a word's ids. Most words have one to three: pushed one by one, since
/// `extend_from_slice` calls `memcpy` for them (measured: 14 % of encoding a prompt of prose).
#[inline(always)]
fn push_ids(out: &mut Vec<u32>, ids: &[u32]) {
    if ids.len() <= 3 {
        for &id in ids {
            out.push(id);
        }
    } else {
        out.extend_from_slice(ids);
    }
}

/// A byte-level BPE tokenizer equal to an HF one (see the module documentation).
pub(crate) struct FastBpe {
    added: Option<AhoCorasick>,
    added_ids: Vec<u32>,
    pre: Pre,
    byte_ids: [u32; 256],
    /// (left, right) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32), foldhash::fast::RandomState>,
    /// `ignore_merges`: a pre-token that is a whole vocabulary entry is that entry.
    whole: Option<HashMap<Vec<u8>, u32, foldhash::fast::RandomState>>,
    cache: RwLock<WordCache>,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe").field("pre", &self.pre).field("merges", &self.merges.len()).finish()
    }
}

fn byte_level(p: &Json, use_regex: bool) -> bool {
    p["type"] == "ByteLevel"
        && p["use_regex"].as_bool() == Some(use_regex)
        && p["add_prefix_space"].as_bool() != Some(true)
}

fn pre_of(p: &Json) -> Option<Pre> {
    let plain = |pattern: Pattern, digits: bool| -> Option<Pre> {
        let re = regex_automata::meta::Regex::new(&pattern.regex().replace(LOOKAHEAD, "")).ok()?;
        Some(Pre { re, pattern, digits, classes: Classes::get() })
    };
    if byte_level(p, true) {
        return plain(Pattern::Gpt2, false);
    }
    let list = p["pretokenizers"].as_array().filter(|_| p["type"] == "Sequence")?;
    match list.as_slice() {
        [d, b] if d["type"] == "Digits" && d["individual_digits"] == true && byte_level(b, true) => {
            plain(Pattern::Gpt2, true)
        }
        [s, b] if s["type"] == "Split" && byte_level(b, false) => {
            let ok = s["behavior"] == "Isolated" && s["invert"] != true;
            // Only the patterns whose look-around rule is shown to hold (each matches at every
            // character, never matches empty, and takes whitespace holding a line break with
            // its earlier `\s*[\r\n]+`).
            match s["pattern"]["Regex"].as_str().filter(|_| ok)? {
                LLAMA3_PATTERN => plain(Pattern::Llama3, false),
                QWEN2_PATTERN => plain(Pattern::Qwen2, false),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Why a tokenizer cannot take the fast path (it would not give HF's ids).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct NotFast(String);

impl FastBpe {
    /// Built from HF's own definition of `tok`; `None` where it would not give HF's ids.
    pub(crate) fn new(tok: &tokenizers::Tokenizer) -> Option<Self> {
        Self::build(tok).ok()
    }

    /// [`new`](Self::new), saying why not.
    pub(crate) fn build(tok: &tokenizers::Tokenizer) -> Result<Self, NotFast> {
        fn need<T>(v: Option<T>, what: &str) -> Result<T, NotFast> {
            v.ok_or_else(|| NotFast(what.to_string()))
        }
        if tok.get_truncation().is_some() || tok.get_padding().is_some() || tok.get_normalizer().is_some() {
            return Err(NotFast("truncation, padding or a normalizer".into()));
        }
        if tok.get_added_vocabulary().get_encode_special_tokens() {
            return Err(NotFast("special tokens encoded as text".into()));
        }
        let def: Json = serde_json::from_str(&tok.to_string(false).map_err(|e| NotFast(e.to_string()))?)
            .map_err(|e| NotFast(e.to_string()))?;
        let model = &def["model"];
        let null_or_false = |v: &Json| v.is_null() || *v == false;
        if model["type"] != "BPE"
            || !model["dropout"].is_null()
            || !model["continuing_subword_prefix"].is_null()
            || !model["end_of_word_suffix"].is_null()
            || !null_or_false(&model["byte_fallback"])
        {
            return Err(NotFast("not a plain BPE model".into()));
        }
        let pre = need(pre_of(&def["pre_tokenizer"]), "pre-tokenizer")?;
        let unk = !model["unk_token"].is_null();
        // Added tokens: all matched as written, as HF's split does for such tokens.
        let mut words = Vec::new();
        let mut added_ids = Vec::new();
        for (id, t) in tok.get_added_tokens_decoder() {
            if t.lstrip || t.rstrip || t.single_word || t.normalized || t.content.is_empty() {
                return Err(NotFast(format!("added token {:?} is not matched as written", t.content)));
            }
            words.push(t.content);
            added_ids.push(id);
        }
        let added = if words.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&words)
                    .map_err(|e| NotFast(e.to_string()))?,
            )
        };
        // The vocabulary by raw bytes.
        let chars = byte_chars();
        let to_bytes = |s: &str| -> Option<Vec<u8>> { s.chars().map(byte_level_byte).collect() };
        let vocab = need(model["vocab"].as_object(), "vocabulary")?;
        let mut by_text: HashMap<&str, u32> = HashMap::with_capacity(vocab.len());
        for (k, v) in vocab {
            by_text.insert(k.as_str(), need(v.as_u64().and_then(|v| u32::try_from(v).ok()), "a token id")?);
        }
        let mut byte_ids = [u32::MAX; 256];
        for (b, c) in chars.iter().enumerate() {
            // A byte without a token is dropped, as HF's BPE does without an unknown token
            // (SmolLM2 has none for some control bytes).
            match by_text.get(c.to_string().as_str()) {
                Some(&id) => byte_ids[b] = id,
                // With an unknown token HF would emit it (fused or not) instead.
                None if unk => {
                    return Err(NotFast(format!("byte {b:#04x} has no token and there is an unknown token")));
                }
                None => {}
            }
        }
        let mut merges = HashMap::default();
        for (rank, m) in need(model["merges"].as_array(), "merges")?.iter().enumerate() {
            let (a, b) = match m {
                Json::String(s) => need(s.split_once(' '), "a merge")?,
                Json::Array(p) if p.len() == 2 => (need(p[0].as_str(), "a merge")?, need(p[1].as_str(), "a merge")?),
                _ => return Err(NotFast(format!("merge {m}"))),
            };
            let merged = format!("{a}{b}");
            let id = |t: &str| need(by_text.get(t).copied(), &format!("merge token {t:?}"));
            // A pair listed twice keeps its last rank, as HF's map does.
            merges.insert((id(a)?, id(b)?), (rank as u32, id(&merged)?));
        }
        let whole = if model["ignore_merges"] == true {
            Some(vocab.iter().filter_map(|(k, v)| Some((to_bytes(k)?, u32::try_from(v.as_u64()?).ok()?))).collect())
        } else {
            None
        };
        Ok(Self { added, added_ids, pre, byte_ids, merges, whole, cache: RwLock::new(WordCache::default()) })
    }

    /// Whether the pre-tokenizer is GPT-2's pattern (with or without digits cut first): the
    /// head cache may then cut plain text after a mark too (`word_cuts::wide_cut`), not only
    /// between words (`word_cuts::word_cut`), which every accepted pattern allows.
    pub(crate) fn gpt2(&self) -> bool {
        self.pre.pattern == Pattern::Gpt2
    }

    /// The ids of `text`, as HF's `encode(text, false)` gives them.
    pub(crate) fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut words = Words { cache: self.cache.read(), fresh: WordCache::default(), lookups: 0 };
        let mut at = 0;
        if let Some(added) = &self.added {
            for m in added.find_iter(text) {
                self.piece(&text[at..m.start()], &mut words, &mut out);
                out.push(self.added_ids[m.pattern().as_usize()]);
                at = m.end();
            }
        }
        self.piece(&text[at..], &mut words, &mut out);
        let Words { cache, fresh, .. } = words;
        drop(cache);
        if !fresh.is_empty() {
            let mut cache = self.cache.write();
            if cache.len() + fresh.len() > MAX_CACHED_WORDS {
                cache.clear();
            }
            cache.extend(fresh);
        }
        out
    }

    /// A piece between added tokens.
    fn piece(&self, piece: &str, words: &mut Words<'_>, out: &mut Vec<u32>) {
        if !self.pre.digits {
            return self.regex_piece(piece, words, out);
        }
        let mut start = 0;
        let mut at = 0;
        while let Some(i) = gpt2_by_hand::next_digit_or_wide(piece.as_bytes(), at) {
            // `i` starts a character: `at` always does, and the scan stops at a lead byte first.
            let c = piece[i..].chars().next().expect("a character starts here");
            at = i + c.len_utf8();
            if self.pre.classes.numeric(c) {
                self.regex_piece(&piece[start..i], words, out);
                self.regex_piece(&piece[i..at], words, out);
                start = at;
            }
        }
        self.regex_piece(&piece[start..], words, out);
    }

    fn regex_piece(&self, piece: &str, words: &mut Words<'_>, out: &mut Vec<u32>) {
        use regex_automata::{Anchored, Input};
        let mut at = 0;
        while at < piece.len() {
            let (cl, text) = (self.pre.classes, piece.as_bytes());
            let by_hand = match self.pre.pattern {
                Pattern::Gpt2 => gpt2_by_hand::next(cl, text, at),
                Pattern::Llama3 => llama3_by_hand::next(cl, text, at, 3),
                Pattern::Qwen2 => llama3_by_hand::next(cl, text, at, 1),
            };
            if let Some(end) = by_hand {
                self.word(&text[at..end], words, out);
                at = end;
                continue;
            }
            // The accepted patterns match at every character, so a match anchored here is the
            // leftmost one, found without the reverse scan an unanchored search needs for its
            // start; the unanchored search is the fallback.
            let input = Input::new(piece).range(at..);
            let found =
                self.pre.re.search(&input.clone().anchored(Anchored::Yes)).or_else(|| self.pre.re.search(&input));
            let Some(m) = found else {
                self.word(&piece.as_bytes()[at..], words, out);
                break;
            };
            let (start, mut end) = (m.start(), m.end());
            if end <= at {
                // An empty match (none of the accepted patterns has one): never loop on it.
                self.word(&piece.as_bytes()[at..], words, out);
                break;
            }
            if start > at {
                // Text no alternative matched (none of the accepted patterns leaves any).
                self.word(&piece.as_bytes()[at..start], words, out);
            }
            let s = &piece[start..end];
            if end < piece.len()
                && s.chars().all(char::is_whitespace)
                // Llama 3's and Qwen2's earlier `\s*[\r\n]+` takes whitespace with a line break.
                && !(self.pre.pattern != Pattern::Gpt2 && s.contains(['\r', '\n']))
                && let Some((last, _)) = s.char_indices().next_back()
                && last > 0
            {
                // `\s+(?!\S)`: the run gives up its last character to what follows.
                end = start + last;
            }
            self.word(&piece.as_bytes()[start..end], words, out);
            at = end;
        }
    }

    /// One pre-token. A remembered word is the common case (inlined); the rest is
    /// [`new_word`](Self::new_word). (A word in `whole` is never remembered, so the order of
    /// the two lookups does not change the ids.)
    #[inline(always)]
    fn word(&self, bytes: &[u8], words: &mut Words<'_>, out: &mut Vec<u32>) {
        words.lookups += 1;
        if words.lookups.is_multiple_of(LOOKUPS_PER_YIELD) {
            RwLockReadGuard::bump(&mut words.cache);
        }
        match words.cache.get(bytes) {
            Some(ids) => push_ids(out, ids),
            None => self.new_word(bytes, words, out),
        }
    }

    #[inline(never)]
    fn new_word(&self, bytes: &[u8], words: &mut Words<'_>, out: &mut Vec<u32>) {
        if bytes.is_empty() {
            return;
        }
        if let Some(id) = self.whole.as_ref().and_then(|w| w.get(bytes)) {
            out.push(*id);
            return;
        }
        if let Some(ids) = words.fresh.get(bytes) {
            out.extend_from_slice(ids);
            return;
        }
        let from = out.len();
        if bytes.len() <= SHORT_MERGE {
            self.merge_short(bytes, out);
        } else {
            // Merged without the lock: a long word must not hold up a writer, and through it
            // every other reader.
            out.extend(RwLockReadGuard::unlocked(&mut words.cache, || self.merge(bytes)));
        }
        if bytes.len() < MAX_CACHED_WORD && words.fresh.len() < MAX_CACHED_WORDS {
            words.fresh.insert(bytes, &out[from..]);
        }
    }

    /// The rank and result of merging `a` and `b`; `(u32::MAX, 0)` when they do not merge.
    #[inline]
    fn pair(&self, a: u32, b: u32) -> (u32, u32) {
        self.merges.get(&(a, b)).copied().unwrap_or((u32::MAX, 0))
    }

    /// [`merge`](Self::merge) of a word of at most [`SHORT_MERGE`] bytes, into `out`, on the
    /// stack: each round merges the leftmost of the lowest-ranked pairs, which is the pair
    /// HF's queue gives next (it holds every pair the word has now, and skips stale ones), and
    /// looks up only the two pairs the merge made.
    fn merge_short(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let mut ids = [0u32; SHORT_MERGE];
        let mut n = 0;
        for &b in bytes {
            let id = self.byte_ids[b as usize];
            if id != u32::MAX {
                ids[n] = id;
                n += 1;
            }
        }
        // `pairs[i]`: merging `ids[i]` and `ids[i + 1]`.
        let mut pairs = [(u32::MAX, 0u32); SHORT_MERGE];
        for i in 0..n.saturating_sub(1) {
            pairs[i] = self.pair(ids[i], ids[i + 1]);
        }
        while n > 1 {
            let (mut at, mut rank) = (0, u32::MAX);
            for (i, p) in pairs[..n - 1].iter().enumerate() {
                if p.0 < rank {
                    (at, rank) = (i, p.0);
                }
            }
            if rank == u32::MAX {
                break;
            }
            ids[at] = pairs[at].1;
            ids.copy_within(at + 2..n, at + 1);
            if at + 2 < n {
                pairs.copy_within(at + 2..n - 1, at + 1);
            }
            n -= 1;
            if at + 1 < n {
                pairs[at] = self.pair(ids[at], ids[at + 1]);
            }
            if at > 0 {
                pairs[at - 1] = self.pair(ids[at - 1], ids[at]);
            }
        }
        out.extend_from_slice(&ids[..n]);
    }

    /// HF's `Word::merge_all` without dropout: the lowest-ranked pair first, the leftmost
    /// among equal ranks; entries made stale by earlier merges skipped.
    fn merge(&self, bytes: &[u8]) -> Vec<u32> {
        let mut id: Vec<u32> = bytes.iter().map(|&b| self.byte_ids[b as usize]).filter(|&i| i != u32::MAX).collect();
        let n = id.len();
        let mut prev: Vec<isize> = (0..n as isize).map(|i| i - 1).collect();
        let mut next: Vec<isize> = (1..=n as isize).map(|i| if i == n as isize { -1 } else { i }).collect();
        let mut gone = vec![false; n];
        let mut queue: BinaryHeap<Reverse<(u32, usize, u32)>> = BinaryHeap::with_capacity(n);
        for i in 0..n.saturating_sub(1) {
            if let Some(&(rank, m)) = self.merges.get(&(id[i], id[i + 1])) {
                queue.push(Reverse((rank, i, m)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = queue.pop() {
            if gone[pos] || next[pos] == -1 {
                continue;
            }
            let right = next[pos] as usize;
            if self.merges.get(&(id[pos], id[right])).is_none_or(|&(_, m)| m != new_id) {
                continue;
            }
            id[pos] = new_id;
            gone[right] = true;
            next[pos] = next[right];
            if next[right] >= 0 {
                prev[next[right] as usize] = pos as isize;
            }
            if prev[pos] >= 0 {
                let p = prev[pos] as usize;
                if let Some(&(rank, m)) = self.merges.get(&(id[p], id[pos])) {
                    queue.push(Reverse((rank, p, m)));
                }
            }
            if next[pos] >= 0 {
                let nx = next[pos] as usize;
                if let Some(&(rank, m)) = self.merges.get(&(id[pos], id[nx])) {
                    queue.push(Reverse((rank, pos, m)));
                }
            }
        }
        id.iter().zip(&gone).filter(|(_, g)| !**g).map(|(i, _)| *i).collect()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::bpe_fixtures::{byte_level_json, split, texts, tokenizer};
    use crate::gguf_vocab::{LLAMA3_PATTERN, QWEN2_PATTERN};

    #[test]
    fn fast_ids_equal_hf_ids_for_every_pre_tokenizer() {
        let pres = [
            ("gpt2", byte_level_json(true)),
            (
                "smollm",
                json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level_json(true)]}),
            ),
            ("llama3", split(LLAMA3_PATTERN)),
            ("qwen2", split(QWEN2_PATTERN)),
        ];
        for (name, pre) in pres {
            for ignore_merges in [false, true] {
                let tok = tokenizer(pre.clone(), ignore_merges);
                let fast = FastBpe::new(&tok).unwrap_or_else(|| panic!("{name}: no fast path"));
                for t in texts(3_000, 5) {
                    let want = tok.encode(t.as_str(), false).expect("encode").get_ids().to_vec();
                    assert_eq!(fast.encode(&t), want, "{name} (ignore_merges {ignore_merges}): {t:?}");
                    assert_eq!(fast.encode(&t), want, "{name}, cached words: {t:?}");
                }
            }
        }
    }

    /// The stack merge against the queue merge (HF's order) on words of every length it takes:
    /// pieces of the fixtures' texts run together, and runs of one or two repeated bytes
    /// (pairs of equal rank side by side, overlapping).
    #[test]
    fn the_short_merge_is_the_queue_merge() {
        let tok = tokenizer(byte_level_json(true), false);
        let fast = FastBpe::new(&tok).expect("fast path");
        let mut words: Vec<Vec<u8>> = texts(2_000, 11).into_iter().map(String::into_bytes).collect();
        for len in 1..=SHORT_MERGE {
            words.push(b"l".repeat(len));
            words.push(b"lo".iter().copied().cycle().take(len).collect());
        }
        let mut merged = 0;
        for w in words.iter().filter(|w| !w.is_empty()) {
            let w = &w[..w.len().min(SHORT_MERGE)];
            let mut short = Vec::new();
            fast.merge_short(w, &mut short);
            let queue = fast.merge(w);
            assert_eq!(short, queue, "{:?}", String::from_utf8_lossy(w));
            merged += usize::from(queue.len() < w.len());
        }
        assert!(merged > 1_000, "only {merged} words merged at all");
    }

    #[test]
    fn shapes_it_cannot_reproduce_get_no_fast_path() {
        let other = json!({"type": "Whitespace"});
        assert!(FastBpe::new(&tokenizer(other, false)).is_none());
        let prefix = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
        assert!(FastBpe::new(&tokenizer(prefix, false)).is_none());
        let lookbehind = split(r"(?<=a)b|\s+(?!\S)|\s+");
        assert!(FastBpe::new(&tokenizer(lookbehind, false)).is_none());
        // A pattern not known to obey the look-around rule (an earlier alternative takes
        // line breaks, without the newline rule's shape).
        let unknown = split(r"'s|\s*[\r\n]+| ?[^\s\p{L}\p{N}]+| ?\p{L}+| ?\p{N}+|\s+(?!\S)|\s+");
        assert!(FastBpe::new(&tokenizer(unknown, false)).is_none());
        // A byte without a token where HF would emit the unknown token instead of dropping it.
        let tok = tokenizer(byte_level_json(true), false);
        let mut def: Json = serde_json::from_str(&tok.to_string(false).expect("json")).expect("json");
        let vocab = def["model"]["vocab"].as_object_mut().expect("vocab");
        let id = vocab.remove(&byte_chars()[1].to_string()).expect("byte 1");
        vocab.insert("<unk>".into(), id);
        def["model"]["unk_token"] = "<unk>".into();
        let unk: tokenizers::Tokenizer = def.to_string().parse().expect("tokenizer");
        assert!(
            FastBpe::build(&unk).is_err_and(|e| e.to_string().contains("unknown token")),
            "{:?}",
            FastBpe::build(&unk).err()
        );
    }
}
