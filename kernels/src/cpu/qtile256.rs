//! The [`qtile`](super::qtile) products with AVX2 (CPUs without AVX-512 VNNI: AMD Zen 1–3,
//! Intel client cores). Exact mode: [`exact_half`]. Fast mode: a group's 16 weight rows
//! taken as two halves of 8, each chunk of a half (8 rows × 4 values) multiplied by 4
//! activation values broadcast to every lane (`vpmaddubsw`, weights as unsigned bytes), the
//! block's 8 products summed in 16 bits (Q4: at most 8·2·15·127 = 30,480, exact) and once to
//! 32 (`vpmaddwd`); Q8_0's signed weights as `|w|` against `x` with `w`'s sign, summed to 32
//! bits at every step. Lane `c` then holds row `c`'s exact integer sum, scaled as
//! [`qtile`](super::qtile)'s portable kernel does lane by lane, so the cells are its bits.

use std::arch::x86_64::*;

use super::qdot::Prep;
use super::qtile::offset_parts;
use super::tiled::{LANES, Tiled, TiledRef};
use crate::quant::{BLOCK, BlockFormat};

/// Activation rows per pass over a half group's blocks.
const ACTS: usize = 4;

/// Rows in half a group: the lanes of a 256-bit vector of i32 or f32.
const HALF: usize = 8;

/// Lane `c` of each of `A` vectors: `Σ_j q_j·x_j` over row `8h + c`'s block at `at` (a group's
/// block) and the block's 32 activation bytes of row `a`, `x[a]`.
///
/// # Safety
/// AVX2; `at` points at a group's block of `fmt`, `x[a]` at 32 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_sums<const A: usize>(fmt: BlockFormat, at: *const u8, h: usize, x: [*const i8; A]) -> [__m256i; A] {
    let ones = _mm256_set1_epi16(1);
    // SAFETY (the loads): quads of the block's activations and chunks of the group's block
    // (the caller's promise).
    let quad = |a: usize, p: usize| unsafe { _mm256_set1_epi32(x[a].add(4 * p).cast::<i32>().read_unaligned()) };
    match fmt {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            let mask = _mm256_set1_epi8(0x0F);
            let mut s = [_mm256_setzero_si256(); A];
            for p in 0..4 {
                let raw = unsafe { _mm256_loadu_si256(at.add(64 * p + 32 * h).cast()) };
                let (lo, hi) = (_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
                for (a, s) in s.iter_mut().enumerate() {
                    *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(lo, quad(a, p)));
                    *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(hi, quad(a, p + 4)));
                }
            }
            s.map(|s| _mm256_madd_epi16(s, ones))
        }
        BlockFormat::Q8_0 => {
            let mut s = [_mm256_setzero_si256(); A];
            for p in 0..8 {
                let raw = unsafe { _mm256_loadu_si256(at.add(64 * p + 32 * h).cast()) };
                let abs = _mm256_abs_epi8(raw);
                for (a, s) in s.iter_mut().enumerate() {
                    let prod = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(quad(a, p), raw));
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(prod, ones));
                }
            }
            s
        }
    }
}

/// `A` activation rows against half `h` of group `g`: each row's 8 cells.
///
/// # Safety
/// AVX2 and FMA; `w` has group `g`; every row of `ps` has `w.blocks` blocks of fast-mode
/// preparation.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn half<const A: usize>(ps: [&Prep<'_>; A], w: &TiledRef<'_>, g: usize, h: usize) -> [__m256; A] {
    let (nb, gb) = (w.blocks, Tiled::group_block_bytes(w.fmt));
    for p in ps {
        assert!(p.q.len() >= nb * BLOCK && p.deltas.len() >= nb && p.sums.len() >= nb);
    }
    w.assert_groups(g + 1);
    let mut acc = [_mm256_setzero_ps(); A];
    for b in 0..nb {
        let at = (g * nb + b) * LANES + HALF * h;
        // SAFETY: group g's block b and its scales (asserted above: the vectors hold whole
        // groups), block b of every row's activations (asserted).
        let (s, d) = unsafe {
            let x = std::array::from_fn(|a| ps[a].q.as_ptr().add(b * BLOCK));
            (
                block_sums::<A>(w.fmt, w.quants.as_ptr().add((g * nb + b) * gb), h, x),
                _mm256_loadu_ps(w.scales.as_ptr().add(at)),
            )
        };
        for a in 0..A {
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(ps[a].deltas[b]));
            acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[a]), scale, acc[a]);
        }
    }
    let Some((cs, factor)) = offset_parts(w) else { return acc };
    // The offsets after the products (the same fused steps as the portable kernel's, which
    // interleaves them): fewer registers live in the loop above.
    std::array::from_fn(|a| {
        let mut off = _mm256_setzero_ps();
        for b in 0..nb {
            // SAFETY: group g's block b's coefficients (asserted with the scales).
            let c = unsafe { _mm256_loadu_ps(cs.as_ptr().add((g * nb + b) * LANES + HALF * h)) };
            off = _mm256_fmadd_ps(c, _mm256_set1_ps(ps[a].sums[b]), off);
        }
        _mm256_add_ps(acc[a], _mm256_mul_ps(off, _mm256_set1_ps(factor)))
    })
}

/// Exact mode: `A` activation rows (f32) against half `h` of group `g`, each row's 8 cells.
/// Per block, each of its 32 weights as 8 lanes of f32 (shifted out of its chunk, masked, or
/// sign-extended for Q8_0) times the activation broadcast, two partial sums a row; then
/// `acc = fma(s, d, acc)` and the offsets as in fast mode — [`qtile`](super::qtile)'s portable
/// exact arithmetic with the block's sum taken in another order.
///
/// # Safety
/// AVX2 and FMA; `w` has group `g`; every row of `ps` has `w.blocks` blocks of exact-mode
/// preparation (`x`, `sums`).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exact_half<const A: usize>(ps: [&Prep<'_>; A], w: &TiledRef<'_>, g: usize, h: usize) -> [__m256; A] {
    let (nb, gb) = (w.blocks, Tiled::group_block_bytes(w.fmt));
    for p in ps {
        assert!(p.x.len() >= nb * BLOCK && p.sums.len() >= nb);
    }
    w.assert_groups(g + 1);
    let mask = _mm256_set1_epi32(0x0F);
    let mut acc = [_mm256_setzero_ps(); A];
    for b in 0..nb {
        let base = w.quants.as_ptr().wrapping_add((g * nb + b) * gb + 32 * h);
        let x: [*const f32; A] = std::array::from_fn(|a| ps[a].x.as_ptr().wrapping_add(b * BLOCK));
        // Two partial sums a row, taken in turn (in the same order whatever `A`: a row's bits
        // do not depend on its batch), so even one row has two chains of FMAs in flight.
        let mut s = [[_mm256_setzero_ps(); 2]; A];
        let mut turn = 0;
        // Weight `j` of the half's 8 rows, as f32 lanes, times activation `j` of every row.
        let mut take = |wf: __m256, j: usize| {
            for a in 0..A {
                // SAFETY: activation j < 32 of row a's block b (asserted above).
                s[a][turn] = _mm256_fmadd_ps(wf, _mm256_set1_ps(unsafe { *x[a].add(j) }), s[a][turn]);
            }
            turn ^= 1;
        };
        match w.fmt {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                for p in 0..4 {
                    // SAFETY: chunk p of group g's block b, this half's 32 bytes (asserted).
                    let v = unsafe { _mm256_loadu_si256(base.add(64 * p).cast()) };
                    // Byte t of lane c: weight 4p + t in its low nibble, 16 + 4p + t high.
                    macro_rules! nibble {
                        ($sh:literal, $j:expr) => {
                            take(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32::<$sh>(v), mask)), $j)
                        };
                    }
                    nibble!(0, 4 * p);
                    nibble!(4, 16 + 4 * p);
                    nibble!(8, 4 * p + 1);
                    nibble!(12, 17 + 4 * p);
                    nibble!(16, 4 * p + 2);
                    nibble!(20, 18 + 4 * p);
                    nibble!(24, 4 * p + 3);
                    nibble!(28, 19 + 4 * p);
                }
            }
            BlockFormat::Q8_0 => {
                for p in 0..8 {
                    // SAFETY: chunk p of group g's block b, this half's 32 bytes (asserted).
                    let v = unsafe { _mm256_loadu_si256(base.add(64 * p).cast()) };
                    // Byte t of lane c: weight 4p + t, signed.
                    macro_rules! byte {
                        ($up:literal, $t:expr) => {
                            take(_mm256_cvtepi32_ps(_mm256_srai_epi32::<24>(_mm256_slli_epi32::<$up>(v))), 4 * p + $t)
                        };
                    }
                    byte!(24, 0);
                    byte!(16, 1);
                    byte!(8, 2);
                    take(_mm256_cvtepi32_ps(_mm256_srai_epi32::<24>(v)), 4 * p + 3);
                }
            }
        }
        // SAFETY: group g's scales of block b (asserted: the vector holds whole groups).
        let d = unsafe { _mm256_loadu_ps(w.scales.as_ptr().add((g * nb + b) * LANES + HALF * h)) };
        for a in 0..A {
            acc[a] = _mm256_fmadd_ps(_mm256_add_ps(s[a][0], s[a][1]), d, acc[a]);
        }
    }
    let Some((cs, factor)) = offset_parts(w) else { return acc };
    std::array::from_fn(|a| {
        let mut off = _mm256_setzero_ps();
        for b in 0..nb {
            // SAFETY: group g's block b's coefficients (asserted with the scales).
            let c = unsafe { _mm256_loadu_ps(cs.as_ptr().add((g * nb + b) * LANES + HALF * h)) };
            off = _mm256_fmadd_ps(c, _mm256_set1_ps(ps[a].sums[b]), off);
        }
        _mm256_add_ps(acc[a], _mm256_mul_ps(off, _mm256_set1_ps(factor)))
    })
}

/// Row `a`'s first `live` lanes of `cells` to `out + a·stride`.
///
/// # Safety
/// AVX; those cells writable.
#[target_feature(enable = "avx")]
#[inline]
unsafe fn store<const A: usize>(cells: [__m256; A], out: *mut f32, stride: usize, live: usize) {
    for (a, v) in cells.into_iter().enumerate() {
        // SAFETY: the caller's cells.
        unsafe {
            if live == HALF {
                _mm256_storeu_ps(out.add(a * stride), v);
            } else {
                let mut lanes = [0.0f32; HALF];
                _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), out.add(a * stride), live);
            }
        }
    }
}

/// A [`TiledKernel`](super::qtile::TiledKernel), fast mode: every half group holding rows of
/// `w`, [`ACTS`] activation rows a pass.
///
/// # Safety
/// AVX2 and FMA; as [`TiledKernel`](super::qtile::TiledKernel).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows(ps: &[Prep<'_>], w: &TiledRef<'_>, g0: usize, g1: usize, out: *mut f32, stride: usize) {
    // SAFETY: the caller's promises.
    unsafe { halves::<false>(ps, w, g0, g1, out, stride) }
}

/// [`rows`] in exact mode ([`exact_half`]; the rows prepared for exact mode).
///
/// # Safety
/// AVX2 and FMA; as [`TiledKernel`](super::qtile::TiledKernel).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exact_rows(ps: &[Prep<'_>], w: &TiledRef<'_>, g0: usize, g1: usize, out: *mut f32, stride: usize) {
    // SAFETY: the caller's promises.
    unsafe { halves::<true>(ps, w, g0, g1, out, stride) }
}

/// Every half group of `g0..g1` holding rows of `w`, [`ACTS`] activation rows a pass, by
/// [`exact_half`] or (fast mode) [`half`].
///
/// # Safety
/// AVX2 and FMA; as [`TiledKernel`](super::qtile::TiledKernel), the rows prepared for the mode.
#[target_feature(enable = "avx2,fma")]
unsafe fn halves<const EXACT: bool>(
    ps: &[Prep<'_>],
    w: &TiledRef<'_>,
    g0: usize,
    g1: usize,
    out: *mut f32,
    stride: usize,
) {
    for g in g0..g1 {
        for h in 0..2 {
            let first = g * LANES + h * HALF;
            if first >= w.rows {
                break;
            }
            let live = (w.rows - first).min(HALF);
            for (i, t) in ps.chunks(ACTS).enumerate() {
                // SAFETY: the caller's promises; rows i·ACTS.. of the output, this half's cells
                // 16·(g − g0) + 8·h into each.
                unsafe {
                    let o = out.add(i * ACTS * stride + (g - g0) * LANES + h * HALF);
                    macro_rules! run {
                        ($n:literal, $ps:expr) => {
                            store(
                                if EXACT { exact_half::<$n>($ps, w, g, h) } else { half::<$n>($ps, w, g, h) },
                                o,
                                stride,
                                live,
                            )
                        };
                    }
                    match t {
                        [a, b, c, d] => run!(4, [a, b, c, d]),
                        [a, b, c] => run!(3, [a, b, c]),
                        [a, b] => run!(2, [a, b]),
                        [a] => run!(1, [a]),
                        _ => unreachable!("chunks of 1..=ACTS"),
                    }
                }
            }
        }
    }
}
