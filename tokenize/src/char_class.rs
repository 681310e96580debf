//! The classes GPT-2's pre-tokenizer pattern sorts characters into — letters (`\p{L}`),
//! numbers (`\p{N}`), whitespace (`\s`) and everything else — for every Unicode character,
//! so that a character is classified here exactly as the regex classifies it, in Cyrillic,
//! Greek, Chinese, in an emoji or in any other script. A table of two bits a character covers
//! the first four planes (U+0000–U+3FFFF, 64 KiB; text nearly always reads only its first
//! 16 KiB, the Basic Multilingual Plane), built once from `regex-syntax`'s Unicode tables, the
//! ones the fast path's regex is compiled from. Past the table no character is a letter, a
//! number or whitespace (checked when the table is built; where a later Unicode adds one
//! there, such characters are [`UNKNOWN`], left to the regex).
//!
//! The same table answers `char::is_numeric` (what SmolLM2's `Digits` pre-tokenizer cuts
//! out, and HF asks) on the Basic Multilingual Plane, where the two definitions agree
//! (checked when the table is built; otherwise, and past the plane, [`Classes::numeric`] asks
//! `char::is_numeric` itself).

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
/// Not a whole character, or one past the table that the table cannot vouch for.
pub(crate) const UNKNOWN: u8 = 4;

/// The characters the table holds: planes 0 to 3.
const CHARS: u32 = 0x4_0000;
/// Words of the table, 32 characters a word.
const WORDS: usize = CHARS as usize / 32;

struct Table {
    /// Two bits a character, 32 characters a word.
    bits: Box<[u64; WORDS]>,
    /// Whether `NUMBER` is exactly `char::is_numeric` on the Basic Multilingual Plane (past it
    /// the two disagree where std knows a later Unicode than `regex-syntax`: Rust 1.95's std
    /// has Unicode 17's digits U+11DE0–U+11DE9 and U+16FF4–U+16FF6).
    numeric_agrees: bool,
    /// The class of every character past the table: [`OTHER`] where no letter, number or
    /// whitespace lies there, else [`UNKNOWN`].
    beyond: u8,
}

static TABLE: LazyLock<Table> = LazyLock::new(|| {
    let mut bits: Box<[u64; WORDS]> = vec![0u64; WORDS].into_boxed_slice().try_into().expect("WORDS words");
    let mut beyond = OTHER;
    for (pattern, class) in [(r"\p{L}", LETTER), (r"\p{N}", NUMBER), (r"\s", SPACE)] {
        let hir = regex_syntax::parse(pattern).expect("a Unicode class");
        let HirKind::Class(Class::Unicode(set)) = hir.kind() else { panic!("{pattern} is not a Unicode class") };
        for r in set.ranges() {
            if r.end() as u32 >= CHARS {
                beyond = UNKNOWN;
            }
            for c in r.start() as u32..=(r.end() as u32).min(CHARS - 1) {
                bits[c as usize / 32] |= (class as u64) << (c % 32 * 2);
            }
        }
    }
    let numeric_agrees = (0..0x1_0000)
        .filter_map(char::from_u32)
        .all(|c| c.is_numeric() == ((bits[c as usize / 32] >> (c as usize % 32 * 2)) & 3 == NUMBER as u64));
    Table { bits, numeric_agrees, beyond }
});

/// The table, read without the `LazyLock`'s check on every character: fetched once where a
/// tokenizer is built ([`Classes::get`]) and kept beside its pattern.
#[derive(Clone, Copy)]
pub(crate) struct Classes {
    bits: &'static [u64; WORDS],
    numeric_agrees: bool,
    beyond: u8,
}

impl std::fmt::Debug for Classes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Classes")
    }
}

impl Classes {
    /// The table (built on first use).
    pub(crate) fn get() -> Self {
        Self { bits: &TABLE.bits, numeric_agrees: TABLE.numeric_agrees, beyond: TABLE.beyond }
    }

    /// The class of a character of the table.
    #[inline(always)]
    fn of(self, c: u32) -> u8 {
        ((self.bits[c as usize / 32 % WORDS] >> (c % 32 * 2)) & 3) as u8
    }

    /// The class of the character that starts at `i` (from its lead byte, `text[i] >= 0x80`)
    /// and its length in bytes; [`UNKNOWN`] where the text ends too soon, or past the table
    /// where it cannot vouch ([`Table::beyond`]). `text` must be UTF-8 (a `str`'s bytes): the
    /// continuation bytes are not checked.
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
            b @ 0xF0..=0xF4 => match (cont(1), cont(2), cont(3)) {
                (Some(b1), Some(b2), Some(b3)) => {
                    let c = (b as u32 & 0x07) << 18 | b1 << 12 | b2 << 6 | b3;
                    (if c < CHARS { self.of(c) } else { self.beyond }, 4)
                }
                _ => (UNKNOWN, 1),
            },
            _ => (UNKNOWN, 1),
        }
    }

    /// `c.is_numeric()`, from the table on the Basic Multilingual Plane.
    #[inline]
    pub(crate) fn numeric(self, c: char) -> bool {
        if (c as u32) < 0x1_0000 && self.numeric_agrees { self.of(c as u32) == NUMBER } else { c.is_numeric() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every Unicode character against the regex engine itself, and `numeric` against
    /// `char::is_numeric`; every encoding of it read back whole.
    #[test]
    fn every_character_is_classified_as_the_regex_classifies_it() {
        let class = |p: &str| regex_automata::meta::Regex::new(&format!(r"\A{p}\z")).expect("class");
        let (l, n, sp) = (class(r"\p{L}"), class(r"\p{N}"), class(r"\s"));
        let t = Classes::get();
        // Classes seen on the plane, and past it.
        let mut seen = [[0usize; 4]; 2];
        let mut buf = [0u8; 4];
        for c in (0..=char::MAX as u32).filter_map(char::from_u32) {
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
            seen[usize::from(s.len() == 4)][want as usize] += 1;
            assert_eq!(t.numeric(c), c.is_numeric(), "{c:?}");
            if !c.is_ascii() {
                assert_eq!(t.wide(s.as_bytes(), 0), (want, s.len()), "{c:?}");
            }
        }
        // Speed checks, not ones of correctness: where std and regex-syntax disagree on a
        // number, `numeric` asks std; past the table, every character goes to the regex.
        assert!(TABLE.numeric_agrees, "std and regex-syntax disagree on a number: the slow path is taken");
        assert_eq!(TABLE.beyond, OTHER, "a letter, number or whitespace past U+3FFFF");
        assert!(seen[0].iter().all(|&k| k > 20), "{seen:?}");
        assert!(
            seen[1][LETTER as usize] > 20 && seen[1][NUMBER as usize] > 20 && seen[1][OTHER as usize] > 20,
            "{seen:?}"
        );
        for (c, want) in
            [('🚢', OTHER), ('\u{1F600}', OTHER), ('𝟙', NUMBER), ('𝐟', LETTER), ('𠀀', LETTER), ('\u{E0001}', OTHER)]
        {
            assert_eq!(t.wide(c.encode_utf8(&mut buf).as_bytes(), 0), (want, 4), "{c:?}");
        }
        // Cut short, a character is no class.
        assert_eq!(t.wide("東".as_bytes().get(..2).expect("2 bytes"), 0), (UNKNOWN, 1));
        assert_eq!(t.wide("🚢".as_bytes().get(..3).expect("3 bytes"), 0), (UNKNOWN, 1));
        assert_eq!(t.wide(&[0xC3], 0), (UNKNOWN, 1));
    }
}
