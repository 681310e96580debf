//! The classes GPT-2's pre-tokenizer pattern sorts characters into — letters (`\p{L}`),
//! numbers (`\p{N}`), whitespace (`\s`) and everything else — for every character of the
//! Basic Multilingual Plane (U+0000–U+FFFF), two bits each: a 16 KiB table built once from
//! `regex-syntax`'s Unicode tables, the ones the fast path's regex is compiled from. So a
//! character is classified here exactly as the regex classifies it, in Cyrillic, Greek,
//! Chinese or any other script of the plane. Characters past it (emoji, rare ideographs:
//! four bytes of UTF-8) are [`UNKNOWN`], left to the regex.
//!
//! The same table answers `char::is_numeric` (what SmolLM2's `Digits` pre-tokenizer cuts
//! out, and HF asks), where the two definitions agree on the whole plane (checked when the
//! table is built; otherwise [`Classes::numeric`] asks `char::is_numeric` itself).

use std::sync::LazyLock;

use regex_syntax::hir::{Class, HirKind};

/// Neither a letter, a number nor whitespace: `[^\s\p{L}\p{N}]`.
pub(crate) const OTHER: u8 = 0;
/// `\p{L}`.
pub(crate) const LETTER: u8 = 1;
/// `\p{N}`.
pub(crate) const NUMBER: u8 = 2;
/// `\s` (Unicode's White_Space).
pub(crate) const SPACE: u8 = 3;
/// Past the table (a character of four UTF-8 bytes), or not a whole character.
pub(crate) const UNKNOWN: u8 = 4;

/// Words of the table: the plane's 65,536 characters, 32 a word.
const WORDS: usize = 0x1_0000 / 32;

struct Table {
    /// Two bits a character, 32 characters a word.
    bits: Box<[u64; WORDS]>,
    /// Whether `NUMBER` is exactly `char::is_numeric` on the plane.
    numeric_agrees: bool,
}

static TABLE: LazyLock<Table> = LazyLock::new(|| {
    let mut bits = Box::new([0u64; WORDS]);
    for (pattern, class) in [(r"\p{L}", LETTER), (r"\p{N}", NUMBER), (r"\s", SPACE)] {
        let hir = regex_syntax::parse(pattern).expect("a Unicode class");
        let HirKind::Class(Class::Unicode(set)) = hir.kind() else { panic!("{pattern} is not a Unicode class") };
        for r in set.ranges() {
            for c in r.start() as u32..=(r.end() as u32).min(0xFFFF) {
                bits[c as usize / 32] |= (class as u64) << (c % 32 * 2);
            }
        }
    }
    let numeric_agrees = (0..0x1_0000u32)
        .filter_map(char::from_u32)
        .all(|c| c.is_numeric() == ((bits[c as usize / 32] >> (c as usize % 32 * 2)) & 3 == NUMBER as u64));
    Table { bits, numeric_agrees }
});

/// The table, read without the `LazyLock`'s check on every character: fetched once where a
/// tokenizer is built ([`Classes::get`]) and kept beside its pattern.
#[derive(Clone, Copy)]
pub(crate) struct Classes {
    bits: &'static [u64; WORDS],
    numeric_agrees: bool,
}

impl std::fmt::Debug for Classes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Classes")
    }
}

impl Classes {
    /// The table (built on first use).
    pub(crate) fn get() -> Self {
        Self { bits: &TABLE.bits, numeric_agrees: TABLE.numeric_agrees }
    }

    /// The class of a character of the plane.
    #[inline(always)]
    fn of(self, c: u32) -> u8 {
        ((self.bits[c as usize / 32 % WORDS] >> (c % 32 * 2)) & 3) as u8
    }

    /// The class of the character that starts at `i` (from its lead byte, `text[i] >= 0x80`)
    /// and its length in bytes; [`UNKNOWN`] past the plane or where the text ends too soon.
    /// `text` must be UTF-8 (a `str`'s bytes): the continuation bytes are not checked.
    #[inline(always)]
    pub(crate) fn wide(self, text: &[u8], i: usize) -> (u8, usize) {
        let cont = |k: usize| text.get(i + k).map(|&b| (b & 0x3F) as u32);
        match text[i] {
            b @ 0xC2..=0xDF => match cont(1) {
                Some(b1) => (self.of((b as u32 & 0x1F) << 6 | b1), 2),
                None => (UNKNOWN, 1),
            },
            b @ 0xE0..=0xEF => match (cont(1), cont(2)) {
                (Some(b1), Some(b2)) => (self.of((b as u32 & 0x0F) << 12 | b1 << 6 | b2), 3),
                _ => (UNKNOWN, 1),
            },
            _ => (UNKNOWN, 1),
        }
    }

    /// `c.is_numeric()`, from the table on the plane.
    #[inline]
    pub(crate) fn numeric(self, c: char) -> bool {
        if (c as u32) < 0x1_0000 && self.numeric_agrees { self.of(c as u32) == NUMBER } else { c.is_numeric() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every character of the plane against the regex engine itself, and `numeric` against
    /// `char::is_numeric`; every encoding of it read back whole.
    #[test]
    fn every_character_is_classified_as_the_regex_classifies_it() {
        let class = |p: &str| regex_automata::meta::Regex::new(&format!(r"\A{p}\z")).expect("class");
        let (l, n, sp) = (class(r"\p{L}"), class(r"\p{N}"), class(r"\s"));
        let t = Classes::get();
        let mut seen = [0usize; 4];
        let mut buf = [0u8; 4];
        for c in (0..0x1_0000u32).filter_map(char::from_u32) {
            let s = c.encode_utf8(&mut buf);
            let want = if l.is_match(&*s) {
                LETTER
            } else if n.is_match(&*s) {
                NUMBER
            } else if sp.is_match(&*s) {
                SPACE
            } else {
                OTHER
            };
            assert_eq!(t.of(c as u32), want, "{c:?}");
            seen[want as usize] += 1;
            assert_eq!(t.numeric(c), c.is_numeric(), "{c:?}");
            if !c.is_ascii() {
                assert_eq!(t.wide(s.as_bytes(), 0), (want, s.len()), "{c:?}");
            }
        }
        // A speed check, not one of correctness: where they disagree, `numeric` asks std.
        assert!(TABLE.numeric_agrees, "std and regex-syntax disagree on a number: the slow path is taken");
        // `gpt2_by_hand` ends a run of whitespace at a four-byte character unread.
        let hir = regex_syntax::parse(r"\s").expect("class");
        let HirKind::Class(Class::Unicode(space)) = hir.kind() else { panic!("not a class") };
        assert!(space.ranges().iter().all(|r| (r.end() as u32) < 0x1_0000), "whitespace past the plane");
        assert!(seen.iter().all(|&k| k > 20), "{seen:?}");
        for c in ['🚢', '\u{1F600}', '𝟙'] {
            assert_eq!(t.wide(c.encode_utf8(&mut buf).as_bytes(), 0).0, UNKNOWN, "{c:?}");
            assert_eq!(t.numeric(c), c.is_numeric());
        }
        // Cut short, a character is no class.
        assert_eq!(t.wide("東".as_bytes().get(..2).expect("2 bytes"), 0), (UNKNOWN, 1));
        assert_eq!(t.wide(&[0xC3], 0), (UNKNOWN, 1));
    }
}
