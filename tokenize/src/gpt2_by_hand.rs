//! GPT-2's pre-tokenizer pattern decided by hand, for the fast BPE path
//! ([`crate::fast_bpe`]); the regex decides only where a pre-token touches a character that
//! [`crate::char_class`] cannot vouch for (none, with the Unicode of this build).
//!
//! The pattern, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
//! matched leftmost-first from a pre-token's start, reads only forward from there. So a
//! pre-token decided here and the next one found by the regex (or the other way round) cut
//! the text exactly as the regex alone would.
//!
//! On ASCII: letters are `A–Z a–z`, numbers `0–9`, whitespace `\t \n \x0B \x0C \r` and space
//! (Unicode's White_Space; `\x1C–\x1F` are not in it), and every other byte below `0x80` is
//! none of them. Every other character is classified by [`crate::char_class`]'s table, built
//! from the regex's own Unicode tables: Latin, Cyrillic, Greek, Chinese or Korean words, and
//! emoji, run as fast as English ones. A character it cannot vouch for ([`UNKNOWN`]) is left
//! to the regex, with any pre-token that starts there or could run on into it ([`next`]
//! returns `None`).

use crate::char_class::{Classes, LETTER, NUMBER, OTHER, SPACE, UNKNOWN};

/// The classes of the pattern's alternatives, by ASCII byte.
const CLASS: [u8; 128] = {
    let mut t = [OTHER; 128];
    let mut b = 0;
    while b < 128 {
        t[b] = match b as u8 {
            b'A'..=b'Z' | b'a'..=b'z' => LETTER,
            b'0'..=b'9' => NUMBER,
            b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ' => SPACE,
            _ => OTHER,
        };
        b += 1;
    }
    t
};

/// The class of the character at `i` and its length in bytes; `None` at the end.
#[inline(always)]
pub(crate) fn class_at(cl: Classes, text: &[u8], i: usize) -> Option<(u8, usize)> {
    let &b = text.get(i)?;
    Some(if b < 0x80 { (CLASS[b as usize], 1) } else { cl.wide(text, i) })
}

/// The end of the pre-token that starts at `at` (`at < text.len()`), or `None` where the
/// regex must decide it.
#[inline]
pub(crate) fn next(cl: Classes, text: &[u8], at: usize) -> Option<usize> {
    let first = text[at];
    if first == b'\'' {
        let rest = &text[at + 1..];
        let len = match rest {
            [b's' | b't' | b'm' | b'd', ..] => 1,
            [b'r' | b'v', b'e', ..] | [b'l', b'l', ..] => 2,
            _ => 0,
        };
        if len > 0 {
            return Some(at + 1 + len);
        }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: one optional space, then a run of one class.
    let body = if first == b' ' { at + 1 } else { at };
    match class_at(cl, text, body) {
        Some((LETTER, n)) => letters_end(cl, text, body + n),
        Some((c @ (NUMBER | OTHER), n)) => run_end(cl, text, body + n, c),
        Some((UNKNOWN, _)) => None,
        // Whitespace here, or a space before whitespace or the end: `\s+(?!\S)|\s+`.
        _ => space_run(cl, text, at),
    }
}

/// The end of a run of numbers or of others (`class`) that goes on from `end`, or `None`
/// where a character [`crate::char_class`] cannot vouch for might carry it on.
pub(crate) fn run_end(cl: Classes, text: &[u8], mut end: usize, class: u8) -> Option<usize> {
    loop {
        match class_at(cl, text, end) {
            Some((k, n)) if k == class => end += n,
            Some((UNKNOWN, _)) => return None,
            _ => return Some(end),
        }
    }
}

/// `\s+(?!\S)|\s+` from `at`, where whitespace starts: the whole run where it ends the text;
/// otherwise the run less its last character (which goes with what follows), or the one
/// character of a run that short.
fn space_run(cl: Classes, text: &[u8], at: usize) -> Option<usize> {
    // The run's end, the length of its last character, and how many it has.
    let (mut end, mut last, mut count) = (at, 0, 0);
    loop {
        match class_at(cl, text, end) {
            Some((SPACE, n)) => (end, last, count) = (end + n, n, count + 1),
            Some(_) => return Some(if count >= 2 { end - last } else { end }),
            None => return Some(end),
        }
    }
}

/// Each byte's lowest bit, and its highest: for the scans below, eight bytes at a time.
const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// The high bit of each byte of `low` (eight bytes below 0x80) that lies in `lo..=hi`: the
/// byte plus a constant sets its high bit exactly when it is at least the bound (at most
/// 0x7f + 0x7f: nothing carries into the next byte).
#[inline(always)]
fn bytes_within(low: u64, lo: u8, hi: u8) -> u64 {
    let from = low + ONES * (0x80 - lo as u64);
    let past = low + ONES * (0x80 - hi as u64 - 1);
    from & !past & HIGH
}

/// The end of the pre-token ` ?\p{L}+` whose letters go on from `at`, or `None` where a
/// character this module does not classify might carry it on.
#[inline]
pub(crate) fn letters_end(cl: Classes, text: &[u8], mut at: usize) -> Option<usize> {
    loop {
        at = ascii_letters_end(text, at);
        // Letters of other scripts, until ASCII letters again (or the end of the run).
        loop {
            match text.get(at) {
                Some(&b) if b >= 0x80 => match cl.wide(text, at) {
                    (LETTER, n) => at += n,
                    (UNKNOWN, _) => return None,
                    _ => return Some(at),
                },
                Some(&b) if CLASS[b as usize] == LETTER => break,
                _ => return Some(at),
            }
        }
    }
}

/// The end of the run of ASCII letters from `at`: the first byte from `at` that is not one,
/// or the end of the text. Eight bytes at a time: a word's length then costs no branch
/// mispredicted at its end.
#[inline]
fn ascii_letters_end(text: &[u8], mut at: usize) -> usize {
    while let Some(chunk) = text.get(at..at + 8) {
        let x = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        // Setting bit 5 maps `A–Z` onto `a–z` and no other byte below 0x80 into `a–z`.
        let low = (x | (ONES * 0x20)) & !HIGH;
        let others = !(bytes_within(low, b'a', b'z') & !x) & HIGH;
        if others != 0 {
            return at + others.trailing_zeros() as usize / 8;
        }
        at += 8;
    }
    at + text[at..].iter().position(|b| !b.is_ascii_alphabetic()).unwrap_or(text.len() - at)
}

/// The first byte from `at` that is an ASCII digit or `0x80` and up (where a character that
/// might be a number starts: `²`, `٣`), eight bytes at a time. For SmolLM2's `Digits`
/// pre-tokenizer, which cuts every number character out before the pattern runs.
#[inline]
pub(crate) fn next_digit_or_wide(text: &[u8], mut at: usize) -> Option<usize> {
    while let Some(chunk) = text.get(at..at + 8) {
        let x = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        let hits = (bytes_within(x & !HIGH, b'0', b'9') & !x) | (x & HIGH);
        if hits != 0 {
            return Some(at + hits.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    text[at..].iter().position(|&b| b.is_ascii_digit() || b >= 0x80).map(|p| at + p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2() -> regex_automata::meta::Regex {
        let pattern = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";
        regex_automata::meta::Regex::new(pattern).expect("pattern")
    }

    /// Mixed pieces, emoji and four-byte letters and numbers among them: at every start this
    /// module must decide, and agree with the regex.
    #[test]
    fn every_decided_piece_is_the_regexs() {
        let re = gpt2();
        // Emoji, a skin tone, a joiner, a regional indicator, a tag and a variation selector
        // (others); letters and a number of four bytes.
        let four_bytes = ["🚢", "😀", "𝟙", "𝐟", "𠀀", "\u{1f3fd}", "\u{200d}", "🇫", "\u{e0001}", "\u{fe0f}"];
        let alphabet: Vec<&str> = [
            "a", "Z", "s", "t", "r", "e", "v", "m", "l", "d", "'", "0", "7", " ", " ", "  ", "\t", "\n", "\r", "\x0b",
            "\x0c", "\x1c", "\x1f", "\x00", "\x7f", ".", "!", "-", "é", "À", "ÿ", "Ā", "ł", "ſ", "×", "÷", "ª", "µ",
            "¿", "—", "\u{a0}", "\u{85}", "\u{3000}", "\u{2028}", "\u{200b}", "²", "٣", "〇", "Ⅻ", "д", "Ж", "ё", "α",
            "Ω", "ς", "ʹ", "東", "京", "한", "の", "ー", "，", "。", "\u{301}", "\u{483}", "\u{feff}",
        ]
        .into_iter()
        .chain(four_bytes)
        .collect();
        // What this module classifies: everything.
        fn known(_: &str) -> bool {
            true
        }
        let decided = crate::bpe_fixtures::hand_against_regex(&re, false, &alphabet, known, 20_000, |text, at| {
            next(Classes::get(), text, at)
        });
        assert!(decided > 50_000, "only {decided} pieces decided");
    }

    /// 5,000 texts of 0 to 39 bytes from `seed`, each byte `byte(r)` of a fresh random `r`.
    fn random_texts(mut seed: u64, byte: impl Fn(u64) -> u8) -> impl Iterator<Item = Vec<u8>> {
        (0..5_000).map(move |round| {
            (0..round % 40)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    byte(seed)
                })
                .collect()
        })
    }

    /// Against the byte-by-byte rule, from every start, on texts of every byte value.
    #[test]
    fn finds_the_end_of_a_run_of_letters() {
        // Mostly letters, as words are; now and then anything (the bytes next to `A–Z` and
        // `a–z`, and the same with the high bit set, among them).
        let byte = |r: u64| match r % 8 {
            0 => (r >> 8) as u8,
            1 => b"@[`{AZaz\xc1\xda\xe1\xfa"[(r >> 8) as usize % 12],
            _ => b'a' + (r >> 8) as u8 % 26,
        };
        for text in random_texts(0x9e37_79b9_7f4a_7c15, byte) {
            for at in 0..=text.len() {
                let want = text[at..].iter().position(|b| !b.is_ascii_alphabetic()).map_or(text.len(), |p| at + p);
                assert_eq!(ascii_letters_end(&text, at), want, "{text:?} from {at}");
            }
        }
    }

    /// Against the byte-by-byte rule, from every start, on texts of every byte value.
    #[test]
    fn finds_the_first_digit_or_wide_byte() {
        // Mostly letters and spaces, as prose is; now and then anything.
        let byte = |r: u64| match r % 8 {
            0 => (r >> 8) as u8,
            1 => b'0' + (r >> 8) as u8 % 10,
            _ => b"ab /:@Z"[(r >> 8) as usize % 7],
        };
        for text in random_texts(0x2545_f491_4f6c_dd1d, byte) {
            for at in 0..=text.len() {
                let want = text[at..].iter().position(|&b| b.is_ascii_digit() || b >= 0x80).map(|p| at + p);
                assert_eq!(next_digit_or_wide(&text, at), want, "{text:?} from {at}");
            }
        }
    }
}
