//! Choosing the next token from logits.
//!
//! Order: repetition penalty (over prompt and output), frequency and presence penalties
//! (over output), then the request's logit bias; the reported logprobs are the log-softmax
//! of these logits; then
//! greedy argmax at temperature 0, else temperature, top-k, top-p, min-p and a draw from the
//! request's own seeded random stream. A request with an output constraint ([`Guide`]) has
//! the tokens it forbids masked before any of this.

use rand::{Rng, SeedableRng, rngs::StdRng};

use ferry_tokenize::SamplingParams;

use crate::guide::Guide;

/// The chosen token and what was reported with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Its log probability under the (penalised) model distribution.
    pub logprob: f32,
    /// The most likely tokens with their log probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// One request's sampler: its parameters, random stream and token counts.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Tokens of the prompt and output, for the repetition penalty.
    seen: std::collections::HashSet<u32>,
    /// Output token counts, for frequency / presence penalties.
    counts: std::collections::HashMap<u32, u32>,
    /// The output constraint, if the request has one.
    guide: Option<Box<Guide>>,
    /// A resumed request's output so far ([`SamplingParams::resumed`]), which the output
    /// constraint, once given ([`guided`](Self::guided)), must have seen.
    resumed: Vec<u32>,
}

impl Sampler {
    /// A sampler for one request whose prompt is `prompt`. A resumed request's (its last
    /// [`SamplingParams::resumed`] prompt tokens are its own output) is where the sampler of
    /// the undisturbed run stood after that output: each token counted as output and, above
    /// temperature 0, one draw of the random stream taken for each.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        let seen = if params.repetition_penalty != 1.0 { prompt.iter().copied().collect() } else { Default::default() };
        let output = &prompt[prompt.len() - (params.resumed as usize).min(prompt.len())..];
        let mut s = Self {
            params,
            rng: StdRng::seed_from_u64(seed),
            seen,
            counts: Default::default(),
            guide: None,
            resumed: output.to_vec(),
        };
        for &t in output {
            s.observe(t);
        }
        s
    }

    /// The same, with its output constrained by `guide` (which a resumed request's output so
    /// far advances).
    pub fn guided(mut self, guide: Option<Guide>) -> Self {
        self.guide = guide.map(Box::new);
        if let Some(g) = &mut self.guide {
            for t in std::mem::take(&mut self.resumed) {
                g.advance(t);
            }
        }
        self
    }

    /// Takes the guide out (to [`Guide::prepare`] its mask on another thread while the
    /// forward pass runs); [`put_guide`](Self::put_guide) gives it back.
    pub fn take_guide(&mut self) -> Option<Box<Guide>> {
        self.guide.take()
    }

    /// Gives back what [`take_guide`](Self::take_guide) took.
    pub fn put_guide(&mut self, guide: Option<Box<Guide>>) {
        self.guide = guide;
    }

    /// The tokens the output constraint forces next (at most `max`; see [`Guide::jump`]),
    /// recorded as output as if sampled: penalties count them and, above temperature 0, the
    /// random stream moves one draw for each, as the masked draw that would have picked it
    /// does (so a token's draw is the same whether it was forced or drawn, and a resumed
    /// request, which knows only how many tokens came before it, stands where they left the
    /// stream). Empty without a constraint.
    pub fn jump(&mut self, max: usize) -> Vec<u32> {
        let Some(g) = &mut self.guide else { return Vec::new() };
        let forced = g.jump(max);
        for &t in &forced {
            if self.params.temperature != 0.0 {
                let _: f32 = self.rng.random();
            }
            if self.params.repetition_penalty != 1.0 {
                self.seen.insert(t);
            }
            *self.counts.entry(t).or_default() += 1;
        }
        forced
    }

    /// Whether the output constraint is complete (nothing may follow): the request ends.
    pub fn complete(&self) -> bool {
        self.guide.as_ref().is_some_and(|g| g.complete())
    }

    /// Why the output constraint failed, if it did.
    pub fn guide_error(&self) -> Option<&str> {
        self.guide.as_ref().and_then(|g| g.error())
    }

    /// The request's parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (modified in place) and records it.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        if let Some(g) = &mut self.guide {
            g.apply(logits);
        }
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
                }
            }
        }
        // Last, as OpenAI's is added to the logits the draw sees. A masked token stays
        // masked: -inf plus any bias is -inf.
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        let lse = log_sum_exp(logits);
        let (greedy, n_top, track) = (p.temperature == 0.0, p.top_logprobs as usize, p.repetition_penalty != 1.0);
        let token = if greedy { argmax(logits) } else { self.draw(logits) };
        let logprob = logits[token as usize] - lse;
        let top = top_n(logits, n_top).into_iter().map(|(t, l)| (t, l - lse)).collect();
        if track {
            self.seen.insert(token);
        }
        *self.counts.entry(token).or_default() += 1;
        if let Some(g) = &mut self.guide {
            g.advance(token);
        }
        Sampled { token, logprob, top }
    }

    /// Whether this request's next token is the plain arg max of the logits (temperature 0,
    /// no penalty, no logit bias, no top logprobs asked): then a backend may pick it where the logits are
    /// ([`crate::Model::forward_greedy`]) and the sampler only [`observe`](Self::observe)s it.
    pub fn plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature == 0.0
            && p.repetition_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
            && p.top_logprobs == 0
            && p.logit_bias.is_empty()
            && self.guide.is_none()
    }

    /// Records `token` as the next output without sampling it, as if [`sample`](Self::sample)
    /// had chosen it: the decode node resumes a request whose first token the prefill node
    /// sampled, and must then draw exactly what a colocated run would.
    pub fn observe(&mut self, token: u32) {
        if self.params.temperature != 0.0 {
            let _: f32 = self.rng.random();
        }
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        *self.counts.entry(token).or_default() += 1;
        if let Some(g) = &mut self.guide {
            g.advance(token);
        }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let kept = candidates(&self.params, logits);
        pick(&kept, self.rng.random::<f32>())
    }
}

/// The candidate at fraction `u` ∈ [0, 1) of their total probability. Tokens of probability
/// 0 (masked, or underflowed) are never picked, not even by `u = 0`.
fn pick(kept: &[(u32, f32)], u: f32) -> u32 {
    let total: f32 = kept.iter().map(|c| c.1).sum();
    let mut r = u * total;
    for &(token, q) in kept {
        r -= q;
        if r <= 0.0 && q > 0.0 {
            return token;
        }
    }
    kept.iter().rev().find(|c| c.1 > 0.0).unwrap_or(&kept[0]).0
}

/// The tokens a draw at `params`' temperature may pick, with their probabilities (normalised
/// after top-k, before top-p and min-p): top-k, then the fewest most likely tokens whose mass
/// reaches top-p, then those at least min-p times as likely as the most likely. In O(vocab)
/// expected time (partial selection, no sort of the vocabulary); the order is deterministic
/// (a function of the logits), not sorted.
fn candidates(p: &SamplingParams, logits: &[f32]) -> Vec<(u32, f32)> {
    let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
    if p.top_k > 0 && (p.top_k as usize) < cand.len() {
        let k = p.top_k as usize;
        cand.select_nth_unstable_by(k - 1, likelier);
        cand.truncate(k);
    }
    let max = cand.iter().fold(f32::NEG_INFINITY, |a, c| a.max(c.1));
    cand.iter_mut().for_each(|c| c.1 = (c.1 - max).exp());
    let sum: f32 = cand.iter().map(|c| c.1).sum();
    cand.iter_mut().for_each(|c| c.1 /= sum);
    if p.top_p < 1.0 {
        let n = nucleus(&mut cand, p.top_p);
        cand.truncate(n);
    }
    if p.min_p > 0.0 {
        // At most the top's own probability: the most likely token always stays.
        let floor = cand.iter().fold(0.0f32, |a, c| a.max(c.1)) * p.min_p.min(1.0);
        cand.retain(|c| c.1 >= floor);
    }
    cand
}

/// Higher probability (or logit) first, then the lower token id.
fn likelier(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Reorders `items` (token, probability) so that its first `n` are the fewest most likely
/// whose mass reaches `target`, and returns `n` (all of them if rounding keeps the mass short
/// of it). Quickselect on mass: each round selects the likelier half of what is undecided and
/// keeps it whole or recurses into it, so the work halves each time: O(len) expected.
fn nucleus(items: &mut [(u32, f32)], target: f32) -> usize {
    // items[..lo] are kept and likelier than everything after; the answer is in lo + 1..=hi.
    let (mut lo, mut hi, mut need) = (0, items.len(), target);
    while hi - lo > 64 {
        let mid = lo + (hi - lo) / 2;
        items[lo..hi].select_nth_unstable_by(mid - lo, likelier);
        let upper: f32 = items[lo..=mid].iter().map(|c| c.1).sum();
        if upper >= need {
            hi = mid + 1;
        } else {
            need -= upper;
            lo = mid + 1;
        }
    }
    items[lo..hi].sort_unstable_by(likelier);
    let mut acc = 0.0;
    for (i, c) in items[lo..hi].iter().enumerate() {
        acc += c.1;
        if acc >= need {
            return lo + i + 1;
        }
    }
    hi
}

/// The logprob of `next` under the logits `row` (the model's distribution, no penalty), and
/// the `k` most likely tokens with theirs: one prompt position's report.
pub fn prompt_logprob(row: &[f32], next: u32, k: u32) -> Sampled {
    let lse = log_sum_exp(row);
    let logprob = row.get(next as usize).map_or(f32::NEG_INFINITY, |l| l - lse);
    let top = top_n(row, k as usize).into_iter().map(|(t, l)| (t, l - lse)).collect();
    Sampled { token: next, logprob, top }
}

/// Index of the largest value (the lowest index among equals).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    max + x.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
}

fn top_n(x: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut v: Vec<(u32, f32)> = x.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    let n = n.min(v.len());
    v.select_nth_unstable_by(n - 1, |a, b| b.1.total_cmp(&a.1));
    v.truncate(n);
    v.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams { seed: Some(7), ..Default::default() };
        f(&mut p);
        p
    }

    #[test]
    fn greedy_takes_argmax_and_reports_logprobs() {
        let mut s = Sampler::new(params(|p| p.top_logprobs = 2), &[]);
        let out = s.sample(&mut [0.0, 2.0, 1.0]);
        assert_eq!(out.token, 1);
        let lse = (1.0f32 + 2f32.exp() + 1f32.exp()).ln();
        assert!((out.logprob - (2.0 - lse)).abs() < 1e-6);
        assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn same_seed_same_draws_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 / 3.0).collect();
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p, &[]);
            (0..20).map(|_| s.sample(&mut logits.clone()).token).collect::<Vec<_>>()
        };
        let p = params(|p| p.temperature = 1.0);
        assert_eq!(draw(p.clone()), draw(p));
        let k1 = draw(params(|p| {
            p.temperature = 1.0;
            p.top_k = 1;
        }));
        assert!(k1.iter().all(|&t| t == argmax(&logits)));
        let tiny_p = draw(params(|p| {
            p.temperature = 1.0;
            p.top_p = 1e-6;
        }));
        assert!(tiny_p.iter().all(|&t| t == argmax(&logits)));
        let min_p = draw(params(|p| {
            p.temperature = 0.5;
            p.min_p = 1.0;
        }));
        assert!(min_p.iter().all(|&t| logits[t as usize] == logits[argmax(&logits) as usize]));
    }

    /// What the sampler did before partial selection: sort the whole vocabulary, cut top-k,
    /// normalise, cut the top-p prefix, then min-p. `candidates` must keep the same tokens
    /// with the same probabilities.
    fn sorted_reference(p: &SamplingParams, logits: &[f32]) -> Vec<(u32, f32)> {
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
        cand.sort_unstable_by(likelier);
        if p.top_k > 0 {
            cand.truncate(p.top_k as usize);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs.iter().position(|&q| {
                acc += q;
                acc >= p.top_p
            });
            probs.truncate(keep.map_or(probs.len(), |i| i + 1));
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
            probs.truncate(keep);
        }
        cand.iter().zip(probs).map(|(&(t, _), q)| (t, q)).collect()
    }

    #[test]
    fn partial_selection_keeps_what_a_full_sort_keeps() {
        let mut rng = StdRng::seed_from_u64(11);
        for trial in 0..400 {
            let vocab = rng.random_range(1..3000);
            let spread = [0.5f32, 3.0, 12.0][trial % 3];
            let logits: Vec<f32> = (0..vocab).map(|_| (rng.random::<f32>() - 0.5) * spread).collect();
            let p = params(|p| {
                p.temperature = [0.3, 1.0, 2.0][rng.random_range(0..3)];
                p.top_k = [0, 1, 5, 50, vocab as u32 + 3][rng.random_range(0..5)];
                p.top_p = [1.0, 0.95, 0.5, 0.01][rng.random_range(0..4)];
                p.min_p = [0.0, 0.05, 0.5][rng.random_range(0..3)];
            });
            let mut got = candidates(&p, &logits);
            let mut want = sorted_reference(&p, &logits);
            got.sort_by_key(|c| c.0);
            want.sort_by_key(|c| c.0);
            let ids = |v: &[(u32, f32)]| v.iter().map(|c| c.0).collect::<Vec<_>>();
            assert_eq!(ids(&got), ids(&want), "trial {trial}: vocab {vocab}, {p:?}");
            for (g, w) in got.iter().zip(&want) {
                assert!((g.1 - w.1).abs() <= 1e-6 + 1e-4 * w.1, "trial {trial}: token {} p {} vs {}", g.0, g.1, w.1);
            }
        }
    }

    #[test]
    fn a_zero_probability_token_is_never_drawn() {
        // Token 0 masked (a constraint's −∞) and first in line: neither the lowest random
        // number nor rounding past the end picks it.
        let kept = candidates(&params(|p| p.temperature = 1.0), &[f32::NEG_INFINITY, 0.0, 0.0, f32::NEG_INFINITY]);
        assert_eq!(kept.len(), 4);
        assert_eq!(pick(&kept, 0.0), 1);
        assert_eq!(pick(&kept, 0.999_999_9), 2);
        assert_eq!(pick(&kept, 2.0), 2);
        assert!(
            candidates(
                &params(|p| {
                    p.temperature = 1.0;
                    p.min_p = 3.0
                }),
                &[1.0, 0.0]
            )
            .iter()
            .any(|c| c.0 == 0)
        );
    }

    #[test]
    fn logit_bias_bans_and_forces_tokens_and_leaves_masks_alone() {
        let mut s = Sampler::new(params(|p| p.logit_bias = vec![(0, -100.0)]), &[]);
        assert!(!s.plain_greedy(), "a backend's own argmax would skip the bias");
        assert_eq!(s.sample(&mut [2.0, 1.0, 0.5]).token, 1, "banned");
        let mut s = Sampler::new(params(|p| p.logit_bias = vec![(2, 5.0)]), &[]);
        let out = s.sample(&mut [2.0, 1.0, 0.5]);
        assert_eq!(out.token, 2, "forced");
        let lse = (2f32.exp() + 1f32.exp() + 5.5f32.exp()).ln();
        assert!((out.logprob - (5.5 - lse)).abs() < 1e-5, "the logprob is of the biased logits");
        let mut s = Sampler::new(params(|p| p.logit_bias = vec![(1, 100.0)]), &[]);
        assert_eq!(s.sample(&mut [2.0, f32::NEG_INFINITY, 0.5]).token, 0, "a masked token stays masked");
    }

    #[test]
    fn penalties_change_the_choice() {
        let mut s = Sampler::new(params(|p| p.repetition_penalty = 4.0), &[0]);
        assert_eq!(s.sample(&mut [2.0, 1.0]).token, 1);
        let mut s = Sampler::new(params(|p| p.presence_penalty = 2.0), &[]);
        assert_eq!(s.sample(&mut [2.0, 1.5]).token, 0);
        assert_eq!(s.sample(&mut [2.0, 1.5]).token, 1);
        let mut s = Sampler::new(params(|p| p.frequency_penalty = 0.4), &[]);
        let picks: Vec<u32> = (0..3).map(|_| s.sample(&mut [2.0, 1.5]).token).collect();
        assert_eq!(picks, vec![0, 0, 1]);
    }

    #[test]
    fn observing_the_first_token_resumes_the_same_stream() {
        let logits: Vec<f32> = (0..40).map(|i| ((i * 31) % 11) as f32 / 2.0).collect();
        let p = params(|p| {
            p.temperature = 0.8;
            p.frequency_penalty = 0.3;
        });
        let mut whole = Sampler::new(p.clone(), &[1, 2]);
        let all: Vec<u32> = (0..10).map(|_| whole.sample(&mut logits.clone()).token).collect();
        // Another node sampled the first token; this one observes it and goes on.
        let mut resumed = Sampler::new(p, &[1, 2]);
        resumed.observe(all[0]);
        let rest: Vec<u32> = (1..10).map(|_| resumed.sample(&mut logits.clone()).token).collect();
        assert_eq!(rest, all[1..]);
    }

    /// Migration: a request whose first k output tokens come as the tail of its prompt
    /// (`resumed` = k) samples what the undisturbed run sampled after them, penalties and
    /// random stream included; with `resumed` = 0 the same prompt is a fresh request, which
    /// does not.
    #[test]
    fn a_resumed_request_samples_what_the_undisturbed_run_did() {
        let logits: Vec<f32> = (0..40).map(|i| ((i * 31) % 11) as f32 / 2.0).collect();
        let p = params(|p| {
            p.temperature = 0.9;
            p.frequency_penalty = 0.5;
            p.repetition_penalty = 1.2;
        });
        let mut whole = Sampler::new(p.clone(), &[1, 2]);
        let all: Vec<u32> = (0..16).map(|_| whole.sample(&mut logits.clone()).token).collect();
        for k in [1usize, 5, 11] {
            let context: Vec<u32> = [1, 2].iter().chain(&all[..k]).copied().collect();
            let mut moved = Sampler::new(SamplingParams { resumed: k as u32, ..p.clone() }, &context);
            let rest: Vec<u32> = (k..16).map(|_| moved.sample(&mut logits.clone()).token).collect();
            assert_eq!(rest, all[k..], "resumed after {k} tokens");
        }
        let context: Vec<u32> = [1, 2].iter().chain(&all[..5]).copied().collect();
        let mut fresh = Sampler::new(p, &context);
        let rest: Vec<u32> = (5..16).map(|_| fresh.sample(&mut logits.clone()).token).collect();
        assert_ne!(rest, all[5..], "a fresh request starts its random stream over");
    }
}
