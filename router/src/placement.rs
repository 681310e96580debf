//! Where a request goes: the prefill worker with the least estimated time to first token, the
//! decode worker holding most of the prompt (a conversation's history) while it has room, else
//! the one with the most admissible room; and where the prompt is computed — on the prefill
//! worker (which may first pull from the decode worker the pages that worker holds and it
//! lacks), or on the decode worker from what it holds. Pure: the caller supplies the indexes'
//! matches, the workers' load reports and a random source.
//!
//! Estimated TTFT on prefill worker `w` = (its queued prefill tokens + this prompt's tokens not
//! cached on `w`) / `w`'s measured prefill rate + the transfer of the prompt's pages. The
//! minimum wins; a random jitter of up to 1 % breaks near-ties, so several routers fed the
//! same reports do not all pick the same worker.

use std::str::FromStr;
use std::time::Instant;

mod board;
mod score;

pub use board::PrefillBoard;
pub(crate) use board::since_epoch;
#[cfg(test)]
use score::first_least;
pub use score::jitter;
use score::least_jittered;

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

/// A placement policy name that is none of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown placement policy {0:?} (cache-aware, round-robin, least-load)")]
pub struct UnknownPolicy(String);

impl FromStr for Policy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        match s {
            "cache-aware" => Ok(Self::CacheAware),
            "round-robin" => Ok(Self::RoundRobin),
            "least-load" => Ok(Self::LeastLoad),
            o => Err(UnknownPolicy(o.to_string())),
        }
    }
}

/// What placement knows of a prefill worker ([`PrefillState::new`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillState {
    /// Reachable and not tripped by the circuit breaker.
    pub healthy: bool,
    /// Prompt tokens still to compute in its queues.
    pub queued_tokens: u64,
    /// Its measured prefill rate (tokens per second; 0 when not measured yet).
    pub tokens_per_second: f64,
    /// `queued_tokens` and `1 / tokens_per_second` (0 when not measured) as placement scores
    /// them: a router scoring a thousand workers per request divides once per load report,
    /// not once per worker and request. (Set only by the constructors: change a state by
    /// making a new one.)
    queued: f64,
    seconds_per_token: f64,
}

impl PrefillState {
    /// A worker `healthy` or not, with `queued_tokens` to compute at `tokens_per_second`.
    pub fn new(healthy: bool, queued_tokens: u64, tokens_per_second: f64) -> Self {
        Self::with_reciprocal(healthy, queued_tokens, tokens_per_second, seconds_per_token(tokens_per_second))
    }

    /// [`Self::new`] given `1 / tokens_per_second` (0 when not measured) already.
    pub(crate) fn with_reciprocal(
        healthy: bool,
        queued_tokens: u64,
        tokens_per_second: f64,
        seconds_per_token: f64,
    ) -> Self {
        Self { healthy, queued_tokens, tokens_per_second, queued: queued_tokens as f64, seconds_per_token }
    }
}

/// `1 / tokens_per_second`, 0 when not measured (0 or less).
pub(crate) fn seconds_per_token(tokens_per_second: f64) -> f64 {
    if tokens_per_second > 0.0 { 1.0 / tokens_per_second } else { 0.0 }
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
    /// Prompt tokens its prefix cache holds (its KV events say).
    pub cached_tokens: usize,
    /// Requests it serves now: those this router placed there and still streams, plus those
    /// its last load report counted beyond them (other routers').
    pub requests: u64,
}

/// `--decode-request-tokens`'s default: one more request in a decode worker's batch costs
/// as much as computing this many prompt tokens (see [`Placer::decode`]).
pub const DECODE_REQUEST_TOKENS: f64 = 128.0;

/// What a pull costs besides moving its pages: one more call and a room opened on each side
/// (seconds). A pull is chosen only when computing what it brings would take longer.
pub const PULL_OVERHEAD_SECONDS: f64 = 0.001;

/// Where a prompt is computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Path {
    /// On this prefill worker, which sends the decode worker the pages it lacks.
    Prefill(PrefillChoice),
    /// On this prefill worker, which first pulls from the decode worker the leading pages that
    /// worker holds and it lacks (a conversation's earlier answers), then computes the rest
    /// and sends the decode worker the pages it lacks.
    Pull(PrefillChoice),
    /// On the decode worker, from what it holds.
    Local(LocalWhy),
}

/// Why a prompt is computed on the decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalWhy {
    /// No healthy prefill worker.
    NoPrefill,
    /// Fewer uncached tokens (on the decode worker) than `--local-prefill-below`.
    Short,
    /// The decode worker holds the prompt's history: what it lacks is at most
    /// `--local-prefill-max` tokens and is sooner computed there than on a prefill worker.
    DecodeCache,
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
    /// Whether a prefill worker may pull what the decode worker holds (`--disable-pull`).
    pub pull: bool,
    /// What one more request in a decode worker's batch costs, in prompt tokens computed
    /// (`--decode-request-tokens`).
    pub decode_request_tokens: f64,
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
        Self {
            policy,
            default_rate,
            kv_bytes_per_token,
            transfer_bytes_per_second,
            pull: true,
            decode_request_tokens: DECODE_REQUEST_TOKENS,
            rr: 0,
        }
    }

    /// Seconds to move the KV of `tokens` prompt tokens.
    pub fn transfer_seconds(&self, tokens: usize) -> f64 {
        tokens as f64 * self.kv_bytes_per_token / self.transfer_bytes_per_second.max(1.0)
    }

    /// Picks the prefill worker for a prompt of `len` tokens; `cached[w]` is what worker `w`
    /// holds of it; `pending` the prompt tokens this router has sent a few workers and not
    /// yet seen computed, one `(slot, tokens)` a worker (a worker's queue counts as the larger
    /// of that and its report, which comes a poll interval late: a burst would otherwise all
    /// go to the worker holding its shared prefix); `board` has every worker's numbers
    /// (healthy or not at `now`); `jitter(i)` returns a number in [0, 1) for worker `i`.
    pub fn prefill(
        &mut self,
        len: usize,
        (cached, pending): (&[usize], &[(usize, f64)]),
        board: &PrefillBoard,
        now: Instant,
        mut jitter: impl FnMut(usize) -> f64,
    ) -> Option<PrefillChoice> {
        let healthy = || (0..board.len()).filter(|&w| board.healthy(w, now));
        let held = |w: usize| cached.get(w).copied().unwrap_or(0).min(len);
        let (default_rate, transfer) = (self.default_rate.max(1.0), self.transfer_seconds(len));
        let queue = |w: usize, reported: u64| {
            pending.iter().filter(|&&(s, _)| s == w).fold(reported as f64, |q, &(_, p)| q.max(p))
        };
        let ttft = |w: usize| {
            let s = board.state(w, now);
            let rate = if s.tokens_per_second > 0.0 { s.tokens_per_second } else { default_rate };
            (queue(w, s.queued_tokens) + (len - held(w)) as f64) / rate + transfer
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
            Policy::LeastLoad => healthy().min_by(|&a, &b| {
                let q = |w: usize| queue(w, board.state(w, now).queued_tokens);
                q(a).total_cmp(&q(b)).then(a.cmp(&b))
            })?,
            Policy::CacheAware => least_jittered(
                (len, transfer),
                (cached, pending),
                board,
                PrefillBoard::at(now),
                default_rate,
                &mut jitter,
            )?,
        };
        Some(PrefillChoice { worker: w, cached_tokens: held(w), ttft: ttft(w) })
    }

    /// Picks, among the healthy decode workers whose pool can hold the request's `need`
    /// pages at all and that can admit it now, the one where it costs least: the prompt
    /// tokens of `len` it lacks (its cache holds the rest: a conversation's next turn finds
    /// its history) plus [`Placer::decode_request_tokens`] for each request it already
    /// serves (what joining its batch costs; a tie: the roomier, then the first). So a few
    /// shared cached pages do not outweigh an idle worker, and a long history outweighs a
    /// request or two more. When none can admit it now, the roomiest: a worker short of free
    /// pages queues the request and retracts running ones to make room (never cutting one).
    /// A request larger than every pool is refused at once.
    pub fn decode(&self, need: u64, len: usize, states: &[DecodeState]) -> Result<usize, NoDecode> {
        let healthy: Vec<usize> = (0..states.len()).filter(|&w| states[w].healthy).collect();
        if healthy.is_empty() {
            return Err(NoRoom { retry_after_ms: 500 }.into());
        }
        let fits = || healthy.iter().copied().filter(|&w| states[w].total_pages >= need);
        let room = |w: usize| states[w].admissible_pages;
        let Some(roomiest) = fits().max_by_key(|&w| (room(w), std::cmp::Reverse(w))) else {
            let largest = healthy.iter().map(|&w| states[w].total_pages).max().unwrap_or(0);
            return Err(NoDecode::TooLarge { need, largest });
        };
        let cost = |w: usize| {
            let s = &states[w];
            len.saturating_sub(s.cached_tokens) as f64 + s.requests as f64 * self.decode_request_tokens
        };
        let cheapest = fits()
            .filter(|&w| room(w) >= need)
            .min_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(room(b).cmp(&room(a))).then(a.cmp(&b)));
        Ok(cheapest.unwrap_or(roomiest))
    }

    /// Where a prompt of `len` tokens is computed, given the prefill choice (None: no healthy
    /// prefill worker), what the chosen decode worker holds of it (`decode_cached` tokens),
    /// `--local-prefill-below` (`below`) and `--local-prefill-max` (`local_max`).
    ///
    /// On the decode worker when no prefill worker can take it, or when it lacks fewer than
    /// `below` tokens, or when it lacks at most `local_max` and computing them there is
    /// estimated sooner than on the prefill worker (its queue, what it lacks, and the transfer
    /// of the pages the decode worker lacks), at the prefill worker's rate. A tie goes to the
    /// prefill worker: a decode worker's prompt work delays its running requests.
    ///
    /// On the prefill worker, the tokens the decode worker holds and it lacks are pulled
    /// instead of computed when moving their pages (plus [`PULL_OVERHEAD_SECONDS`]) is
    /// estimated sooner than computing them; the estimate above counts that.
    pub fn path(
        &self,
        len: usize,
        choice: Option<(PrefillChoice, PrefillState)>,
        decode_cached: usize,
        below: usize,
        local_max: usize,
    ) -> Path {
        let Some((c, p)) = choice else { return Path::Local(LocalWhy::NoPrefill) };
        let lacks = len - decode_cached.min(len.saturating_sub(1));
        if lacks < below {
            return Path::Local(LocalWhy::Short);
        }
        let rate = if p.tokens_per_second > 0.0 { p.tokens_per_second } else { self.default_rate.max(1.0) };
        // What the prefill worker would compute although the decode worker holds it.
        let gain = decode_cached.min(len.saturating_sub(1)).saturating_sub(c.cached_tokens);
        let pull_cost = self.transfer_seconds(gain) + PULL_OVERHEAD_SECONDS;
        let pull = self.pull && gain > 0 && pull_cost < gain as f64 / rate;
        if decode_cached > 0 && lacks <= local_max {
            let mut remote = c.ttft - self.transfer_seconds(len) + self.transfer_seconds(lacks);
            if pull {
                remote -= gain as f64 / rate - pull_cost;
            }
            if (lacks as f64) / rate < remote {
                return Path::Local(LocalWhy::DecodeCache);
            }
        }
        if pull { Path::Pull(c) } else { Path::Prefill(c) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The four-lane search gives the first least value, as a pass in order would: ties in
    /// and across lanes, the remainder after the quads, and nothing when all are infinite.
    #[test]
    fn first_least_is_the_first_of_the_least() {
        let naive = |v: &[f64]| {
            let mut best: Option<(usize, f64)> = None;
            for (i, &s) in v.iter().enumerate() {
                if s < f64::INFINITY && best.is_none_or(|(_, b)| s < b) {
                    best = Some((i, s));
                }
            }
            best.map(|b| b.0)
        };
        let inf = f64::INFINITY;
        let cases: Vec<Vec<f64>> = vec![
            vec![],
            vec![inf; 7],
            vec![3.0, 2.0, 2.0, 5.0, 2.0],
            vec![4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0],
            vec![9.0, 8.0, 7.0, 6.0, 5.0, 5.0, 9.0, 9.0, 1.0],
            vec![inf, inf, inf, 0.5, inf, 0.5],
        ];
        for v in cases {
            assert_eq!(first_least(&v), naive(&v), "{v:?}");
        }
        for seed in 0..200u32 {
            let j = jitter(seed);
            let v: Vec<f64> = (0..(seed as usize % 37)).map(|w| (j(w) * 8.0).floor()).collect();
            assert_eq!(first_least(&v), naive(&v), "{v:?}");
        }
    }

    /// A board of `states`.
    fn on(states: &[PrefillState]) -> PrefillBoard {
        PrefillBoard::from_states(states)
    }

    fn st(queued: u64, rate: f64) -> PrefillState {
        PrefillState::new(true, queued, rate)
    }

    #[test]
    fn cache_aware_weighs_the_prefix_against_the_queue() {
        let mut p = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
        let none = |_| 0.0;
        // Worker 1 holds 900 of 1000 tokens: 100 to compute against 1000 elsewhere.
        let c = p
            .prefill(
                1000,
                (&[0, 900, 0], &[]),
                &on(&[st(0, 1000.0), st(0, 1000.0), st(0, 1000.0)]),
                Instant::now(),
                none,
            )
            .expect("one");
        assert_eq!((c.worker, c.cached_tokens), (1, 900));
        assert!((c.ttft - 0.1).abs() < 1e-9);
        // The same worker with 2000 queued tokens is slower than an idle cold one.
        let c = p
            .prefill(1000, (&[0, 900], &[]), &on(&[st(0, 1000.0), st(2000, 1000.0)]), Instant::now(), none)
            .expect("one");
        assert_eq!(c.worker, 0);
        // A faster worker wins a cold race; unhealthy ones never win.
        let mut down = st(0, 1e6);
        down.healthy = false;
        let c = p
            .prefill(1000, (&[0, 0, 0], &[]), &on(&[st(0, 1000.0), st(0, 4000.0), down]), Instant::now(), none)
            .expect("one");
        assert_eq!(c.worker, 1);
        assert!(p.prefill(10, (&[], &[]), &on(&[down]), Instant::now(), none).is_none());
    }

    /// Issue 61: what this router has pending on a worker counts as its queue before the
    /// worker reports it (the larger of the two: a report counts the router's own requests
    /// once they arrive), for the cache-aware and least-load policies.
    #[test]
    fn tokens_pending_from_this_router_count_as_a_queue_before_the_report_does() {
        let mut p = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
        let idle = on(&[st(0, 1000.0), st(0, 1000.0)]);
        let place = |p: &mut Placer, pending: &[(usize, f64)], board: &PrefillBoard| {
            p.prefill(1000, (&[900, 0], pending), board, Instant::now(), |_| 0.0).expect("one")
        };
        // Worker 0 holds 900 of 1000 tokens: it wins while nothing is pending there...
        assert_eq!(place(&mut p, &[], &idle).worker, 0);
        assert_eq!(place(&mut p, &[(0, 800.0)], &idle).worker, 0);
        // ...and loses once 1000 tokens are (1.1 s against 1.0 s), the estimate saying so.
        let c = place(&mut p, &[(0, 1000.0)], &idle);
        assert_eq!(c.worker, 1);
        assert!((c.ttft - 1.0).abs() < 1e-9, "{c:?}");
        let c = place(&mut p, &[(0, 1000.0), (1, 300.0)], &idle);
        assert_eq!(c.worker, 0, "1.1 s against 1.3 s");
        assert!((c.ttft - 1.1).abs() < 1e-9, "{c:?}");
        // The larger of report and pending, not their sum: 900 reported and 900 pending.
        let reported = on(&[st(900, 1000.0), st(0, 1000.0)]);
        assert_eq!(place(&mut p, &[(0, 900.0)], &reported).worker, 0, "1.0 s against 1.0 s: the first");
        // A slot beyond the board is ignored.
        assert_eq!(place(&mut p, &[(5, 1e9)], &idle).worker, 0);
        let mut ll = Placer::new(Policy::LeastLoad, 1000.0, 0.0, 1e9);
        let c = ll.prefill(10, (&[], &[(1, 60.0)]), &on(&[st(50, 1.0), st(5, 1.0)]), Instant::now(), |_| 0.0);
        assert_eq!(c.expect("one").worker, 0);
    }

    #[test]
    fn jitter_spreads_exact_ties_and_other_policies_ignore_caches() {
        let mut p = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
        let tie = [st(0, 1000.0), st(0, 1000.0)];
        let a =
            p.prefill(100, (&[0, 0], &[]), &on(&tie), Instant::now(), |w| if w == 0 { 0.9 } else { 0.1 }).expect("one");
        let b =
            p.prefill(100, (&[0, 0], &[]), &on(&tie), Instant::now(), |w| if w == 0 { 0.1 } else { 0.9 }).expect("one");
        assert_ne!(a.worker, b.worker);
        let mut rr = Placer::new(Policy::RoundRobin, 1000.0, 0.0, 1e9);
        let picks: Vec<usize> = (0..4)
            .map(|_| rr.prefill(10, (&[10, 0], &[]), &on(&tie), Instant::now(), |_| 0.0).expect("one").worker)
            .collect();
        assert_eq!(picks, vec![1, 0, 1, 0]);
        let mut ll = Placer::new(Policy::LeastLoad, 1000.0, 0.0, 1e9);
        let c = ll.prefill(10, (&[10, 0], &[]), &on(&[st(50, 1.0), st(5, 1.0)]), Instant::now(), |_| 0.0).expect("one");
        assert_eq!((c.worker, c.cached_tokens), (1, 0));
        assert_eq!("least-load".parse::<Policy>(), Ok(Policy::LeastLoad));
        assert!("random".parse::<Policy>().is_err());
    }

    /// The router's jitter: in [0, 1), different for a thousand workers, and a tie between
    /// them goes to different workers for different seeds.
    #[test]
    fn the_jitter_spreads_a_thousand_tied_workers() {
        let mut winners = std::collections::HashSet::new();
        for seed in 0..64u32 {
            let j = jitter(seed.wrapping_mul(2_654_435_761));
            let values: Vec<f64> = (0..1024).map(&j).collect();
            assert!(values.iter().all(|v| (0.0..1.0).contains(v)));
            let mut bits: Vec<u64> = values.iter().map(|v| v.to_bits()).collect();
            bits.sort_unstable();
            bits.dedup();
            assert_eq!(bits.len(), 1024, "seed {seed}");
            let mut p = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
            let tie = vec![st(0, 1000.0); 1024];
            winners.insert(p.prefill(100, (&[], &[]), &on(&tie), Instant::now(), j).expect("one").worker);
        }
        assert!(winners.len() > 48, "64 seeds picked only {} workers", winners.len());
    }

    #[test]
    fn decode_takes_the_roomiest_and_says_when_none_fits() {
        let p = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
        let d = |h, pages| DecodeState {
            healthy: h,
            admissible_pages: pages,
            total_pages: 100,
            cached_tokens: 0,
            requests: 0,
        };
        assert_eq!(p.decode(10, 64, &[d(true, 20), d(true, 50), d(false, 500)]), Ok(1));
        // Short of free pages everywhere: the roomiest still takes it (it queues there).
        assert_eq!(p.decode(60, 64, &[d(true, 20), d(true, 50)]), Ok(1));
        assert_eq!(p.decode(60, 64, &[d(false, 20)]), Err(NoRoom { retry_after_ms: 500 }.into()));
        // Larger than every healthy pool: refused for good, naming the largest.
        let big = DecodeState { healthy: true, admissible_pages: 0, total_pages: 400, cached_tokens: 0, requests: 0 };
        assert_eq!(p.decode(101, 64, &[d(true, 20), d(false, 0)]), Err(NoDecode::TooLarge { need: 101, largest: 100 }));
        assert_eq!(p.decode(101, 64, &[d(true, 20), big]), Ok(1));
        let t = Placer::new(Policy::CacheAware, 1.0, 1000.0, 1e6).transfer_seconds(2000);
        assert!((t - 2.0).abs() < 1e-9);
    }

    /// Issues 20 and 61: a conversation's next turn goes to the decode worker holding its
    /// history while what that saves outweighs the requests more it serves than another
    /// worker (each [`DECODE_REQUEST_TOKENS`]); a few shared cached tokens do not hold a
    /// burst on one worker; and a turn is computed where that is sooner.
    #[test]
    fn a_turn_follows_its_history_while_its_load_allows_and_is_computed_where_it_is() {
        let p = Placer::new(Policy::CacheAware, 1000.0, 1000.0, 1e6);
        assert_eq!(p.decode_request_tokens, 128.0);
        let d = |pages, cached, requests| DecodeState {
            healthy: true,
            admissible_pages: pages,
            total_pages: 100,
            cached_tokens: cached,
            requests,
        };
        // Worker 0 holds 300 of 320 tokens, worker 1 is roomier and idle: the history wins
        // (20 + 128 against 320).
        assert_eq!(p.decode(10, 320, &[d(60, 300, 1), d(90, 0, 0)]), Ok(0));
        // Three requests more there: 20 + 384 against 320, the idle worker.
        assert_eq!(p.decode(10, 320, &[d(60, 300, 2), d(90, 0, 0)]), Ok(0));
        assert_eq!(p.decode(10, 320, &[d(60, 300, 3), d(90, 0, 0)]), Ok(1));
        // The longest history wins among holders of equal load.
        assert_eq!(p.decode(10, 600, &[d(60, 300, 1), d(60, 500, 1)]), Ok(1));
        // A burst sharing a 32-token system turn that worker 0 holds: its first request goes
        // there, the next to the idle worker, and so on in turn.
        let mut load = [0, 0];
        let mut placed = Vec::new();
        for _ in 0..6 {
            let w = p.decode(4, 52, &[d(90, 32, load[0]), d(90, 0, load[1])]).expect("placed");
            load[w] += 1;
            placed.push(w);
        }
        assert_eq!(placed, [0, 1, 0, 1, 0, 1]);
        // A worker that cannot admit the request now is passed over, history or not.
        assert_eq!(p.decode(50, 320, &[d(45, 300, 0), d(50, 0, 3)]), Ok(1));
        // Equal cost: the roomier, then the first.
        assert_eq!(p.decode(10, 64, &[d(60, 0, 0), d(90, 0, 0)]), Ok(1));
        assert_eq!(p.decode(10, 64, &[d(90, 0, 0), d(90, 0, 0)]), Ok(0));
        // Cache alone (--decode-request-tokens 0): the history, however loaded.
        let cache_only = Placer { decode_request_tokens: 0.0, ..Placer::new(Policy::CacheAware, 1000.0, 1000.0, 1e6) };
        assert_eq!(cache_only.decode(10, 320, &[d(60, 300, 9), d(90, 0, 0)]), Ok(0));

        let st = PrefillState::new(true, 0, 1000.0);
        // 1000 tokens' pages move in 1 ms.
        let mut p = Placer::new(Policy::CacheAware, 1000.0, 1000.0, 1e9);
        let c = p.prefill(1000, (&[0], &[]), &on(&[st]), Instant::now(), |_| 0.0).expect("one");
        // The decode worker holds 900 of 1000 tokens: 100 there (0.1 s) beats 1000 on the
        // prefill worker (1 s) and the transfer of 100 tokens' pages.
        assert_eq!(p.path(1000, Some((c, st)), 900, 0, 512), Path::Local(LocalWhy::DecodeCache));
        // What it lacks is past --local-prefill-max: the prefill worker, whatever the estimate,
        // which pulls the 400 tokens the decode worker holds (0.4 ms and the overhead against
        // 0.4 s) — or computes them, pulls disabled.
        assert_eq!(p.path(1000, Some((c, st)), 400, 0, 512), Path::Pull(c));
        let mut no_pull = p;
        no_pull.pull = false;
        assert_eq!(no_pull.path(1000, Some((c, st)), 400, 0, 512), Path::Prefill(c));
        // A pull too small to pay for itself: computed (1 token: 1 ms, against the overhead).
        assert_eq!(p.path(1000, Some((c, st)), 1, 0, 512), Path::Prefill(c));
        // At the same rate a pull never beats computing the rest where the history is (the
        // prefill worker computes as much after it): within --local-prefill-max, local.
        assert_eq!(p.path(1000, Some((c, st)), 600, 0, 512), Path::Local(LocalWhy::DecodeCache));
        // --local-prefill-max 0 turns the estimate off; --local-prefill-below still counts
        // what the decode worker holds.
        assert_eq!(p.path(1000, Some((c, st)), 900, 0, 0), Path::Pull(c));
        assert_eq!(p.path(1000, Some((c, st)), 900, 101, 0), Path::Local(LocalWhy::Short));
        assert_eq!(p.path(1000, Some((c, st)), 0, 101, 0), Path::Prefill(c));
        // The prefill worker holds as much and is idle: the decode worker saves only the
        // transfer; with no transfer cost, a tie, which the prefill worker takes.
        let same = p.prefill(1000, (&[900], &[]), &on(&[st]), Instant::now(), |_| 0.0).expect("one");
        assert_eq!(p.path(1000, Some((same, st)), 900, 0, 512), Path::Local(LocalWhy::DecodeCache));
        let mut free = Placer::new(Policy::CacheAware, 1000.0, 0.0, 1e9);
        let same = free.prefill(1000, (&[900], &[]), &on(&[st]), Instant::now(), |_| 0.0).expect("one");
        assert_eq!(free.path(1000, Some((same, st)), 900, 0, 512), Path::Prefill(same));
        // The prefill worker holds more and is idle: it is sooner.
        let warm = p.prefill(1000, (&[990], &[]), &on(&[st]), Instant::now(), |_| 0.0).expect("one");
        assert_eq!(p.path(1000, Some((warm, st)), 500, 0, 512), Path::Prefill(warm));
        assert_eq!(p.path(1000, None, 0, 0, 512), Path::Local(LocalWhy::NoPrefill));
        // A whole prompt held still computes its last token.
        assert_eq!(p.path(1000, Some((c, st)), 1000, 2, 0), Path::Local(LocalWhy::Short));
    }
}
