//! Reuse of a prompt's shared head: the system prompt and earlier turns of a chat are not
//! tokenized again on every request.
//!
//! HF `tokenizers` first cuts the text at its added tokens and tokenizes the pieces between
//! them independently. So where a *boundary token* — an added special token matched as it
//! is written (not normalized, no strip or single-word rule) that no other added token can
//! overlap — ends, the ids of the text before it and of the text after it simply concatenate.
//! A rendered chat is such segments (`<|im_start|>user\n…<|im_end|>`, …): the cache keeps a
//! tree of them, each node a segment's text and ids below its parent, so a conversation's
//! next turn, or another conversation with the same system prompt, finds its head there and
//! tokenizes only the new segments. A node is found by (parent, hash of its text) and its text
//! compared in full, so a hit is always exact. The cache holds at most `max_bytes` (texts, ids
//! and bookkeeping) and forgets least recently used leaves first, one at a time as inserts need
//! the room (its leaves are kept in that order, so eviction never scans the tree).
//!
//! Plain text has no such tokens (a `/v1/completions` prompt, a long document pasted into one
//! message). For GPT-2's byte-level BPE the cache also cuts it between words, at a space after
//! a printable character and before a letter, or (in scripts written without spaces) after
//! a punctuation mark or other non-letter past ASCII and before a letter past ASCII, the first
//! such place past every ~2 KiB
//! ([`HeadCache::with_word_cuts`]): the same text before a cut gives the same cuts, so a shared
//! head is found whatever follows it.
//!
//! Tokenizers it cannot split safely (truncation or padding set, added specials kept in the
//! text, no boundary token) get no cache: [`HeadCache::new`] returns `None`.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;

use crate::TokenizeError;
use crate::char_class::Classes;
use crate::word_cuts::{wide_cut, with_cuts, word_cut};

mod tree;

use tree::{NODE_OVERHEAD, ROOT, Tree};

/// What the cache has saved, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeadCacheStats {
    /// Prompt ids taken from the cache.
    pub hit_tokens: u64,
    /// Prompt ids tokenized.
    pub miss_tokens: u64,
    /// Bytes held now.
    pub bytes: u64,
    /// Segments held now.
    pub segments: u64,
}

/// A tokenizer's cache of segment ids (see the module documentation).
pub struct HeadCache {
    boundaries: AhoCorasick,
    tree: Mutex<Tree>,
    hasher: foldhash::fast::RandomState,
    max_bytes: usize,
    hit_tokens: AtomicU64,
    miss_tokens: AtomicU64,
    /// The tree's bytes and segments, published after each change so that reading the
    /// figures (every request, for metrics) takes no lock.
    held_bytes: AtomicU64,
    held_segments: AtomicU64,
    /// Plain text is cut between words too ([`HeadCache::with_word_cuts`]).
    word_cuts: bool,
    /// And after a non-letter past ASCII ([`crate::word_cuts::wide_cut`]), where every added token is ASCII.
    wide_cuts: Option<Classes>,
}

impl std::fmt::Debug for HeadCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeadCache").field("max_bytes", &self.max_bytes).field("stats", &self.stats()).finish()
    }
}

/// Whether `a` and `b` can overlap in a text without one being all of the other's match: `b`
/// inside `a`, or a proper suffix of one equal to a prefix of the other.
fn overlaps(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let suffix_prefix = |x: &[u8], y: &[u8]| (1..x.len()).any(|i| y.starts_with(&x[i..]));
    let inside = |x: &[u8], y: &[u8]| x.windows(y.len().max(1)).any(|w| w == y);
    inside(a, b) || inside(b, a) || suffix_prefix(a, b) || suffix_prefix(b, a)
}

/// Whether a component of `def` (any depth) prepends only at the very start of the text.
fn first_only(def: &serde_json::Value) -> bool {
    match def {
        serde_json::Value::Object(o) => {
            o.get("prepend_scheme").and_then(serde_json::Value::as_str) == Some("first") || o.values().any(first_only)
        }
        serde_json::Value::Array(a) => a.iter().any(first_only),
        _ => false,
    }
}

/// Whether two matches of `s` can overlap: a proper suffix equal to a prefix.
fn overlaps_itself(s: &str) -> bool {
    let s = s.as_bytes();
    (1..s.len()).any(|i| s.starts_with(&s[i..]))
}

impl HeadCache {
    /// A cache for `tok` of at most `max_bytes`; `None` when `tok` cannot be split safely.
    pub fn new(tok: &tokenizers::Tokenizer, max_bytes: usize) -> Option<Self> {
        if max_bytes == 0 || tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return None;
        }
        if tok.get_added_vocabulary().get_encode_special_tokens() {
            return None;
        }
        // A pre-tokenizer that treats the start of the text unlike the start of any other
        // piece (Metaspace prepending `▁` only "first") would see each segment as the start.
        let pre = serde_json::to_value(tok.get_pre_tokenizer()).ok()?;
        let norm = serde_json::to_value(tok.get_normalizer()).ok()?;
        if first_only(&pre) || first_only(&norm) {
            return None;
        }
        let added: Vec<tokenizers::AddedToken> = tok.get_added_tokens_decoder().into_values().collect();
        // A single-word token looks at the character before it, which a segment cuts off.
        if added.iter().any(|t| t.single_word) {
            return None;
        }
        let boundary = |t: &tokenizers::AddedToken| {
            t.special
                && !t.normalized
                && !t.lstrip
                && !t.rstrip
                && !t.single_word
                && !t.content.is_empty()
                && !t.content.starts_with(char::is_whitespace)
                && !overlaps_itself(&t.content)
                && added.iter().all(|o| o.content == t.content || !overlaps(&t.content, &o.content))
        };
        let mut words: Vec<&str> = added.iter().filter(|t| boundary(t)).map(|t| t.content.as_str()).collect();
        if words.is_empty() {
            return None;
        }
        words.sort_unstable();
        words.dedup();
        let boundaries = AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(&words).ok()?;
        Some(Self {
            boundaries,
            tree: Mutex::new(Tree::default()),
            hasher: foldhash::fast::RandomState::default(),
            max_bytes,
            hit_tokens: AtomicU64::new(0),
            miss_tokens: AtomicU64::new(0),
            held_bytes: AtomicU64::new(0),
            held_segments: AtomicU64::new(0),
            word_cuts: false,
            wide_cuts: None,
        })
    }

    /// Cuts long stretches of plain text between words too, so that a shared head without
    /// special tokens (a completion's few-shot examples, a long document) is reused. Only for
    /// a tokenizer that [`word_cut`] holds for — byte-level BPE with GPT-2's, Llama 3's or
    /// Qwen2's pattern, as the fast path (`fast_bpe`) runs them — and whose added tokens hold
    /// no space; otherwise unchanged. With `wide` (GPT-2's pattern: in Llama 3's a mark goes
    /// with the letters after it) the cuts of [`wide_cut`] too, where every added token is
    /// ASCII.
    pub(crate) fn with_word_cuts(mut self, tok: &tokenizers::Tokenizer, wide: bool) -> Self {
        let added = tok.get_added_tokens_decoder();
        self.word_cuts = added.values().all(|t| !t.content.contains(' '));
        self.wide_cuts = (wide && self.word_cuts && added.values().all(|t| t.content.is_ascii())).then(Classes::get);
        self
    }

    /// What the cache has saved and holds (no lock taken).
    pub fn stats(&self) -> HeadCacheStats {
        HeadCacheStats {
            hit_tokens: self.hit_tokens.load(Ordering::Relaxed),
            miss_tokens: self.miss_tokens.load(Ordering::Relaxed),
            bytes: self.held_bytes.load(Ordering::Relaxed),
            segments: self.held_segments.load(Ordering::Relaxed),
        }
    }

    /// The ids of `text` as `tokenize(text)` gives them (the tokenizer's own ids, without
    /// BOS), reusing cached segments and tokenizing the others with `tokenize`.
    pub fn encode(
        &self,
        text: &str,
        tokenize: impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let raw = |s: &str| if s.is_empty() { Ok(Vec::new()) } else { tokenize(s) };
        let mut ends: Vec<usize> = self.boundaries.find_iter(text).map(|m| m.end()).collect();
        if let Some(cl) = self.wide_cuts {
            ends = with_cuts(text, &ends, |b, p| word_cut(b, p) || wide_cut(cl, b, p));
        } else if self.word_cuts {
            ends = with_cuts(text, &ends, word_cut);
        }
        if ends.is_empty() {
            let ids = raw(text)?;
            self.miss_tokens.fetch_add(ids.len() as u64, Ordering::Relaxed);
            return Ok(ids);
        }
        let keys: Vec<u64> = {
            let mut start = 0;
            ends.iter()
                .map(|&end| {
                    let k = self.hasher.hash_one(&text[start..end]);
                    start = end;
                    k
                })
                .collect()
        };
        let mut ids = Vec::new();
        let (mut at, found, mut parent, generation) = {
            let mut t = self.tree.lock();
            let (mut parent, mut start, mut found) = (ROOT, 0, 0);
            for (&end, &key) in ends.iter().zip(&keys) {
                let Some(&n) = t.by_key.get(&(parent, key)) else { break };
                if *t.nodes[n as usize].text != text[start..end] {
                    break;
                }
                t.touch(n);
                ids.extend_from_slice(&t.nodes[n as usize].ids);
                (parent, start, found) = (n, end, found + 1);
            }
            let generation = if parent == ROOT { 0 } else { t.nodes[parent as usize].generation };
            (start, found, parent, generation)
        };
        self.hit_tokens.fetch_add(ids.len() as u64, Ordering::Relaxed);
        let hit = ids.len();
        let mut fresh: Vec<(usize, Vec<u32>)> = Vec::with_capacity(ends.len() - found);
        for &end in &ends[found..] {
            fresh.push((at, raw(&text[at..end])?));
            at = end;
        }
        let last = *ends.last().expect("not empty");
        let tail = raw(&text[last..])?;
        for (_, seg) in &fresh {
            ids.extend_from_slice(seg);
        }
        ids.extend_from_slice(&tail);
        self.miss_tokens.fetch_add((ids.len() - hit) as u64, Ordering::Relaxed);
        let new_bytes: usize =
            fresh.iter().zip(&ends[found..]).map(|((s, v), e)| e - s + 4 * v.len() + NODE_OVERHEAD).sum();
        if !fresh.is_empty() && new_bytes <= self.max_bytes / 4 {
            let mut t = self.tree.lock();
            if parent == ROOT || (t.nodes[parent as usize].alive && t.nodes[parent as usize].generation == generation) {
                for (((s, seg), &e), &key) in fresh.into_iter().zip(&ends[found..]).zip(&keys[found..]) {
                    parent = match t.by_key.get(&(parent, key)) {
                        Some(&n) if *t.nodes[n as usize].text == text[s..e] => n,
                        Some(_) => break,
                        None => t.add(parent, key, &text[s..e], seg),
                    };
                }
                t.evict(self.max_bytes);
                self.held_bytes.store(t.bytes as u64, Ordering::Relaxed);
                self.held_segments.store(t.by_key.len() as u64, Ordering::Relaxed);
            }
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::json;

    use super::*;

    /// A word-level tokenizer over `words` with `added` tokens `(content, special, lstrip)`.
    fn tokenizer(added: &[(&str, bool, bool)]) -> tokenizers::Tokenizer {
        let words = ["[UNK]", "a", "b", "hello", "world", "<", ">", "|", "!", "."];
        let n = words.len();
        let vocab: serde_json::Map<String, serde_json::Value> =
            words.iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
        let added: Vec<_> = added
            .iter()
            .enumerate()
            .map(|(i, (c, special, lstrip))| {
                json!({"id": n + i, "content": c, "single_word": false, "lstrip": lstrip, "rstrip": false,
                       "normalized": false, "special": special})
            })
            .collect();
        let def = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        def.to_string().parse().expect("tokenizer")
    }

    /// Deterministic texts made of words, spaces and added tokens.
    fn texts(pieces: &[&str], count: usize, seed: u64) -> Vec<String> {
        let mut x = seed;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        (0..count)
            .map(|_| {
                let len = next() % 24;
                (0..len).map(|_| pieces[(next() % pieces.len() as u64) as usize]).collect::<String>()
            })
            .collect()
    }

    fn plain(tok: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
        tok.encode(text, false).expect("encode").get_ids().to_vec()
    }

    fn enc(cache: &HeadCache, tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>, TokenizeError> {
        cache.encode(text, |s| Ok(plain(tok, s)))
    }

    #[test]
    fn cached_ids_equal_uncached_ids_and_heads_are_reused() {
        let added = [("<s>", true, false), ("</s>", true, false), ("<|x|>", true, false)];
        let tok = tokenizer(&added);
        let cache = HeadCache::new(&tok, 1 << 20).expect("boundaries exist");
        let pieces = ["a", "b", " ", "  ", "hello", "world!", "<s>", "</s>", "<|x|>", "<", "|", ">", "\n", "é"];
        let all = texts(&pieces, 2_000, 7);
        for round in 0..2 {
            for t in &all {
                assert_eq!(enc(&cache, &tok, t).expect("cached"), plain(&tok, t), "round {round}: {t:?}");
            }
        }
        let stats = cache.stats();
        assert!(stats.hit_tokens > stats.miss_tokens / 2, "{stats:?}");
        // A conversation that grows: each turn's head is the previous turn's text.
        let mut chat = String::from("<s>hello world</s>");
        for turn in 0..20 {
            chat.push_str(&format!("<|x|>a b {turn} hello</s>"));
            let before = cache.stats().hit_tokens;
            assert_eq!(enc(&cache, &tok, &chat).expect("cached"), plain(&tok, &chat));
            if turn > 0 {
                assert!(cache.stats().hit_tokens > before, "turn {turn} reused nothing");
            }
        }
    }

    #[test]
    fn tokens_that_can_overlap_are_not_boundaries() {
        // "<a>" sits inside "<a>b", "x]" ends where "]y" could begin, "</s>" lstrips.
        let tok = tokenizer(&[
            ("<a>", true, false),
            ("<a>b", true, false),
            ("</s>", true, true),
            ("x]", true, false),
            ("]y", true, false),
        ]);
        assert!(HeadCache::new(&tok, 1 << 20).is_none());
        // A non-special added token is never a boundary.
        assert!(HeadCache::new(&tokenizer(&[("<s>", false, false)]), 1 << 20).is_none());
        // A token that overlaps itself ("aa" in "aaa") is not one either.
        assert!(overlaps_itself("<a<") && !overlaps_itself("<s>"));
        assert!(HeadCache::new(&tokenizer(&[("<s>", true, false)]), 0).is_none(), "0 bytes: no cache");
        // With overlapping ones present (the plain "<a>b" would be cut after "<a>" if "<a>" were a
        // boundary), a clean token still is a boundary, and every split still gives HF's ids.
        let tok =
            tokenizer(&[("<a>", true, false), ("<a>b", false, false), ("<s>", true, false), ("</s>", true, true)]);
        let cache = HeadCache::new(&tok, 1 << 20).expect("<s> is a boundary");
        for t in texts(&["<a>", "<a>b", "b", "<s>", " </s>", "  ", "hello"], 1_000, 3) {
            assert_eq!(enc(&cache, &tok, &t).expect("cached"), plain(&tok, &t), "{t:?}");
            assert_eq!(enc(&cache, &tok, &t).expect("cached"), plain(&tok, &t), "again: {t:?}");
        }
    }

    /// `tok` with its definition changed by `edit`.
    fn edited(tok: &tokenizers::Tokenizer, edit: impl FnOnce(&mut serde_json::Value)) -> tokenizers::Tokenizer {
        let mut def: serde_json::Value = serde_json::from_str(&tok.to_string(false).expect("json")).expect("json");
        edit(&mut def);
        def.to_string().parse().expect("tokenizer")
    }

    #[test]
    fn position_dependent_rules_get_no_cache() {
        let tok = tokenizer(&[("<s>", true, false), ("</s>", true, false)]);
        assert!(HeadCache::new(&tok, 1 << 20).is_some());
        // Metaspace prepending "▁" only at the start of the text: a segment is not the start.
        let first = edited(&tok, |d| {
            d["pre_tokenizer"] =
                json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
        });
        assert!(HeadCache::new(&first, 1 << 20).is_none());
        // A single-word added token looks at the character before it.
        let single = edited(&tok, |d| d["added_tokens"][1]["single_word"] = true.into());
        assert!(HeadCache::new(&single, 1 << 20).is_none());
    }

    #[test]
    fn the_cache_stays_within_its_bytes_and_forgets_the_oldest() {
        let tok = tokenizer(&[("<s>", true, false)]);
        let max = 64 * 1024;
        let cache = HeadCache::new(&tok, max).expect("cache");
        let first = "hello hello hello<s>world";
        enc(&cache, &tok, first).expect("encode");
        for i in 0..5_000 {
            let t = format!("<s>a {i} b<s>hello {i}<s>world");
            assert_eq!(enc(&cache, &tok, &t).expect("cached"), plain(&tok, &t));
            assert!(cache.stats().bytes as usize <= max, "{:?}", cache.stats());
        }
        let before = cache.stats().hit_tokens;
        enc(&cache, &tok, first).expect("encode");
        assert_eq!(cache.stats().hit_tokens, before, "the first conversation was forgotten");
        assert!(cache.stats().segments > 100, "{:?}", cache.stats());
    }

    /// Eviction's order is kept up as requests come (no scan of the tree): after inserts, hits
    /// and evictions, the leaves are exactly the live nodes without children, each under its
    /// last use.
    #[test]
    fn the_leaves_follow_the_tree() {
        let tok = tokenizer(&[("<s>", true, false)]);
        let cache = HeadCache::new(&tok, 16 * 1024).expect("cache");
        for i in 0..3_000 {
            // Some heads stay leaves and are used again; some get children, and halfway they
            // get no more, so that eviction leaves them childless.
            let t = match i {
                _ if i % 3 == 0 => format!("<s>c {}<s>x", i % 23),
                ..1_500 => format!("<s>a {} b<s>hello {i}<s>world", i % 37),
                _ => format!("<s>d {} e<s>hello {i}<s>world", i % 29),
            };
            assert_eq!(enc(&cache, &tok, &t).expect("cached"), plain(&tok, &t));
        }
        let t = cache.tree.lock();
        let want: BTreeSet<(u64, u32)> = (t.nodes.iter().zip(0u32..))
            .filter(|(n, _)| n.alive && n.children == 0)
            .map(|(n, i)| (n.used, i))
            .collect();
        assert_eq!(t.leaves, want);
        assert!(want.len() > 10 && t.nodes.iter().any(|n| !n.alive), "evicted some, kept some");
    }

    /// Wide cuts where every added token is ASCII, and not at all beside one past ASCII.
    #[test]
    fn an_added_token_past_ascii_turns_the_wide_cuts_off() {
        let plain = crate::bpe_fixtures::tokenizer(crate::bpe_fixtures::byte_level_json(true), false);
        let cache = HeadCache::new(&plain, 1 << 20).expect("cache").with_word_cuts(&plain, true);
        assert!(cache.wide_cuts.is_some());
        let mut wide = plain.clone();
        wide.add_special_tokens(&[tokenizers::AddedToken::from("<|東|>", true)]);
        let cache = HeadCache::new(&wide, 1 << 20).expect("cache").with_word_cuts(&wide, true);
        assert!(cache.word_cuts && cache.wide_cuts.is_none(), "an added token past ASCII turns the wide cuts off");
    }

    /// The head cache's word cuts (`word_cuts::word_cut`, every 48 bytes under test) on
    /// texts sharing heads of every length: the ids equal HF's, and heads are reused.
    #[test]
    fn word_cuts_of_the_head_cache_keep_hf_ids() {
        let smollm = json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, crate::bpe_fixtures::byte_level_json(true)]});
        let pres = [
            ("gpt2", crate::bpe_fixtures::byte_level_json(true)),
            ("smollm", smollm),
            ("llama3", crate::bpe_fixtures::split(crate::gguf_vocab::LLAMA3_PATTERN)),
            ("qwen2", crate::bpe_fixtures::split(crate::gguf_vocab::QWEN2_PATTERN)),
        ];
        for (name, pre) in pres {
            let tok = crate::bpe_fixtures::tokenizer(pre, false);
            let fast = crate::fast_bpe::FastBpe::new(&tok).expect("fast path");
            let wide = fast.gpt2();
            assert_eq!(wide, matches!(name, "gpt2" | "smollm"), "{name}");
            let cache = HeadCache::new(&tok, 1 << 20).expect("cache").with_word_cuts(&tok, wide);
            let base: String = crate::bpe_fixtures::texts(400, 9).concat();
            let tails = crate::bpe_fixtures::texts(300, 21);
            for (i, tail) in tails.iter().enumerate() {
                // Heads cut anywhere, also inside the texts' spaces and words.
                let mut at = (i * 7919) % base.len();
                while !base.is_char_boundary(at) {
                    at -= 1;
                }
                let t = format!("{}{tail}", &base[..at]);
                let want = tok.encode(t.as_str(), false).expect("encode").get_ids().to_vec();
                let got = cache.encode(&t, |s| Ok(fast.encode(s))).expect("cached");
                assert_eq!(got, want, "{name}: {t:?}");
            }
            let stats = cache.stats();
            assert!(stats.hit_tokens > stats.miss_tokens, "{name}: heads reused: {stats:?}");
            // A text that ends with a boundary token is all segments, none left as the tail:
            // the second time, nothing is tokenized.
            let mut half = base.len() / 2;
            while !base.is_char_boundary(half) {
                half -= 1;
            }
            let t = format!("{}<|im_end|>", &base[..half]);
            let first = cache.encode(&t, |s| Ok(fast.encode(s))).expect("cached");
            let missed = cache.stats().miss_tokens;
            assert_eq!(cache.encode(&t, |s| Ok(fast.encode(s))).expect("cached"), first);
            assert_eq!(cache.stats().miss_tokens, missed, "{name}: all of it from the cache");
            // Chinese: no spaces, so only the cuts after its punctuation (or an emoji) find the
            // shared head (GPT-2's pattern; Llama 3's keeps a mark with the letters after it).
            let clauses = ["渡轮在黎明时分", "穿过河流", "𠀀𠀂船长写了一封长信", "东京", "海鸥在港口上空盘旋"];
            let marks = ["，", "。", "🚢", "、", "」"];
            let head: String = (0..40).map(|i| format!("{}{}", clauses[i % 5], marks[i % 4 + i / 20])).collect();
            let before = cache.stats();
            for tail in ["乘客问了许多问题", "12 and more", "票价上涨了"] {
                let t = format!("{head}{tail}");
                let want = tok.encode(t.as_str(), false).expect("encode").get_ids().to_vec();
                assert_eq!(cache.encode(&t, |s| Ok(fast.encode(s))).expect("cached"), want, "{name}: {t:?}");
            }
            let after = cache.stats();
            let (hit, miss) = (after.hit_tokens - before.hit_tokens, after.miss_tokens - before.miss_tokens);
            assert!(!wide || hit > miss, "{name}: {after:?}");
        }
    }
}
