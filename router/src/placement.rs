//! Where a request goes: the prefill worker with the least estimated time to first token, the
//! decode worker with the most admissible room. Pure: the caller supplies the index's matches,
//! the workers' load reports and a random source.
//!
//! Estimated TTFT on prefill worker `w` = (its queued prefill tokens + this prompt's tokens not
//! cached on `w`) / `w`'s measured prefill rate + the transfer of the prompt's pages. The
//! minimum wins; a random jitter of up to 1 % breaks near-ties, so several routers fed the
//! same reports do not all pick the same worker.

use std::str::FromStr;

/// How prefill workers are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Policy {
    /// Least estimated time to first token, counting cached prefixes (the default).
    #[default]
    CacheAware,
    /// In turn, ignoring caches and load (for comparison).
    RoundRobin,
    /// Fewest queued prefill tokens, ignoring caches (for comparison).
    LeastLoad,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cache-aware" => Ok(Self::CacheAware),
            "round-robin" => Ok(Self::RoundRobin),
            "least-load" => Ok(Self::LeastLoad),
            o => Err(format!("unknown placement policy {o:?} (cache-aware, round-robin, least-load)")),
        }
    }
}

/// What placement knows of a prefill worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillState {
    /// Reachable and not tripped by the circuit breaker.
    pub healthy: bool,
    /// Prompt tokens still to compute in its queues.
    pub queued_tokens: u64,
    /// Its measured prefill rate (tokens per second; 0 when not measured yet).
    pub tokens_per_second: f64,
}

/// What placement knows of a decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeState {
    /// Reachable and not tripped.
    pub healthy: bool,
    /// Pages free and not promised to admitted requests.
    pub admissible_pages: u64,
    /// Pages in its pool (`u64::MAX` while unknown).
    pub total_pages: u64,
}

/// A prefill choice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillChoice {
    /// The worker's slot.
    pub worker: usize,
    /// Prompt tokens it holds already.
    pub cached_tokens: usize,
    /// Estimated seconds to the first token.
    pub ttft: f64,
}

/// Placement settings.
#[derive(Debug, Clone, Copy)]
pub struct Placer {
    /// The prefill policy.
    pub policy: Policy,
    /// Rate assumed for a worker that has not measured one yet (tokens per second).
    pub default_rate: f64,
    /// KV bytes per prompt token (all layers, K and V).
    pub kv_bytes_per_token: f64,
    /// Assumed transfer bandwidth, bytes per second.
    pub transfer_bytes_per_second: f64,
    rr: usize,
}

/// No worker can take the request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no worker can take the request now; retry in {retry_after_ms} ms")]
pub struct NoRoom {
    /// A hint for the client.
    pub retry_after_ms: u64,
}

/// Why no decode worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoDecode {
    /// No healthy decode worker now: worth a retry.
    #[error(transparent)]
    NoRoom(#[from] NoRoom),
    /// The request needs more pages than any healthy decode worker's whole pool: it can
    /// never run as sent.
    #[error(
        "the prompt and max_tokens need {need} KV pages; the largest decode worker holds {largest}: lower max_tokens"
    )]
    TooLarge {
        /// Pages the prompt and its max tokens need.
        need: u64,
        /// The largest healthy pool.
        largest: u64,
    },
}

impl Placer {
    /// A placer for `policy`.
    pub fn new(policy: Policy, default_rate: f64, kv_bytes_per_token: f64, transfer_bytes_per_second: f64) -> Self {
        Self { policy, default_rate, kv_bytes_per_token, transfer_bytes_per_second, rr: 0 }
    }

    /// Seconds to move the KV of `tokens` prompt tokens.
    pub fn transfer_seconds(&self, tokens: usize) -> f64 {
        tokens as f64 * self.kv_bytes_per_token / self.transfer_bytes_per_second.max(1.0)
    }

    /// Picks the prefill worker for a prompt of `len` tokens; `cached[w]` is what worker `w`
    /// holds of it; `jitter(i)` returns a number in [0, 1) for worker `i`.
    pub fn prefill(
        &mut self,
        len: usize,
        cached: &[usize],
        states: &[PrefillState],
        mut jitter: impl FnMut(usize) -> f64,
    ) -> Option<PrefillChoice> {
        let healthy = || (0..states.len()).filter(|&w| states[w].healthy);
        let held = |w: usize| cached.get(w).copied().unwrap_or(0).min(len);
        let (default_rate, transfer) = (self.default_rate.max(1.0), self.transfer_seconds(len));
        let ttft = |w: usize| {
            let s = &states[w];
            let rate = if s.tokens_per_second > 0.0 { s.tokens_per_second } else { default_rate };
            (s.queued_tokens as f64 + (len - held(w)) as f64) / rate + transfer
        };
        let w = match self.policy {
            Policy::RoundRobin => {
                let n = healthy().count();
                if n == 0 {
                    return None;
                }
                self.rr = self.rr.wrapping_add(1);
                healthy().nth(self.rr % n)?
            }
            Policy::LeastLoad => healthy().min_by_key(|&w| (states[w].queued_tokens, w))?,
            // One pass, nothing allocated: a router with a thousand workers scores each.
            Policy::CacheAware => {
                healthy().map(|w| (w, ttft(w) * (1.0 + 0.01 * jitter(w)))).min_by(|a, b| a.1.total_cmp(&b.1))?.0
            }
        };
        Some(PrefillChoice { worker: w, cached_tokens: held(w), ttft: ttft(w) })
    }

    /// Picks, among the healthy decode workers whose pool can hold the request's `need`
    /// pages at all, the one with the most admissible pages. A worker short of free pages
    /// queues the request and retracts running ones to make room (never cutting one), so
    /// free pages rank workers but do not refuse requests; a request larger than every
    /// pool is refused at once.
    pub fn decode(&self, need: u64, states: &[DecodeState]) -> Result<usize, NoDecode> {
        let healthy: Vec<usize> = (0..states.len()).filter(|&w| states[w].healthy).collect();
        if healthy.is_empty() {
            return Err(NoRoom { retry_after_ms: 500 }.into());
        }
        healthy
            .iter()
            .copied()
            .filter(|&w| states[w].total_pages >= need)
            .max_by_key(|&w| (states[w].admissible_pages, std::cmp::Reverse(w)))
            .ok_or_else(|| NoDecode::TooLarge {
                need,
                largest: healthy.iter().map(|&w| states[w].total_pages).max().unwrap_or(0),
            })
    }
}

/// Whether to prefill on a prefill worker (true) or on the decode worker itself: prompts with
/// fewer uncached tokens than `threshold` are prefilled locally (0: always disaggregate), and
/// with no healthy prefill worker everything is.
pub fn disaggregate(uncached_tokens: usize, threshold: usize, prefill_available: bool) -> bool {
    prefill_available && uncached_tokens >= threshold
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(queued: u64, rate: f64) -> PrefillState {
        PrefillState { healthy: true, queued_tokens: queued, tokens_per_second: rate }
    }

    #[test]
    fn cache_aware_weighs_the_prefix_against_the_queue() {
        let mut p = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
        let none = |_| 0.0;
        // Worker 1 holds 900 of 1000 tokens: 100 to compute against 1000 elsewhere.
        let c = p.prefill(1000, &[0, 900, 0], &[st(0, 1000.0), st(0, 1000.0), st(0, 1000.0)], none).expect("one");
        assert_eq!((c.worker, c.cached_tokens), (1, 900));
        assert!((c.ttft - 0.1).abs() < 1e-9);
        // The same worker with 2000 queued tokens is slower than an idle cold one.
        let c = p.prefill(1000, &[0, 900], &[st(0, 1000.0), st(2000, 1000.0)], none).expect("one");
        assert_eq!(c.worker, 0);
        // A faster worker wins a cold race; unhealthy ones never win.
        let mut down = st(0, 1e6);
        down.healthy = false;
        let c = p.prefill(1000, &[0, 0, 0], &[st(0, 1000.0), st(0, 4000.0), down], none).expect("one");
        assert_eq!(c.worker, 1);
        assert!(p.prefill(10, &[], &[down], none).is_none());
    }

    #[test]
    fn jitter_spreads_exact_ties_and_other_policies_ignore_caches() {
        let mut p = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
        let tie = [st(0, 1000.0), st(0, 1000.0)];
        let a = p.prefill(100, &[0, 0], &tie, |w| if w == 0 { 0.9 } else { 0.1 }).expect("one");
        let b = p.prefill(100, &[0, 0], &tie, |w| if w == 0 { 0.1 } else { 0.9 }).expect("one");
        assert_ne!(a.worker, b.worker);
        let mut rr = Placer::new(Policy::RoundRobin, 1000.0, 0.0, 1e9);
        let picks: Vec<usize> = (0..4).map(|_| rr.prefill(10, &[10, 0], &tie, |_| 0.0).expect("one").worker).collect();
        assert_eq!(picks, vec![1, 0, 1, 0]);
        let mut ll = Placer::new(Policy::LeastLoad, 1000.0, 0.0, 1e9);
        let c = ll.prefill(10, &[10, 0], &[st(50, 1.0), st(5, 1.0)], |_| 0.0).expect("one");
        assert_eq!((c.worker, c.cached_tokens), (1, 0));
        assert_eq!("least-load".parse::<Policy>(), Ok(Policy::LeastLoad));
        assert!("random".parse::<Policy>().is_err());
    }

    #[test]
    fn decode_takes_the_roomiest_and_says_when_none_fits() {
        let p = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
        let d = |h, pages| DecodeState { healthy: h, admissible_pages: pages, total_pages: 100 };
        assert_eq!(p.decode(10, &[d(true, 20), d(true, 50), d(false, 500)]), Ok(1));
        // Short of free pages everywhere: the roomiest still takes it (it queues there).
        assert_eq!(p.decode(60, &[d(true, 20), d(true, 50)]), Ok(1));
        assert_eq!(p.decode(60, &[d(false, 20)]), Err(NoRoom { retry_after_ms: 500 }.into()));
        // Larger than every healthy pool: refused for good, naming the largest.
        let big = DecodeState { healthy: true, admissible_pages: 0, total_pages: 400 };
        assert_eq!(p.decode(101, &[d(true, 20), d(false, 0)]), Err(NoDecode::TooLarge { need: 101, largest: 100 }));
        assert_eq!(p.decode(101, &[d(true, 20), big]), Ok(1));
        assert!(disaggregate(100, 64, true) && !disaggregate(10, 64, true) && !disaggregate(100, 64, false));
        assert!(disaggregate(0, 0, true), "threshold 0: always disaggregate");
        let t = Placer::new(Policy::CacheAware, 1.0, 1000.0, 1e6).transfer_seconds(2000);
        assert!((t - 2.0).abs() < 1e-9);
    }
}
