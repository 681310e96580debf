//! The `multi-turn` loop: each closed-loop slot holds one conversation at a time and drives it
//! turn by turn. A turn is the conversation so far — its own system prompt, every question and
//! the model's **actual** answers (the streamed text) — and a new question; after the answer
//! the user "thinks" for `think` before the next turn. A failed turn ends its conversation (its
//! history would lack an answer); the slot opens the next one.
//!
//! A slot opening a conversation reserves its turns' requests from the limit at once, so the
//! conversations are whole (the last one cut only by a limit that is not a multiple of the
//! turns) however fast slots move: `--requests 192 --turns 6` is 32 conversations of 6 turns.
//! A conversation that ends early gives back the requests it did not send.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::client::Sample;
use super::workload::{self, Item, Prompt, Synth};

/// What the slots share: the next conversation's number, requests reserved so far and the
/// limits.
pub struct Shared {
    /// Next conversation.
    pub next: AtomicUsize,
    /// Requests sent or reserved by open conversations.
    pub sent: AtomicUsize,
    /// Most requests to send.
    pub limit: usize,
    /// No request starts after this.
    pub stop_sending: Instant,
    /// Turns per conversation.
    pub turns: usize,
    /// Between an answer and the next turn.
    pub think: Duration,
}

impl Shared {
    /// Reserves up to `turns` requests of the limit for a new conversation: how many (0: the
    /// limit is spent).
    fn reserve(&self) -> usize {
        let mut at = self.sent.load(Ordering::Relaxed);
        loop {
            let n = self.turns.max(1).min(self.limit.saturating_sub(at));
            if n == 0 {
                return 0;
            }
            match self.sent.compare_exchange(at, at + n, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return n,
                Err(now) => at = now,
            }
        }
    }
}

/// One slot: conversations until the time or the request limit runs out; its samples.
pub async fn slot<F, Fut>(synth: &Synth, shared: &Shared, one: F) -> Vec<Sample>
where
    F: Fn(Item) -> Fut,
    Fut: Future<Output = Sample>,
{
    let mut mine = Vec::new();
    'conversations: loop {
        if Instant::now() >= shared.stop_sending {
            break;
        }
        let turns = shared.reserve();
        if turns == 0 {
            break;
        }
        let c = shared.next.fetch_add(1, Ordering::Relaxed);
        let mut history = vec![workload::multi_turn_opening(synth, c)];
        for t in 0..turns {
            if Instant::now() >= shared.stop_sending {
                shared.sent.fetch_sub(turns - t, Ordering::Relaxed);
                break 'conversations;
            }
            history.push(workload::multi_turn_question(synth, c, t));
            let item = Item { prompt: Prompt::Chat(history.clone()), max_tokens: synth.output_len, at: None };
            let mut s = one(item).await;
            (s.conversation, s.turn) = (c as u32, t as u32);
            let failed = s.error.is_some();
            history.push(("assistant".into(), std::mem::take(&mut s.text)));
            mine.push(s);
            if failed {
                shared.sent.fetch_sub(turns - t - 1, Ordering::Relaxed);
                continue 'conversations;
            }
            if t + 1 < turns {
                tokio::time::sleep(shared.think).await;
            }
        }
    }
    mine
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn synth() -> Synth {
        Synth {
            prefix_words: 5,
            question_words: 3,
            system_prompts: 1,
            conversations: 1,
            turns: 3,
            output_len: 4,
            seed: 1,
        }
    }

    /// Conversations of 3 turns, at most `limit` requests, no thinking.
    fn shared(limit: usize) -> Shared {
        Shared {
            next: AtomicUsize::new(0),
            sent: AtomicUsize::new(0),
            limit,
            stop_sending: Instant::now() + Duration::from_secs(60),
            turns: 3,
            think: Duration::ZERO,
        }
    }

    /// Each turn sends the conversation so far with the answers exactly as they came back; a
    /// failed turn ends its conversation; the request limit holds.
    #[tokio::test]
    async fn a_turn_carries_the_answers_as_they_came() {
        let synth = synth();
        let shared = shared(5);
        let seen = Mutex::new(Vec::new());
        let one = |item: Item| {
            let n = seen.lock().map(|mut v| {
                v.push(item.clone());
                v.len()
            });
            async move {
                let n = n.unwrap_or(0);
                // The fifth request fails.
                let error = (n == 5).then(|| "boom".to_string());
                Sample { text: format!("answer {n}"), error, ..Sample::default() }
            }
        };
        let samples = slot(&synth, &shared, one).await;
        let turns: Vec<(u32, u32)> = samples.iter().map(|s| (s.conversation, s.turn)).collect();
        assert_eq!(turns, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)], "5 requests, the limit");
        let sent = seen.lock().map(|v| v.clone()).unwrap_or_default();
        let chat = |i: usize| match &sent[i].prompt {
            Prompt::Chat(m) => m.clone(),
            other => panic!("{other:?}"),
        };
        let third = chat(2);
        assert_eq!(third.len(), 6, "system, then question and answer twice, then a question");
        assert_eq!(third[0], workload::multi_turn_opening(&synth, 0));
        assert_eq!(third[2], ("assistant".to_string(), "answer 1".to_string()));
        assert_eq!(third[4], ("assistant".to_string(), "answer 2".to_string()));
        assert_eq!(third[5], workload::multi_turn_question(&synth, 0, 2));
        assert_eq!(chat(3).len(), 2, "the next conversation starts afresh");
        assert_ne!(chat(3)[0], third[0], "with its own system prompt");
    }

    /// A stop-35 bench test saw 3 first turns of 6 requests at `--turns 3`: a fast slot opened
    /// a third conversation while the slow one was in its second. Conversations are reserved
    /// whole now: two slots, one fast and one slow, send two whole conversations.
    #[tokio::test]
    async fn a_fast_slot_does_not_cut_a_slow_slots_conversation_short() {
        let synth = synth();
        let shared = shared(6);
        let answer = |delay: u64| {
            move |_: Item| async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                Sample { text: "a".into(), ..Sample::default() }
            }
        };
        let (fast, slow) = tokio::join!(slot(&synth, &shared, answer(0)), slot(&synth, &shared, answer(30)));
        let turns = |v: &[Sample]| v.iter().map(|s| s.turn).collect::<Vec<_>>();
        assert_eq!((turns(&fast), turns(&slow)), (vec![0, 1, 2], vec![0, 1, 2]), "two whole conversations");
    }
}
