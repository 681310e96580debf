//! A `multi-turn` run by turn: the first turns (nothing of the conversation cached yet) apart
//! from the later ones (their prompt opens with the conversation so far, the model's own
//! answers included), and every completed request's figures for scripts that compare runs
//! (`scripts/multi-turn-ab`).

use serde::Serialize;

use super::client::Sample;
use super::report::Dist;

/// Requests of some turns.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TurnGroup {
    /// Completed requests.
    pub requests: usize,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Of those, reported cached.
    pub cached_tokens: u64,
    /// Their time to first token.
    pub ttft_ms: Dist,
}

impl TurnGroup {
    fn of(v: &[&Sample]) -> Self {
        let ttft: Vec<f64> = v.iter().filter_map(|s| s.token_times.first().map(|t| t - s.start)).collect();
        Self {
            requests: v.len(),
            prompt_tokens: v.iter().map(|s| u64::from(s.prompt_tokens)).sum(),
            cached_tokens: v.iter().map(|s| u64::from(s.cached_tokens)).sum(),
            ttft_ms: Dist::of(&ttft),
        }
    }
}

/// One completed request of a multi-turn run.
#[derive(Debug, Clone, Serialize)]
pub struct TurnSample {
    /// Its conversation.
    pub conversation: u32,
    /// Its turn (0: the conversation's first).
    pub turn: u32,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Of those, reported cached.
    pub cached_tokens: u32,
    /// Time to first token, ms.
    pub ttft_ms: f64,
}

/// A multi-turn run by turn (empty for other workloads).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Turns {
    /// First turns.
    pub first: TurnGroup,
    /// Turns 2 and later.
    pub later: TurnGroup,
    /// Every completed request.
    pub samples: Vec<TurnSample>,
}

impl Turns {
    /// From completed requests; None when none was a later turn (not a multi-turn run).
    pub fn of(ok: &[&Sample]) -> Option<Self> {
        if ok.iter().all(|s| s.turn == 0) {
            return None;
        }
        let (first, later): (Vec<&Sample>, Vec<&Sample>) = ok.iter().partition(|s| s.turn == 0);
        let samples = ok
            .iter()
            .map(|s| TurnSample {
                conversation: s.conversation,
                turn: s.turn,
                prompt_tokens: s.prompt_tokens,
                cached_tokens: s.cached_tokens,
                ttft_ms: s.token_times.first().map_or(0.0, |t| (t - s.start) * 1000.0),
            })
            .collect();
        Some(Self { first: TurnGroup::of(&first), later: TurnGroup::of(&later), samples })
    }

    /// Lines of the report's table.
    pub fn table(&self) -> String {
        let line = |name: &str, g: &TurnGroup| {
            let rate = if g.prompt_tokens == 0 { 0.0 } else { g.cached_tokens as f64 / g.prompt_tokens as f64 };
            format!(
                "  {name:<14}{:>6} requests, {:>8} prompt tokens ({:.1} % cached), TTFT p50 {:.1} ms, p99 {:.1} ms\n",
                g.requests,
                g.prompt_tokens,
                rate * 100.0,
                g.ttft_ms.p50,
                g.ttft_ms.p99
            )
        };
        line("first turns", &self.first) + &line("later turns", &self.later)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_and_later_turns_are_apart() {
        let s = |turn, prompt, ttft: f64| Sample {
            start: 1.0,
            token_times: vec![1.0 + ttft],
            end: 2.0,
            prompt_tokens: prompt,
            cached_tokens: prompt / 2,
            turn,
            ..Sample::default()
        };
        let v = [s(0, 100, 0.5), s(1, 300, 0.1), s(2, 500, 0.2), s(0, 100, 0.7)];
        let refs: Vec<&Sample> = v.iter().collect();
        assert!(Turns::of(&refs[..1]).is_none(), "no later turn: not a multi-turn run");
        let t = Turns::of(&refs).expect("multi-turn");
        assert_eq!((t.first.requests, t.later.requests), (2, 2));
        assert_eq!((t.first.prompt_tokens, t.later.prompt_tokens, t.later.cached_tokens), (200, 800, 400));
        assert!((t.later.ttft_ms.max - 200.0).abs() < 1e-6 && (t.first.ttft_ms.min - 500.0).abs() < 1e-6);
        assert_eq!(t.samples.len(), 4);
        assert!(t.table().contains("later turns"));
    }
}
