//! What a run measured: latency percentiles, throughput, goodput under SLOs, prefix-cache
//! hits, a per-second timeline; printed as a table or written as JSON.

use std::collections::BTreeMap;

use serde::Serialize;

use super::client::Sample;

/// Latency objectives a request must meet to count towards goodput (None: not checked).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Slo {
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Mean inter-token latency of the request, ms.
    pub itl_ms: Option<f64>,
    /// End to end, ms.
    pub e2e_ms: Option<f64>,
}

/// A distribution, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Dist {
    /// Values.
    pub count: usize,
    /// Mean.
    pub mean: f64,
    /// Smallest.
    pub min: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// Nearest-rank percentile of sorted `v`.
fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

impl Dist {
    /// The distribution of `v` (seconds), in ms.
    pub fn of(v: &[f64]) -> Self {
        let mut ms: Vec<f64> = v.iter().map(|x| x * 1000.0).collect();
        ms.sort_by(f64::total_cmp);
        if ms.is_empty() {
            return Self::default();
        }
        Self {
            count: ms.len(),
            mean: ms.iter().sum::<f64>() / ms.len() as f64,
            min: ms[0],
            p50: pct(&ms, 50.0),
            p90: pct(&ms, 90.0),
            p99: pct(&ms, 99.0),
            max: ms[ms.len() - 1],
        }
    }
}

/// Goodput: completed requests meeting every SLO.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Goodput {
    /// The objectives.
    pub slo: Slo,
    /// Requests that met them.
    pub requests: usize,
    /// Per second of the run.
    pub requests_per_s: f64,
    /// Of the completed requests.
    pub fraction: f64,
}

/// Prompt tokens found cached.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Cache {
    /// Prompt tokens of completed requests.
    pub prompt_tokens: u64,
    /// Of those, found in a prefill cache.
    pub cached_tokens: u64,
    /// cached / prompt.
    pub hit_rate: f64,
}

/// One phase of the requests' time ([`ferry_cluster::phases::BREAKDOWN`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Phase {
    /// Its name.
    pub phase: String,
    /// Its time per request, ms.
    pub ms: Dist,
    /// Its share of the phases' total.
    pub share: f64,
}

/// Where the completed requests' time went, as the router reported it per request.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Phases {
    /// Completed requests that reported their phases.
    pub requests: usize,
    /// Each phase, in order.
    pub phases: Vec<Phase>,
    /// The phases' mean sum over the mean end-to-end latency the client measured, for the
    /// same requests (1.0: the phases account for all of it; the rest is the client's
    /// connection and the HTTP or gRPC framing).
    pub sum_over_e2e: f64,
}

impl Phases {
    fn of(ok: &[&Sample]) -> Self {
        let with: Vec<&Sample> = ok.iter().copied().filter(|s| !s.phases.is_empty()).collect();
        if with.is_empty() {
            return Self::default();
        }
        let of = |s: &Sample, name: &str| s.phases.iter().filter(|(p, _)| p == name).map(|(_, t)| t).sum::<f64>();
        let total: f64 = with.iter().flat_map(|s| s.phases.iter().map(|(_, t)| t)).sum();
        let e2e: f64 = with.iter().map(|s| s.end - s.start).sum();
        let phases = ferry_cluster::phases::BREAKDOWN
            .iter()
            .map(|name| {
                let v: Vec<f64> = with.iter().map(|s| of(s, name)).collect();
                let share = if total > 0.0 { v.iter().sum::<f64>() / total } else { 0.0 };
                Phase { phase: name.to_string(), ms: Dist::of(&v), share }
            })
            .collect();
        Self { requests: with.len(), phases, sum_over_e2e: if e2e > 0.0 { total / e2e } else { 0.0 } }
    }
}

/// One second of the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Bucket {
    /// Seconds since the start (the bucket's start).
    pub t: f64,
    /// Requests that completed in it.
    pub completed: usize,
    /// Output tokens that arrived in it.
    pub output_tokens: usize,
}

/// A whole run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Workload name.
    pub workload: String,
    /// The endpoint.
    pub endpoint: String,
    /// "closed loop, concurrency N" / "open loop, R req/s" / "trace replay".
    pub mode: String,
    /// From the first send to the last end, s.
    pub duration_s: f64,
    /// Requests sent.
    pub sent: usize,
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Trace requests cut to fit the length limits.
    pub cut_to_fit: usize,
    /// Time to first token.
    pub ttft_ms: Dist,
    /// Gaps between consecutive output tokens.
    pub itl_ms: Dist,
    /// End to end.
    pub e2e_ms: Dist,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Prompt + output tokens per second.
    pub total_tokens_per_s: f64,
    /// Under the SLOs.
    pub goodput: Goodput,
    /// Prefix cache hits.
    pub prefix_cache: Cache,
    /// Per second.
    pub timeline: Vec<Bucket>,
    /// Failures by message.
    pub errors: BTreeMap<String, usize>,
    /// Where the requests' time went.
    pub phases: Phases,
    /// A `multi-turn` run by turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turns: Option<super::turns::Turns>,
}

impl Report {
    /// Summarises `samples`.
    pub fn new(samples: &[Sample], slo: Slo) -> Self {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
        let t0 = samples.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
        let t1 = samples.iter().map(|s| s.end).fold(f64::NEG_INFINITY, f64::max);
        let duration = if samples.is_empty() { 0.0 } else { (t1 - t0).max(1e-9) };
        let ttft: Vec<f64> = ok.iter().filter_map(|s| s.token_times.first().map(|t| t - s.start)).collect();
        let itl: Vec<f64> = ok.iter().flat_map(|s| s.token_times.windows(2).map(|w| w[1] - w[0])).collect();
        let e2e: Vec<f64> = ok.iter().map(|s| s.end - s.start).collect();
        let meets = |s: &Sample| {
            let ttft = s.token_times.first().map_or(f64::INFINITY, |t| t - s.start) * 1000.0;
            let n = s.token_times.len();
            let itl = if n > 1 { (s.token_times[n - 1] - s.token_times[0]) / (n - 1) as f64 * 1000.0 } else { 0.0 };
            let e2e = (s.end - s.start) * 1000.0;
            slo.ttft_ms.is_none_or(|m| ttft <= m)
                && slo.itl_ms.is_none_or(|m| itl <= m)
                && slo.e2e_ms.is_none_or(|m| e2e <= m)
        };
        let good = ok.iter().filter(|s| meets(s)).count();
        let out_tokens: u64 = ok.iter().map(|s| u64::from(s.completion_tokens)).sum();
        let prompt_tokens: u64 = ok.iter().map(|s| u64::from(s.prompt_tokens)).sum();
        let cached: u64 = ok.iter().map(|s| u64::from(s.cached_tokens)).sum();
        let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
        let mut errors = BTreeMap::new();
        for s in samples {
            if let Some(e) = &s.error {
                *errors.entry(e.clone()).or_insert(0) += 1;
            }
        }
        let mut timeline: Vec<Bucket> = Vec::new();
        if duration > 0.0 {
            let n = duration.ceil() as usize;
            timeline = (0..n.max(1)).map(|i| Bucket { t: i as f64, ..Bucket::default() }).collect();
            let last = timeline.len() - 1;
            let slot = |t: f64| (((t - t0).max(0.0)) as usize).min(last);
            for s in &ok {
                let b = slot(s.end);
                timeline[b].completed += 1;
                for &t in &s.token_times {
                    let b = slot(t);
                    timeline[b].output_tokens += 1;
                }
            }
        }
        Self {
            duration_s: duration,
            sent: samples.len(),
            completed: ok.len(),
            failed: samples.len() - ok.len(),
            ttft_ms: Dist::of(&ttft),
            itl_ms: Dist::of(&itl),
            e2e_ms: Dist::of(&e2e),
            requests_per_s: per_s(ok.len() as f64),
            output_tokens_per_s: per_s(out_tokens as f64),
            total_tokens_per_s: per_s((out_tokens + prompt_tokens) as f64),
            goodput: Goodput {
                slo,
                requests: good,
                requests_per_s: per_s(good as f64),
                fraction: if ok.is_empty() { 0.0 } else { good as f64 / ok.len() as f64 },
            },
            prefix_cache: Cache {
                prompt_tokens,
                cached_tokens: cached,
                hit_rate: if prompt_tokens == 0 { 0.0 } else { cached as f64 / prompt_tokens as f64 },
            },
            timeline,
            errors,
            phases: Phases::of(&ok),
            turns: super::turns::Turns::of(&ok),
            ..Self::default()
        }
    }

    /// The report as a text table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "ferry bench: {} against {} ({})\n  requests: {} sent, {} completed, {} failed in {:.1} s",
            self.workload, self.endpoint, self.mode, self.sent, self.completed, self.failed, self.duration_s
        );
        if self.cut_to_fit > 0 {
            s += &format!(" ({} trace requests cut to fit)", self.cut_to_fit);
        }
        s += &format!("\n  {:<14}{:>10}{:>10}{:>10}{:>10}{:>10}\n", "latency (ms)", "mean", "p50", "p90", "p99", "max");
        for (name, d) in [("TTFT", &self.ttft_ms), ("inter-token", &self.itl_ms), ("end-to-end", &self.e2e_ms)] {
            s += &format!("  {name:<14}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}\n", d.mean, d.p50, d.p90, d.p99, d.max);
        }
        s += &format!(
            "  throughput: {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s\n",
            self.requests_per_s, self.output_tokens_per_s, self.total_tokens_per_s
        );
        let g = &self.goodput;
        let slo = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x} ms"));
        s += &format!(
            "  goodput: {:.2} req/s ({:.0} % of completed) under TTFT {} / ITL {} / E2E {}\n",
            g.requests_per_s,
            g.fraction * 100.0,
            slo(g.slo.ttft_ms),
            slo(g.slo.itl_ms),
            slo(g.slo.e2e_ms)
        );
        s += &format!(
            "  prefix cache: {} of {} prompt tokens cached ({:.1} %)\n",
            self.prefix_cache.cached_tokens,
            self.prefix_cache.prompt_tokens,
            self.prefix_cache.hit_rate * 100.0
        );
        if let Some(t) = &self.turns {
            s += &t.table();
        }
        let p = &self.phases;
        if p.requests > 0 {
            s += &format!(
                "  where the time went ({} requests; phases sum to {:.1} % of end-to-end):\n",
                p.requests,
                p.sum_over_e2e * 100.0
            );
            s += &format!("  {:<18}{:>10}{:>10}{:>10}{:>8}\n", "phase (ms)", "mean", "p50", "p99", "share");
            for ph in p.phases.iter().filter(|ph| ph.ms.max > 0.0) {
                let d = &ph.ms;
                s += &format!(
                    "  {:<18}{:>10.1}{:>10.1}{:>10.1}{:>7.1}%\n",
                    ph.phase,
                    d.mean,
                    d.p50,
                    d.p99,
                    ph.share * 100.0
                );
            }
        }
        for (e, n) in &self.errors {
            s += &format!("  error ×{n}: {e}\n");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(start: f64, tokens: &[f64], end: f64, error: bool) -> Sample {
        Sample {
            start,
            token_times: tokens.to_vec(),
            end,
            prompt_tokens: 10,
            completion_tokens: tokens.len() as u32,
            cached_tokens: 4,
            error: error.then(|| "boom".to_string()),
            ..Sample::default()
        }
    }

    #[test]
    fn figures_add_up() {
        let s = vec![
            sample(0.0, &[0.1, 0.2, 0.3], 0.35, false),
            sample(0.5, &[1.0, 1.5], 1.6, false),
            sample(1.0, &[], 1.2, true),
        ];
        let r = Report::new(&s, Slo { ttft_ms: Some(200.0), ..Slo::default() });
        assert_eq!((r.sent, r.completed, r.failed), (3, 2, 1));
        assert_eq!(r.ttft_ms.count, 2);
        assert!((r.ttft_ms.min - 100.0).abs() < 1e-9 && (r.ttft_ms.max - 500.0).abs() < 1e-9);
        assert_eq!(r.itl_ms.count, 3);
        assert!((r.duration_s - 1.6).abs() < 1e-9);
        assert_eq!(r.goodput.requests, 1, "only the first meets a 200 ms TTFT");
        assert!((r.prefix_cache.hit_rate - 0.4).abs() < 1e-9);
        assert_eq!(r.timeline.iter().map(|b| b.output_tokens).sum::<usize>(), 5);
        assert_eq!(r.timeline.iter().map(|b| b.completed).sum::<usize>(), 2);
        assert_eq!(r.errors.get("boom"), Some(&1));
        assert!(r.table().contains("2 completed"));
        assert_eq!(r.phases, Phases::default(), "no request reported phases");
        let d = Dist::of(&[0.004, 0.001, 0.003, 0.002]);
        assert_eq!((d.p50, d.p90, d.p99), (2.0, 4.0, 4.0));
    }

    #[test]
    fn phases_are_summed_per_request_and_compared_with_end_to_end() {
        let mut a = sample(0.0, &[0.5], 1.0, false);
        a.phases = vec![("queue".into(), 0.1), ("prefill_compute".into(), 0.4), ("decode".into(), 0.4)];
        let mut b = sample(0.0, &[0.5], 2.0, false);
        b.phases = vec![("queue".into(), 0.3), ("prefill_compute".into(), 0.6), ("decode".into(), 0.9)];
        let r = Report::new(&[a, b, sample(0.0, &[0.1], 0.2, false)], Slo::default());
        let p = &r.phases;
        assert_eq!(p.requests, 2, "the request without phases is left out");
        assert!((p.sum_over_e2e - 2.7 / 3.0).abs() < 1e-9, "{p:?}");
        let get = |n: &str| p.phases.iter().find(|x| x.phase == n).expect("the phase");
        assert!((get("queue").ms.mean - 200.0).abs() < 1e-9 && (get("decode").share - 1.3 / 2.7).abs() < 1e-9);
        assert_eq!(get("transfer").ms.max, 0.0);
        assert!(r.table().contains("phases sum to 90.0 % of end-to-end"), "{}", r.table());
    }
}
