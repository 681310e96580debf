//! Llama 3's and Qwen2's pre-tokenizer patterns decided by hand, for the fast BPE path
//! ([`crate::fast_bpe`]), as [`crate::gpt2_by_hand`] decides GPT-2's; the regex decides
//! where a contraction might hold one (`'ſ`: `ſ` folds to `s`), and where a pre-token touches
//! a character [`crate::char_class`] cannot vouch for (none, with the Unicode of this build).
//!
//! The patterns, matched leftmost-first from a pre-token's start (they differ only in how
//! many numbers a pre-token holds, `{1,3}` or one):
//! `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
//! By alternative, at a character `c` followed by `d`:
//! 1. `'` and a contraction, in either case;
//! 2. a letter, or `c` neither a line break, a letter nor a number with `d` a letter: then a
//!    run of letters;
//! 3. a number: up to the most numbers a pre-token holds;
//! 4. `c` other (neither whitespace, letter nor number), or a space with `d` other: a run of
//!    others, then any line breaks (`\r`, `\n`) after it;
//! 5. whitespace that holds a line break: the run up to its last line break;
//! 6. and 7. whitespace without one: the run, but its last character where more text
//!    follows and the run has two or more (`\s+(?!\S)`), else the run.

use crate::char_class::{Classes, LETTER, NUMBER, OTHER, SPACE, UNKNOWN};
use crate::gpt2_by_hand::{class_at, letters_end, run_end};

/// The end of the pre-token that starts at `at` (`at < text.len()`), with at most `numbers`
/// numbers in a pre-token, or `None` where the regex must decide it.
#[inline]
pub(crate) fn next(cl: Classes, text: &[u8], at: usize, numbers: usize) -> Option<usize> {
    if text[at] == b'\'' {
        match &text[at + 1..] {
            [b's' | b'S' | b't' | b'T' | b'm' | b'M' | b'd' | b'D', ..] => return Some(at + 2),
            [b'r' | b'R' | b'v' | b'V', b'e' | b'E', ..] | [b'l' | b'L', b'l' | b'L', ..] => return Some(at + 3),
            // `ſ` (U+017F) folds to `s`.
            [0xC5, 0xBF, ..] => return None,
            _ => {}
        }
    }
    let (c, n) = class_at(cl, text, at)?;
    match c {
        LETTER => letters_end(cl, text, at + n),
        NUMBER => {
            let (mut end, mut count) = (at + n, 1);
            while count < numbers {
                match class_at(cl, text, end) {
                    Some((NUMBER, k)) => (end, count) = (end + k, count + 1),
                    Some((UNKNOWN, _)) => return None,
                    _ => break,
                }
            }
            Some(end)
        }
        UNKNOWN => None,
        _ => {
            let line_break = matches!(text[at], b'\r' | b'\n');
            let d = class_at(cl, text, at + n);
            if !line_break {
                match d {
                    Some((LETTER, k)) => return letters_end(cl, text, at + n + k),
                    Some((UNKNOWN, _)) => return None,
                    _ => {}
                }
            }
            let others = if c == OTHER {
                Some(at)
            } else if text[at] == b' ' {
                match d {
                    Some((OTHER, _)) => Some(at + 1),
                    _ => None,
                }
            } else {
                None
            };
            if let Some(start) = others {
                let end = run_end(cl, text, start, OTHER)?;
                return Some(end + text[end..].iter().take_while(|&&b| b == b'\r' || b == b'\n').count());
            }
            debug_assert_eq!(c, SPACE);
            whitespace(cl, text, at)
        }
    }
}

/// Alternatives 5 to 7 from `at`, where whitespace starts that alternatives 2 and 4 did not
/// take.
fn whitespace(cl: Classes, text: &[u8], at: usize) -> Option<usize> {
    // The run's end, the length of its last character, how many it has, and the end of its
    // last line break.
    let (mut end, mut last, mut count, mut broken) = (at, 0, 0, None);
    while let Some((SPACE, n)) = class_at(cl, text, end) {
        if matches!(text[end], b'\r' | b'\n') {
            broken = Some(end + 1);
        }
        (end, last, count) = (end + n, n, count + 1);
    }
    Some(match broken {
        Some(b) => b,
        None if end == text.len() || count < 2 => end,
        None => end - last,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_vocab::{LLAMA3_PATTERN, QWEN2_PATTERN};

    /// Mixed pieces, emoji and four-byte letters and numbers among them: at every start this
    /// module decides, it must agree with the regex, and it must decide every start of a text
    /// without `ſ`.
    #[test]
    fn every_decided_piece_is_the_regexs() {
        // Emoji, a skin tone, a joiner and a variation selector (others); letters and a number
        // of four bytes.
        let four_bytes = ["🚢", "😀", "𝟙", "𠀀", "𝐟", "\u{1f3fd}", "\u{200d}", "\u{fe0f}"];
        let alphabet: Vec<&str> = [
            "a", "Z", "s", "S", "t", "T", "r", "R", "e", "E", "v", "m", "M", "l", "L", "d", "D", "'", "'", "0", "7",
            " ", " ", "  ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x00", ".", "!", "-", "é", "ſ", "K",
            "×", "ª", "¿", "—", "\u{a0}", "\u{85}", "\u{3000}", "\u{2028}", "\u{200b}", "²", "٣", "〇", "д", "Ё", "α",
            "東", "，", "。", "\u{301}",
        ]
        .into_iter()
        .chain(four_bytes)
        .collect();
        fn known(s: &str) -> bool {
            !s.contains('ſ')
        }
        let cl = Classes::get();
        for (pattern, numbers) in [(LLAMA3_PATTERN, 3), (QWEN2_PATTERN, 1)] {
            let re = regex_automata::meta::Regex::new(&pattern.replace(r"\s+(?!\S)|", "")).expect("pattern");
            let decided = crate::bpe_fixtures::hand_against_regex(&re, true, &alphabet, known, 30_000, |text, at| {
                next(cl, text, at, numbers)
            });
            assert!(decided > 80_000, "only {decided} pieces decided");
        }
    }
}
