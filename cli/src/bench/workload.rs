//! What `ferry bench` sends: deterministic request streams (the same seed gives the same
//! requests), and the Mooncake trace reader.
//!
//! - `shared-prefix`: multi-turn chat conversations, each opening with one of a few long
//!   system prompts; turn t of a conversation repeats its first t − 1 turns.
//! - `multi-turn`: conversations driven turn by turn: each next turn carries the model's
//!   actual previous answers (`multi_turn_opening`, `multi_turn_question`; the loop is in
//!   `bench::conversation`).
//! - `few-shot`: one long block of worked examples, then a different question each time.
//! - `random`: prompts of random words, nothing shared.
//! - `trace`: a Mooncake trace (JSON lines `{"timestamp": ms, "input_length": n,
//!   "output_length": n, "hash_ids": [..]}`). Each hash id stands for one block of
//!   `block_size` tokens; equal ids give equal blocks, so prefixes shared in the trace are
//!   shared in the prompts, which are sent as token ids.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A prompt in the form the endpoint takes.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Chat messages `(role, content)`.
    Chat(Vec<(String, String)>),
    /// Plain text (a completion).
    Text(String),
    /// Token ids (a completion).
    Ids(Vec<u32>),
}

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Seconds after the start to send it (trace replay); None: as the loop decides.
    pub at: Option<f64>,
}

const WORDS: &[&str] = &[
    "river", "stone", "light", "garden", "window", "market", "silver", "harbor", "forest", "engine", "letter",
    "winter", "signal", "paper", "orange", "valley", "bridge", "candle", "mirror", "planet", "ticket", "castle",
    "meadow", "rocket", "violin", "pepper", "island", "shadow", "thunder", "lantern", "compass", "blanket", "canyon",
    "feather", "glacier", "journal", "kitchen", "library", "machine", "notebook", "orchard", "painter", "quarry",
    "saddle", "teacher", "umbrella", "village", "whistle", "yellow", "zephyr",
];

fn words(rng: &mut StdRng, n: usize) -> String {
    (0..n).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ")
}

/// The synthetic workloads' knobs.
#[derive(Debug, Clone)]
pub struct Synth {
    /// Words per system prompt / few-shot block (about one token each).
    pub prefix_words: usize,
    /// Words per user question.
    pub question_words: usize,
    /// Distinct system prompts (`shared-prefix`).
    pub system_prompts: usize,
    /// Conversations (`shared-prefix`).
    pub conversations: usize,
    /// Turns per conversation (`shared-prefix`).
    pub turns: usize,
    /// Tokens to generate per request.
    pub output_len: u32,
    /// Seed.
    pub seed: u64,
}

/// Request `i` of `shared-prefix`: conversation `i mod C`, turn `(i div C) mod T`.
pub fn shared_prefix(s: &Synth, i: usize) -> Item {
    let c = i % s.conversations.max(1);
    let turn = (i / s.conversations.max(1)) % s.turns.max(1);
    let system = words(&mut StdRng::seed_from_u64(s.seed ^ (c % s.system_prompts.max(1)) as u64), s.prefix_words);
    let mut msgs =
        vec![("system".to_string(), format!("You are assistant number {}. {system}", c % s.system_prompts.max(1)))];
    let mut rng = StdRng::seed_from_u64(s.seed.wrapping_add(1 + c as u64 * 7919));
    for t in 0..=turn {
        msgs.push(("user".into(), format!("Question {t}: {}?", words(&mut rng, s.question_words))));
        if t < turn {
            msgs.push(("assistant".into(), format!("Answer {t}: {}.", words(&mut rng, s.question_words))));
        }
    }
    Item { prompt: Prompt::Chat(msgs), max_tokens: s.output_len, at: None }
}

/// The opening of `multi-turn` conversation `c`: its own system prompt (shared with no other
/// conversation, so that what one turn reuses is its own conversation's).
pub fn multi_turn_opening(s: &Synth, c: usize) -> (String, String) {
    let mut rng = StdRng::seed_from_u64(s.seed ^ 0x6d75_6c74_6900_0000 ^ c as u64);
    ("system".into(), format!("You are assistant number {c}. {}", words(&mut rng, s.prefix_words)))
}

/// The user's question in turn `t` of `multi-turn` conversation `c`.
pub fn multi_turn_question(s: &Synth, c: usize, t: usize) -> (String, String) {
    let mut rng = StdRng::seed_from_u64(s.seed.wrapping_add(1 + c as u64 * 7919 + t as u64 * 104_729));
    ("user".into(), format!("Question {t}: {}?", words(&mut rng, s.question_words)))
}

/// Request `i` of `few-shot`.
pub fn few_shot(s: &Synth, i: usize) -> Item {
    let mut shots = StdRng::seed_from_u64(s.seed);
    let mut text = String::from("Answer each question with one word.\n\n");
    let per_shot = s.question_words.max(1) + 2;
    for k in 0..(s.prefix_words / per_shot).max(1) {
        text.push_str(&format!("Q{k}: {}?\nA{k}: {}\n\n", words(&mut shots, s.question_words), words(&mut shots, 1)));
    }
    let mut q = StdRng::seed_from_u64(s.seed.wrapping_add(1 + i as u64));
    text.push_str(&format!("Q: {}?\nA:", words(&mut q, s.question_words)));
    Item { prompt: Prompt::Text(text), max_tokens: s.output_len, at: None }
}

/// Request `i` of `random`.
pub fn random(s: &Synth, i: usize) -> Item {
    let mut rng = StdRng::seed_from_u64(s.seed.wrapping_add(i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    Item {
        prompt: Prompt::Text(words(&mut rng, s.prefix_words + s.question_words)),
        max_tokens: s.output_len,
        at: None,
    }
}

/// One line of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct TraceLine {
    /// Milliseconds since the trace's start.
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Generated tokens.
    pub output_length: usize,
    /// One id per block of the prompt; equal ids are equal blocks.
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// How a trace becomes requests.
#[derive(Debug, Clone)]
pub struct TraceShape {
    /// Tokens per hash block (Mooncake: 512).
    pub block_size: usize,
    /// Prompts are cut to this many tokens (the model's context must hold them).
    pub max_input: usize,
    /// Outputs are cut to this many tokens.
    pub max_output: usize,
    /// Token ids are drawn from `256..vocab` (the model's vocabulary must be at least this).
    pub vocab: u32,
    /// Replay speed: 2.0 sends twice as fast as recorded.
    pub speed: f64,
}

/// Parses a trace; a line that does not parse is an error naming the line.
pub fn read_trace(text: &str) -> Result<Vec<TraceLine>, String> {
    let mut out = Vec::new();
    for (n, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let t: TraceLine = serde_json::from_str(l).map_err(|e| format!("trace line {}: {e}", n + 1))?;
        if !t.timestamp.is_finite() || t.timestamp < 0.0 {
            return Err(format!("trace line {}: timestamp {} is not a time", n + 1, t.timestamp));
        }
        out.push(t);
    }
    if out.is_empty() {
        return Err("the trace has no requests".into());
    }
    Ok(out)
}

/// The requests of a trace; returns them and how many were cut to fit the limits.
pub fn from_trace(lines: &[TraceLine], shape: &TraceShape) -> (Vec<Item>, usize) {
    let t0 = lines.iter().map(|l| l.timestamp).fold(f64::INFINITY, f64::min);
    let span = shape.vocab.saturating_sub(256).max(1);
    let mut cut = 0;
    let items = lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let want = l.input_length.max(1);
            let mut ids = Vec::with_capacity(want.min(shape.max_input));
            for &h in &l.hash_ids {
                let mut rng = StdRng::seed_from_u64(h.wrapping_mul(0x2545_F491_4F6C_DD1D));
                ids.extend((0..shape.block_size).map(|_| 256 + rng.random_range(0..span)));
                if ids.len() >= want {
                    break;
                }
            }
            // Tokens past the hashed blocks are this request's own.
            let mut own = StdRng::seed_from_u64(u64::MAX - i as u64);
            while ids.len() < want {
                ids.push(256 + own.random_range(0..span));
            }
            ids.truncate(want);
            if ids.len() > shape.max_input || l.output_length > shape.max_output {
                cut += 1;
            }
            ids.truncate(shape.max_input);
            let at = (l.timestamp - t0) / 1000.0 / shape.speed.max(1e-9);
            Item {
                prompt: Prompt::Ids(ids),
                max_tokens: l.output_length.clamp(1, shape.max_output) as u32,
                at: Some(at),
            }
        })
        .collect();
    (items, cut)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synth() -> Synth {
        Synth {
            prefix_words: 50,
            question_words: 5,
            system_prompts: 2,
            conversations: 3,
            turns: 2,
            output_len: 8,
            seed: 1,
        }
    }

    #[test]
    fn shared_prefix_turns_extend_their_conversation() {
        let s = synth();
        let Prompt::Chat(first) = shared_prefix(&s, 0).prompt else { panic!("chat") };
        let Prompt::Chat(second) = shared_prefix(&s, 3).prompt else { panic!("chat") };
        assert_eq!(first.len(), 2);
        assert_eq!(second.len(), 4);
        assert_eq!(second[..2], first[..], "turn 1 repeats turn 0");
        let Prompt::Chat(other) = shared_prefix(&s, 2).prompt else { panic!("chat") };
        assert_eq!(other[0], first[0], "conversations 0 and 2 share system prompt 0");
        let Prompt::Chat(third) = shared_prefix(&s, 1).prompt else { panic!("chat") };
        assert_ne!(third[0], first[0]);
        assert_eq!(shared_prefix(&s, 4), shared_prefix(&s, 4), "deterministic");
    }

    #[test]
    fn trace_blocks_are_shared_by_hash_id() {
        let text = r#"{"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [7, 8]}
{"timestamp": 1500, "input_length": 7, "output_length": 900, "hash_ids": [7, 9]}

{"timestamp": 2000, "input_length": 12, "output_length": 2, "hash_ids": [1]}"#;
        let lines = read_trace(text).expect("valid");
        let shape = TraceShape { block_size: 4, max_input: 11, max_output: 100, vocab: 1000, speed: 2.0 };
        let (items, cut) = from_trace(&lines, &shape);
        let ids = |i: usize| match &items[i].prompt {
            Prompt::Ids(v) => v.clone(),
            p => panic!("{p:?}"),
        };
        assert_eq!(ids(0).len(), 10);
        assert_eq!(ids(1).len(), 7);
        assert_eq!(ids(0)[..4], ids(1)[..4], "hash 7 is the same block");
        assert_ne!(ids(0)[4..7], ids(1)[4..7]);
        assert_eq!(ids(2).len(), 11, "cut to max_input");
        assert_eq!(cut, 2);
        assert_eq!(items[1].max_tokens, 100);
        assert_eq!(items.iter().map(|i| i.at).collect::<Vec<_>>(), [Some(0.0), Some(0.25), Some(0.5)]);
        assert!(ids(0).iter().all(|&t| (256..1000).contains(&t)));
        assert!(read_trace("{\"timestamp\": 1}").expect_err("fields").contains("line 1"));
        assert!(read_trace("").is_err());
    }
}
