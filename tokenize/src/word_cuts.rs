//! Where the head cache ([`crate::HeadCache`]) may cut plain text into segments that
//! tokenize on their own: places where every pre-tokenizer pattern it is used with ends one
//! pre-token and starts the next whatever the text around them, so the ids of the pieces
//! concatenate to the ids of the whole.

use crate::char_class::{Classes, LETTER, OTHER};

/// With word cuts, a long stretch of plain text is cut about this often (bytes; 1,024 measured
/// no better, with more segments to keep).
#[cfg(not(test))]
pub(crate) const CUT_EVERY: usize = 2048;
#[cfg(test)]
pub(crate) const CUT_EVERY: usize = 48;

/// Whether `b` may be cut before `p` for a byte-level BPE with GPT-2's, Llama 3's or Qwen2's
/// pattern: a space between a printable ASCII character and an ASCII letter. The pre-token
/// before it (a run of letters, of up to three digits or of other marks, or a contraction)
/// ends there whatever follows, and the one after starts there (` ?\p{L}+`,
/// `[^\r\n\p{L}\p{N}]?\p{L}+`); the patterns read only forward, so the text after `p` cuts
/// alike on its own.
/// (Either neighbour alone would do; both are asked. A space inside a run of whitespace is
/// no cut: `a   b` is `a`, two spaces, ` b`.) No added token holds a space
/// ([`crate::HeadCache`]'s `with_word_cuts`), so none spans `p`.
pub(crate) fn word_cut(b: &[u8], p: usize) -> bool {
    p > 0 && p + 1 < b.len() && b[p] == b' ' && b[p + 1].is_ascii_alphabetic() && b[p - 1].is_ascii_graphic()
}

/// Whether `b` may be cut before `p` for a GPT-2 byte-level BPE in a script written without
/// spaces (Chinese, Japanese): after a character past ASCII that is neither a letter, a
/// number nor whitespace (punctuation such as `，`, `。`, `」`, a symbol, an emoji, a combining
/// mark: Hindi or Thai may be cut inside a word, which is as exact) and before a letter past
/// ASCII. That mark can only be in a run of such marks (` ?[^\s\p{L}\p{N}]+`; it is no
/// contraction, and no number for the `Digits` split either), which the letter ends; the next
/// pre-token starts at `p` and reads only forward. No added token holds a character past
/// ASCII ([`crate::HeadCache`]'s `with_word_cuts`), so none spans `p`.
pub(crate) fn wide_cut(cl: Classes, b: &[u8], p: usize) -> bool {
    if p == 0 || p >= b.len() || b[p - 1] < 0x80 || b[p] < 0xC0 {
        return false;
    }
    // The start of the character that ends at `p` (at most four bytes back).
    let Some(start) = (p.saturating_sub(4)..p).rev().find(|&i| b[i] >= 0xC0) else { return false };
    cl.wide(b, start) == (OTHER, p - start) && cl.wide(b, p).0 == LETTER
}

/// `ends` (each the end of a boundary token) with word cuts (`cut`) added between them and
/// after the last: in each stretch, the first cut at or after every [`CUT_EVERY`] bytes from
/// the last.
pub(crate) fn with_cuts(text: &str, ends: &[usize], cut: impl Fn(&[u8], usize) -> bool) -> Vec<usize> {
    let b = text.as_bytes();
    let mut all = Vec::with_capacity(ends.len() + text.len() / CUT_EVERY);
    let mut start = 0;
    // The boundary ends, then the end of the text (not itself a segment's end: the tail).
    let stretches = ends.iter().map(|&e| (e, true)).chain(std::iter::once((text.len(), false)));
    for (end, boundary) in stretches {
        let mut next = start + CUT_EVERY;
        while next < end {
            let Some(p) = (next..end).find(|&p| cut(&b[..end], p)) else { break };
            all.push(p);
            next = p + CUT_EVERY;
        }
        if boundary {
            all.push(end);
        }
        start = end;
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where `wide_cut` cuts, and where not.
    #[test]
    fn wide_cuts_fall_after_a_mark_and_before_a_letter() {
        let cl = Classes::get();
        let cuts = |t: &str| (0..=t.len()).filter(|&p| wide_cut(cl, t.as_bytes(), p)).collect::<Vec<_>>();
        // After `，` `。` `」` `→`, a combining mark or an emoji, before 東 ё λ ま or 𠀀.
        assert_eq!(cuts("東京，東京"), [9]);
        assert_eq!(cuts("a。ёb」λ→ま"), [4, 10, 15]);
        assert_eq!(cuts("क\u{94d}ष"), [6], "a virama is no letter");
        assert_eq!(cuts("，𠀀😀東"), [3, 11]);
        // Not after a letter (𠀀 too), a number, whitespace or ASCII; not before ASCII, a number or an
        // emoji; not at either end.
        let none = "東京〇東，1，a，🚢，𝟙\u{3000}東.東𠀀東😀，";
        assert!(cuts(none).is_empty(), "{:?}", cuts(none));
        assert!(cuts("，").is_empty() && cuts("").is_empty());
    }
}
