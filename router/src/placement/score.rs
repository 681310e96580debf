//! The cache-aware score: every prefill worker's estimated time to first token, jittered
//! among near-ties, in passes over plain arrays that vectorize (a router with a thousand
//! workers scores each on every request).

use super::PrefillBoard;

/// The healthy worker with the least estimated TTFT × (1 + 1 % × `jitter(w)`), `jitter` in
/// [0, 1). In passes over the workers without allocation or dependent chains of compares (a
/// router with a thousand workers scores each on every request): the least estimate `m`
/// first; then the jittered scores, only for workers within 1 % of `m` — a worker estimated
/// above `m` × 1.01 cannot beat the best one's jittered score, which is below that.
/// `transfer`: the seconds to move the prompt's KV; `now`: nanoseconds from the placement
/// epoch; `pending`: the prompt tokens this router has pending on a few slots, one entry a
/// slot (a worker's queue scores as the larger of that and what it reported).
pub(super) fn least_jittered(
    (len, transfer): (usize, f64),
    (cached, pending): (&[usize], &[(usize, f64)]),
    board: &PrefillBoard,
    now: f64,
    default_rate: f64,
    jitter: &mut impl FnMut(usize) -> f64,
) -> Option<usize> {
    let (default_spt, len_f) = (1.0 / default_rate, len as f64);
    let (ready, reported, spt) = board.numbers();
    thread_local! {
        /// The estimates of the last request placed on this thread, reused.
        static ESTIMATES: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
        /// The queues as scored when some are pending, reused.
        static QUEUES: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    QUEUES.with_borrow_mut(|queues| {
        ESTIMATES.with_borrow_mut(|est| {
            let queued = if pending.is_empty() {
                reported
            } else {
                queues.clear();
                queues.extend_from_slice(reported);
                for &(w, p) in pending {
                    if let Some(q) = queues.get_mut(w) {
                        *q = q.max(p);
                    }
                }
                &queues[..]
            };
            est.clear();
            est.resize(ready.len(), 0.0);
            let numbers = Board { ready, queued, spt, cached };
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: this CPU has AVX2 (checked just above).
                return unsafe { passes_avx2(est, numbers, (len_f, transfer, default_spt, now), jitter) };
            }
            passes(est, numbers, (len_f, transfer, default_spt, now), jitter)
        })
    })
}

/// The numbers placement scores, one slice each ([`PrefillBoard::numbers`], and what each
/// worker holds of the prompt).
struct Board<'a> {
    ready: &'a [f64],
    queued: &'a [f64],
    spt: &'a [f64],
    cached: &'a [usize],
}

/// [`passes`] compiled for AVX2: four workers at a time where the baseline x86-64 target
/// does two (the same operations, none fused: the same answers).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn passes_avx2(
    est: &mut [f64],
    b: Board<'_>,
    request: (f64, f64, f64, f64),
    jitter: &mut impl FnMut(usize) -> f64,
) -> Option<usize> {
    passes(est, b, request, jitter)
}

/// [`least_jittered`]'s passes over the workers, `est` their room; `request`: the prompt's
/// tokens, its transfer seconds, the default seconds per token and now.
#[inline(always)]
fn passes(
    est: &mut [f64],
    Board { ready, queued, spt, cached }: Board<'_>,
    (len_f, transfer, default_spt, now): (f64, f64, f64, f64),
    jitter: &mut impl FnMut(usize) -> f64,
) -> Option<usize> {
    // Equal slices, indexed: no bounds checks, and the loop vectorizes.
    let n = cached.len().min(ready.len());
    let (e, r, q, s, c) = (&mut est[..n], &ready[..n], &queued[..n], &spt[..n], &cached[..n]);
    for i in 0..n {
        e[i] =
            estimate(Numbers { ready: r[i], queued: q[i], spt: s[i], held: c[i] }, len_f, transfer, default_spt, now);
    }
    let m = ready.len();
    let (e, r, q, s) = (&mut est[n..m], &ready[n..m], &queued[n..m], &spt[n..m]);
    for i in 0..m - n {
        e[i] = estimate(Numbers { ready: r[i], queued: q[i], spt: s[i], held: 0 }, len_f, transfer, default_spt, now);
    }
    let least = least(est);
    if least == f64::INFINITY {
        return None;
    }
    // The near-ties' jittered scores in place, the rest out of the running (no branch: the
    // loop vectorizes); then the least score, the first worker among equals.
    let within = least * 1.01;
    for (w, t) in est.iter_mut().enumerate() {
        let j = *t * (1.0 + 0.01 * jitter(w));
        *t = if *t <= within { j } else { f64::INFINITY };
    }
    first_least(est)
}

/// One worker's placement numbers ([`PrefillBoard`]) and the tokens of the prompt it holds.
struct Numbers {
    ready: f64,
    queued: f64,
    spt: f64,
    held: usize,
}

/// A worker's estimated time to first token for a prompt of `len` tokens (`transfer`: the
/// seconds to move its KV) at `now` (nanoseconds from the placement epoch); infinite when it
/// is not healthy then. Multiplications only and selects, no branch: it runs for a thousand
/// workers, two at a time. (A token count becomes an `f64` by the exponent trick, which
/// vectorizes where `as f64` of an integer does not: counts are far below 2^52.) Its inputs by
/// value: read through a closure's captures, they were reloaded on every iteration (the
/// estimates' store might have changed them) and the loop stayed scalar.
#[inline(always)]
fn estimate(w: Numbers, len: f64, transfer: f64, default_spt: f64, now: f64) -> f64 {
    const TWO_52: f64 = 4_503_599_627_370_496.0;
    let held = f64::from_bits((w.held as u64 & ((1 << 52) - 1)) | TWO_52.to_bits()) - TWO_52;
    // Selects by masks: written as `if`, the compiler kept a branch and the loop scalar.
    let pick = |yes: bool, a: f64, b: f64| {
        f64::from_bits(
            (a.to_bits() & 0u64.wrapping_sub(u64::from(yes))) | (b.to_bits() & u64::from(yes).wrapping_sub(1)),
        )
    };
    let spt = pick(w.spt > 0.0, w.spt, default_spt);
    let lack = len - held;
    let t = (w.queued + pick(lack > 0.0, lack, 0.0)) * spt + transfer;
    pick(now >= w.ready, t, f64::INFINITY)
}

/// The least value of `v` (infinite when empty), in four running minimums: no chain of
/// dependent compares over a thousand workers (the loop vectorizes).
#[inline(always)]
fn least(v: &[f64]) -> f64 {
    let mut lanes = [f64::INFINITY; 4];
    let quads = v.chunks_exact(4);
    for &t in quads.remainder() {
        lanes[0] = if t < lanes[0] { t } else { lanes[0] };
    }
    for q in quads {
        for (l, &t) in lanes.iter_mut().zip(q) {
            *l = if t < *l { t } else { *l };
        }
    }
    lanes.into_iter().fold(f64::INFINITY, |a, b| if b < a { b } else { a })
}

/// The index of the least value of `v` (the first among equals); None when every value is
/// infinite. Two passes that vectorize — the least, then where it first is — rather than one
/// carrying an index with every compare.
#[inline(always)]
pub(super) fn first_least(v: &[f64]) -> Option<usize> {
    let m = least(v);
    if m < f64::INFINITY { v.iter().position(|&t| t == m) } else { None }
}

/// The jitter a router draws for one request: a number in [0, 1) for each worker, from one
/// random `seed` (a multiplicative hash of the seed and the worker's slot: a few cycles, as it
/// may run for every one of a thousand workers when they tie).
pub fn jitter(seed: u32) -> impl Fn(usize) -> f64 {
    // 24 bits, converted as a signed number: that converts two or four at a time.
    move |w| f64::from(((seed ^ w as u32).wrapping_mul(0x9E37_79B1) >> 8) as i32) / f64::from(1u32 << 24)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The passes compiled for AVX2 and for the baseline target choose alike (this machine
    /// runs the AVX2 ones in every other test; a CPU without it runs the baseline).
    #[test]
    fn both_compilations_choose_alike() {
        let mut next = crate::testing::rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..500 {
            let m = 1 + next(300) as usize;
            let ready: Vec<f64> = (0..m).map(|_| if next(5) == 0 { f64::INFINITY } else { next(3) as f64 }).collect();
            let queued: Vec<f64> = (0..m).map(|_| (next(4) * 100) as f64).collect();
            let spt: Vec<f64> = (0..m).map(|_| next(3) as f64 * 1e-3).collect();
            let cached: Vec<usize> = (0..next(m as u64 + 1)).map(|_| next(3) as usize * 64).collect();
            let request = (256.0, 1e-3, 1e-3, 1.0);
            let seed = next(1 << 32) as u32;
            let board = || Board { ready: &ready, queued: &queued, spt: &spt, cached: &cached };
            // Each pass writes every score: a room of NaNs shows one it left.
            let mut est = vec![f64::NAN; m];
            let base = passes(&mut est, board(), request, &mut jitter(seed));
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let base_est = bits(&est);
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                est.fill(f64::NAN);
                // SAFETY: this CPU has AVX2 (checked just above).
                let wide = unsafe { passes_avx2(&mut est, board(), request, &mut jitter(seed)) };
                assert_eq!(wide, base);
                assert_eq!(bits(&est), base_est, "the same scores, bit for bit");
            } else {
                eprintln!("no AVX2 on this CPU: the baseline passes only");
            }
            // And the scalar reading of the rule.
            let score = |w: usize| {
                let s = if spt[w] > 0.0 { spt[w] } else { 1e-3 };
                let held = cached.get(w).copied().unwrap_or(0) as f64;
                let t = (queued[w] + (256.0 - held).max(0.0)) * s + 1e-3;
                if 1.0 >= ready[w] { t } else { f64::INFINITY }
            };
            let least = (0..m).map(score).fold(f64::INFINITY, f64::min);
            let want = (least < f64::INFINITY).then(|| {
                let j = |w: usize| {
                    let t = score(w);
                    if t <= least * 1.01 { t * (1.0 + 0.01 * jitter(seed)(w)) } else { f64::INFINITY }
                };
                let best = (0..m).map(j).fold(f64::INFINITY, f64::min);
                (0..m).position(|w| j(w) == best).expect("a least")
            });
            assert_eq!(base, want);
        }
    }
}
