//! Byte-level BPE tokenizers for the tests: a vocabulary trained on a corpus of awkward
//! pieces (contractions, digits, whitespace runs, accents, CJK, emoji, special-looking text),
//! with any pre-tokenizer, as HF `tokenizers` builds it.

use std::collections::HashMap;

use serde_json::{Value as Json, json};

use crate::token_bytes::byte_chars;

pub(crate) const PIECES: &[&str] = &[
    "hello",
    "Hello",
    " world",
    "  ",
    "   ",
    "\n",
    "\n\n",
    " \n",
    "\r\n",
    "\t",
    "\u{a0}",
    "\u{3000}",
    "'s",
    "'LL",
    "'re",
    "don't",
    "123",
    "4567",
    " 89",
    "½",
    "٣",
    "é",
    "naïve",
    " Größe",
    "łódź",
    "Ærø",
    "×",
    "÷",
    "µ",
    "東京",
    "タワー",
    "渡轮在黎明，",
    "。",
    " паром",
    "Ёлка",
    " αλφα",
    "ς",
    "한국어",
    "〇",
    "\u{2028}",
    "🚢",
    "🌊",
    "e\u{301}",
    "!!",
    " ?",
    "...",
    "-",
    "$x",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "a",
    "b",
    " the",
    "ing",
    "x",
    "\u{200b}",
    "\u{85}",
];

/// A byte-level BPE vocabulary trained on `corpus`: the 256 byte characters, then `merges`
/// merges of the most frequent pair (a real, if small, BPE).
fn trained(corpus: &str, merges: usize) -> (serde_json::Map<String, Json>, Vec<String>) {
    let chars = byte_chars();
    let mut vocab: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let mut words: Vec<Vec<u32>> = corpus.split_inclusive(' ').map(|w| w.bytes().map(u32::from).collect()).collect();
    let mut list = Vec::new();
    for _ in 0..merges {
        let mut counts: HashMap<(u32, u32), usize> = HashMap::new();
        for w in &words {
            for p in w.windows(2) {
                *counts.entry((p[0], p[1])).or_default() += 1;
            }
        }
        let Some(((a, b), _)) = counts.into_iter().max_by(|x, y| x.1.cmp(&y.1).then_with(|| y.0.cmp(&x.0))) else {
            break;
        };
        let merged = format!("{}{}", vocab[a as usize], vocab[b as usize]);
        list.push(format!("{} {}", vocab[a as usize], vocab[b as usize]));
        let id = match vocab.iter().position(|t| *t == merged) {
            Some(i) => i as u32,
            None => {
                vocab.push(merged);
                (vocab.len() - 1) as u32
            }
        };
        for w in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == a && w[i + 1] == b {
                    w[i] = id;
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
    }
    (vocab.into_iter().enumerate().map(|(i, t)| (t, json!(i))).collect(), list)
}

pub(crate) fn tokenizer(pre: Json, ignore_merges: bool) -> tokenizers::Tokenizer {
    static TRAINED: std::sync::OnceLock<(serde_json::Map<String, Json>, Vec<String>)> = std::sync::OnceLock::new();
    let (vocab, merges) = TRAINED.get_or_init(|| {
        let mut rng = 11u64;
        let corpus: String = (0..4_000)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                PIECES[(rng % PIECES.len() as u64) as usize]
            })
            .collect();
        trained(&corpus, 300)
    });
    let n = vocab.len();
    let added: Vec<Json> = ["<|im_start|>", "<|im_end|>", "<s>"]
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"id": n + i, "content": c, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let def = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": pre, "post_processor": null, "decoder": byte_level_json(true),
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    });
    def.to_string().parse().expect("tokenizer")
}

pub(crate) fn texts(count: usize, seed: u64) -> Vec<String> {
    let mut x = seed;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..count).map(|_| (0..next() % 30).map(|_| PIECES[(next() % PIECES.len() as u64) as usize]).collect()).collect()
}

pub(crate) fn byte_level_json(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

pub(crate) fn split(pattern: &str) -> Json {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        byte_level_json(false)]})
}

/// The regex's pre-tokens of `text` as `fast_bpe` finds them: matches anchored where the last
/// ended, and the look-around `\s+(?!\S)` restored by hand (a run of whitespace that more
/// text follows gives up its last character), except for a run holding a line break where
/// `newline_alternative` (Llama 3's and Qwen2's earlier `\s*[\r\n]+`) took it.
pub(crate) fn regex_pieces(
    re: &regex_automata::meta::Regex,
    text: &str,
    newline_alternative: bool,
) -> Vec<(usize, usize)> {
    use regex_automata::{Anchored, Input};
    let mut out = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let m = re.search(&Input::new(text).range(at..).anchored(Anchored::Yes)).expect("matches everywhere");
        let mut end = m.end();
        let s = &text[at..end];
        if end < text.len()
            && s.chars().all(char::is_whitespace)
            && !(newline_alternative && s.contains(['\r', '\n']))
            && let Some((last, _)) = s.char_indices().next_back()
            && last > 0
        {
            end = at + last;
        }
        out.push((at, end));
        at = end;
    }
    out
}

/// A pre-tokenizer cut by hand against its regex, on `rounds` random texts of 1 to 14 pieces
/// of `alphabet` (a third ASCII only, a third of pieces `known` holds for, a third anything):
/// at each start of the regex's pre-tokens `next` must give the regex's end, or `None` — and
/// `None` only in a text `known` does not hold for. How many starts `next` decided.
pub(crate) fn hand_against_regex(
    re: &regex_automata::meta::Regex,
    newline_alternative: bool,
    alphabet: &[&str],
    known: fn(&str) -> bool,
    rounds: usize,
    next: impl Fn(&[u8], usize) -> Option<usize>,
) -> usize {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut decided = 0;
    for round in 0..rounds {
        let len = 1 + (rand() % 14) as usize;
        let only: fn(&str) -> bool = match round % 3 {
            0 => str::is_ascii,
            1 => known,
            _ => |_| true,
        };
        let text: String = (0..len)
            .map(|_| {
                loop {
                    let s = alphabet[(rand() % alphabet.len() as u64) as usize];
                    if only(s) {
                        break s;
                    }
                }
            })
            .collect();
        for (start, end) in regex_pieces(re, &text, newline_alternative) {
            match next(text.as_bytes(), start) {
                Some(e) => {
                    assert_eq!(e, end, "{text:?} from {start}");
                    decided += 1;
                }
                None => assert!(!known(&text), "{text:?} from {start} left undecided"),
            }
        }
    }
    decided
}
