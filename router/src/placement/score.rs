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
/// epoch.
pub(super) fn least_jittered(
    (len, transfer): (usize, f64),
    cached: &[usize],
    board: &PrefillBoard,
    now: f64,
    default_rate: f64,
    jitter: &mut impl FnMut(usize) -> f64,
) -> Option<usize> {
    let (default_spt, len_f) = (1.0 / default_rate, len as f64);
    let (ready, queued, spt) = board.numbers();
    thread_local! {
        /// The estimates of the last request placed on this thread, reused.
        static ESTIMATES: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    ESTIMATES.with_borrow_mut(|est| {
        est.clear();
        est.resize(ready.len(), 0.0);
        // Equal slices, indexed: no bounds checks, and the loop vectorizes.
        let n = cached.len().min(ready.len());
        let (e, r, q, s, c) = (&mut est[..n], &ready[..n], &queued[..n], &spt[..n], &cached[..n]);
        for i in 0..n {
            e[i] = estimate(
                Numbers { ready: r[i], queued: q[i], spt: s[i], held: c[i] },
                len_f,
                transfer,
                default_spt,
                now,
            );
        }
        let m = ready.len();
        let (e, r, q, s) = (&mut est[n..m], &ready[n..m], &queued[n..m], &spt[n..m]);
        for i in 0..m - n {
            e[i] =
                estimate(Numbers { ready: r[i], queued: q[i], spt: s[i], held: 0 }, len_f, transfer, default_spt, now);
        }
        let least = least(est);
        if least == f64::INFINITY {
            return None;
        }
        // The near-ties' jittered scores in place, the rest out of the running (no branch:
        // the loop vectorizes); then the least score, the first worker among equals.
        let within = least * 1.01;
        for (w, t) in est.iter_mut().enumerate() {
            let j = *t * (1.0 + 0.01 * jitter(w));
            *t = if *t <= within { j } else { f64::INFINITY };
        }
        first_least(est)
    })
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
pub(super) fn first_least(v: &[f64]) -> Option<usize> {
    let m = least(v);
    if m < f64::INFINITY { v.iter().position(|&t| t == m) } else { None }
}

/// The jitter a router draws for one request: a number in [0, 1) for each worker, from one
/// random `seed` (a multiplicative hash of the seed and the worker's slot: a few cycles, as it
/// may run for every one of a thousand workers when they tie).
pub fn jitter(seed: u32) -> impl Fn(usize) -> f64 {
    move |w| f64::from((seed ^ w as u32).wrapping_mul(0x9E37_79B1) >> 8) / f64::from(1u32 << 24)
}
