//! Prose beyond English for the tokenizer bench: ~16 KB texts of words drawn from short lists,
//! in scripts the fast path's pre-tokenizer meets in real prompts.

use crate::rng::Rng;
use crate::text::WORDS;

/// The English words and numbers that open [`WORDS`] (the rest are code, marks and accented
/// words).
fn english() -> &'static [&'static str] {
    &WORDS[..51]
}

/// One of `from`, drawn uniformly.
fn pick<'a, T>(rng: &mut Rng, from: &'a [T]) -> &'a T {
    &from[(rng.next() % from.len() as u64) as usize]
}

/// French, German, Spanish, Polish and Czech words (Latin-1 and Latin Extended-A letters).
const ACCENTED: &[&str] = &[
    "café",
    "déjà",
    "über",
    "façade",
    "naïve",
    "Größe",
    "élève",
    "Kraków",
    "łódź",
    "señor",
    "mañana",
    "où",
    "être",
    "Ærø",
    "smörgåsbord",
    "Dvořák",
    "crème",
    "brûlée",
];

/// Russian words (Cyrillic), and numbers as Russian prose writes them.
const RUSSIAN: &[&str] = &[
    "паром",
    "пересёк",
    "реку",
    "на",
    "рассвете",
    "и",
    "его",
    "капитан",
    "написал",
    "длинное",
    "письмо",
    "о",
    "погоде",
    "приливах",
    "грузе",
    "пассажиры",
    "спросили",
    "вопросы",
    "палубе",
    "туман",
    "ветер",
    "с",
    "севера",
    "билет",
    "подорожал",
    "12",
    "процентов",
    "в",
    "2024",
    "году",
    "Москва",
    "Россия",
];

/// Common Chinese characters: Chinese writes no spaces, so a clause is one run of letters.
const CHINESE: &str = "渡轮在黎明时分穿过河流船长写了一封关于天气潮汐货物和乘客的长信他们在甲板上问了许多问题海鸥\
                       在港口灯光上空盘旋机舱温暖而安静时刻表因为北方和东方的雾和风改了两次票价上涨了百分之十二";

/// Emoji as chat messages write them: pictographs (four UTF-8 bytes), some with a skin tone
/// or joined (U+200D) into one, flags (two regional indicators), a heart with its variation
/// selector (U+FE0F), and a word in mathematical bold (four-byte letters).
const EMOJI: &str = "🚢 😀 👍 🎉 🔥 🙏 😂 👍🏽 👨\u{200d}👩\u{200d}👧 🇫🇷 ❤\u{fe0f} ✅ 𝐟𝐞𝐫𝐫𝐲 🌊⛴️";

/// `n` texts of ~16 KB of English chat: one word in eight followed by an emoji, after a space
/// or not.
pub fn emoji(rng: &mut Rng, n: usize) -> Vec<String> {
    let emoji: Vec<&str> = EMOJI.split(' ').collect();
    texts(n, || {
        let word = *pick(rng, english());
        match rng.next() % 16 {
            0 => format!("{word} {} ", pick(rng, &emoji)),
            1 => format!("{word}{}\n", pick(rng, &emoji)),
            _ => format!("{word} "),
        }
    })
}

/// `n` texts of ~16 KB of English chat in which one word in eight is a never-seen name of 6 to
/// 10 letters (~330 a text): a vocabulary that never stops growing, as identifiers, names and
/// misspellings make it.
pub fn with_names(rng: &mut Rng, n: usize) -> Vec<String> {
    texts(n, || {
        if rng.next().is_multiple_of(8) {
            let len = 6 + rng.next() % 5;
            let mut name: String = (0..len).map(|_| (b'a' + (rng.next() % 26) as u8) as char).collect();
            name.push(' ');
            name
        } else {
            format!("{} ", pick(rng, english()))
        }
    })
}

/// `n` texts of ~16 KB: 30 % of the words accented, the rest English.
pub fn accented(rng: &mut Rng, n: usize) -> Vec<String> {
    texts(n, || {
        let w = if rng.next() % 100 < 30 { ACCENTED } else { english() };
        let sep = if rng.next().is_multiple_of(12) { "\n" } else { " " };
        format!("{}{sep}", pick(rng, w))
    })
}

/// `n` texts of ~16 KB of Russian words, a sentence ending now and then.
pub fn russian(rng: &mut Rng, n: usize) -> Vec<String> {
    texts(n, || {
        let sep = if rng.next().is_multiple_of(9) { ". " } else { " " };
        format!("{}{sep}", pick(rng, RUSSIAN))
    })
}

/// `n` texts of ~16 KB of Chinese clauses of 4 to 23 characters (nearly all unique), each
/// ending in a full-width comma or full stop.
pub fn chinese(rng: &mut Rng, n: usize) -> Vec<String> {
    let chars: Vec<char> = CHINESE.chars().collect();
    texts(n, || {
        let len = 4 + rng.next() % 20;
        let mut clause: String = (0..len).map(|_| *pick(rng, &chars)).collect();
        clause.push(if rng.next().is_multiple_of(3) { '。' } else { '，' });
        clause
    })
}

fn texts(n: usize, mut piece: impl FnMut() -> String) -> Vec<String> {
    (0..n)
        .map(|_| {
            let mut t = String::new();
            while t.len() < 16 * 1024 {
                t.push_str(&piece());
            }
            t
        })
        .collect()
}
