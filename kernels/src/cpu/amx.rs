//! The [`qtile`](super::qtile) product on AMX int8 tiles: 16 activation rows × one group's
//! block (16 weight rows × 32 values) per `tdpbsud` (`tdpbssd` for Q8_0's signed weights),
//! giving the 256 cells' exact integer sums of that block; the block's scaling then runs in
//! AVX-512, lane by lane the arithmetic of [`qtile`](super::qtile)'s portable kernel, so
//! cells agree bit for bit with the VNNI kernel, which takes the rows after the last whole
//! tile of 16.
//!
//! Rust has no stable AMX intrinsics: the tile instructions are inline assembly, and Linux
//! lends a process the tiles' 8 KiB of register state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), asked once in [`usable`].
//! `FERRY_CPU_AMX=off` leaves AMX unused (for comparisons).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::qdot::Prep;
use super::qtile::offset_parts;
use super::qtile512::{finish, group_rows, lanes, quads};
use super::tiled::{LANES, Tiled, TiledRef};
use crate::quant::{BLOCK, BlockFormat};

/// Whether this CPU has AMX-INT8 and the OS lets this process use its tiles.
pub(super) fn usable() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var("FERRY_CPU_AMX").is_ok_and(|v| v == "off") {
            return false;
        }
        // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
        let id = __cpuid_count(7, 0);
        if id.edx >> 24 & 1 == 0 || id.edx >> 25 & 1 == 0 {
            return false;
        }
        permit()
    })
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM`, feature 18): refused on kernels
/// before 5.16 or where the state is disabled.
#[cfg(target_os = "linux")]
fn permit() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a request about this process's own permissions; no memory is passed.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn permit() -> bool {
    false
}

/// `ldtilecfg`'s 64 bytes: palette 1, then each tile's bytes per row and rows.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Two sets of tiles, so one block's product runs while the previous one's cells are scaled:
/// tmm0/tmm3 activations (16 rows × 32 bytes), tmm1/tmm4 weights (8 rows × 64 bytes: a
/// group's 8 quad vectors), tmm2/tmm5 the integer sums (16 × 16 i32).
const CONFIG: TileConfig = {
    let mut c = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    let mut set = 0;
    while set < 2 {
        let t = 3 * set;
        (c.colsb[t], c.rows[t]) = (BLOCK as u16, 16);
        (c.colsb[t + 1], c.rows[t + 1]) = (64, 8);
        (c.colsb[t + 2], c.rows[t + 2]) = (64, 16);
        set += 1;
    }
    c
};

/// 16 × 16 i32, where the tiles store their sums.
#[repr(C, align(64))]
struct Sums([[i32; LANES]; 16]);

thread_local! {
    /// A group's blocks unpacked to bytes (Q4), the tiles' weight operand.
    static UNPACKED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// A [`TiledKernel`](super::qtile::TiledKernel): whole tiles of 16 activation rows on AMX,
/// the rows after them on AVX-512 VNNI.
///
/// # Safety
/// AVX-512F, BW, VNNI, FMA and [`usable`]; as [`TiledKernel`](super::qtile::TiledKernel).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
pub(super) unsafe fn rows(ps: &[Prep<'_>], w: &TiledRef<'_>, g0: usize, g1: usize, out: *mut f32, stride: usize) {
    let (nb, gb) = (w.blocks, Tiled::group_block_bytes(w.fmt));
    let k = nb * BLOCK;
    let full = ps.len() / 16 * 16;
    // A tile loads 16 activation rows at one stride, their deltas and sums too: rows of one
    // preparation are.
    let strided = (1..full).all(|a| {
        let (p, q) = (&ps[a - 1], &ps[a]);
        a % 16 == 0
            || (q.q.as_ptr() == p.q.as_ptr().wrapping_add(k)
                && q.deltas.as_ptr() == p.deltas.as_ptr().wrapping_add(nb)
                && q.sums.as_ptr() == p.sums.as_ptr().wrapping_add(nb))
    });
    if full == 0 || !strided {
        // SAFETY: the caller's promises.
        return unsafe { super::qtile512::rows(ps, w, g0, g1, out, stride) };
    }
    for p in ps {
        assert!(p.q.len() >= k && p.deltas.len() >= nb && p.sums.len() >= nb);
    }
    w.assert_groups(g1);
    // SAFETY: a valid palette-1 configuration; `usable` got the OS's permission.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) &CONFIG, options(nostack, readonly)) };
    UNPACKED.with_borrow_mut(|unpacked| {
        for g in g0..g1 {
            let weights = match w.fmt {
                // Q8_0's blocks are the tiles' operand as they are (signed bytes).
                BlockFormat::Q8_0 => unsafe { w.quants.as_ptr().add(g * nb * gb) },
                BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                    unpacked.resize(nb * 512, 0);
                    for b in 0..nb {
                        // SAFETY: group g's block b (asserted); 512 bytes of `unpacked` a block.
                        unsafe {
                            let (q, _) = quads(w.fmt, w.quants.as_ptr().add((g * nb + b) * gb));
                            for (p, v) in q.iter().enumerate() {
                                _mm512_storeu_si512(unpacked.as_mut_ptr().add(b * 512 + 64 * p).cast(), *v);
                            }
                        }
                    }
                    unpacked.as_ptr()
                }
            };
            // SAFETY: group g's cells start 16·(g − g0) into each output row.
            let o = unsafe { out.add((g - g0) * LANES) };
            for t in (0..full).step_by(16) {
                // SAFETY: rows t..t + 16 are strided (checked); their cells the caller's.
                unsafe { tile(&ps[t..t + 16], w, g, weights, o.add(t * stride), stride) };
            }
            if full < ps.len() {
                // SAFETY: the caller's promises, rows full.. of the output.
                unsafe { group_rows(&ps[full..], w, g, o.add(full * stride), stride) };
            }
        }
    });
    // SAFETY: back to the initial tile state (nothing for the OS to save on a switch).
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// `$body` 16 times, `$r` 0 to 15 as a constant (the accumulators stay in registers).
macro_rules! unroll16 {
    ($r:ident, $body:block) => {
        unroll16!(@ $r, $body, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
    };
    (@ $r:ident, $body:block, $($n:literal),*) => {
        $({
            const $r: usize = $n;
            $body
        })*
    };
}

/// Block `b`'s product of 16 activation rows (`x`, `k` bytes apart) and the weights' block at
/// `bw` (8 rows of 64 bytes) into `sums`, on tile set `b % 2`.
///
/// # Safety
/// Those bytes readable, `sums` writable; the tile configuration loaded.
#[inline(always)]
unsafe fn product(b: usize, signed: bool, x: *const i8, k: usize, bw: *const u8, sums: *mut [i32; LANES]) {
    let a = x.wrapping_add(b * BLOCK);
    // SAFETY: the caller's promises.
    unsafe {
        match (b % 2, signed) {
            (0, false) => asm!(
                "tilezero tmm2", "tileloadd tmm0, [{a} + {sa}*1]", "tileloadd tmm1, [{b} + {sb}*1]",
                "tdpbsud tmm2, tmm0, tmm1", "tilestored [{c} + {sb}*1], tmm2",
                a = in(reg) a, sa = in(reg) k, b = in(reg) bw, sb = in(reg) 64usize, c = in(reg) sums,
                options(nostack)),
            (_, false) => asm!(
                "tilezero tmm5", "tileloadd tmm3, [{a} + {sa}*1]", "tileloadd tmm4, [{b} + {sb}*1]",
                "tdpbsud tmm5, tmm3, tmm4", "tilestored [{c} + {sb}*1], tmm5",
                a = in(reg) a, sa = in(reg) k, b = in(reg) bw, sb = in(reg) 64usize, c = in(reg) sums,
                options(nostack)),
            (0, true) => asm!(
                "tilezero tmm2", "tileloadd tmm0, [{a} + {sa}*1]", "tileloadd tmm1, [{b} + {sb}*1]",
                "tdpbssd tmm2, tmm0, tmm1", "tilestored [{c} + {sb}*1], tmm2",
                a = in(reg) a, sa = in(reg) k, b = in(reg) bw, sb = in(reg) 64usize, c = in(reg) sums,
                options(nostack)),
            (_, true) => asm!(
                "tilezero tmm5", "tileloadd tmm3, [{a} + {sa}*1]", "tileloadd tmm4, [{b} + {sb}*1]",
                "tdpbssd tmm5, tmm3, tmm4", "tilestored [{c} + {sb}*1], tmm5",
                a = in(reg) a, sa = in(reg) k, b = in(reg) bw, sb = in(reg) 64usize, c = in(reg) sums,
                options(nostack)),
        }
    }
}

/// 16 activation rows (`ps`, rows of one preparation: their values, deltas and sums each one
/// stride apart) against group `g`, whose blocks' 8 quad vectors are at `weights` (512 bytes
/// a block): each row's 16 cells. Block `b + 1`'s tiles are issued before block `b`'s sums are
/// scaled, so the two overlap.
///
/// # Safety
/// As [`rows`], with the tile configuration loaded.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
unsafe fn tile(ps: &[Prep<'_>], w: &TiledRef<'_>, g: usize, weights: *const u8, out: *mut f32, stride: usize) {
    let nb = w.blocks;
    let k = nb * BLOCK;
    let (x, deltas, bsums) = (ps[0].q.as_ptr(), ps[0].deltas.as_ptr(), ps[0].sums.as_ptr());
    let signed = w.fmt == BlockFormat::Q8_0;
    let mut sums = [Sums([[0; LANES]; 16]), Sums([[0; LANES]; 16])];
    let mut acc = [_mm512_setzero_ps(); 16];
    // SAFETY (every product): block b of 16 rows k bytes apart, the group's block b (the
    // caller's promises); `sums` 1 KiB each.
    unsafe { product(0, signed, x, k, weights, sums[0].0.as_mut_ptr()) };
    for b in 0..nb {
        if b + 1 < nb {
            let s = sums[(b + 1) % 2].0.as_mut_ptr();
            unsafe { product(b + 1, signed, x, k, weights.add((b + 1) * 512), s) };
        }
        let s = &sums[b % 2].0;
        // SAFETY: group g's scales of block b (the caller's promise).
        let d = unsafe { _mm512_loadu_ps(w.scales.as_ptr().add((g * nb + b) * LANES)) };
        unroll16!(R, {
            // SAFETY: row R of the stored sums; row R's delta of block b (rows nb apart).
            let v = _mm512_cvtepi32_ps(unsafe { _mm512_load_si512(s[R].as_ptr().cast()) });
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(unsafe { *deltas.add(R * nb + b) }));
            acc[R] = _mm512_fmadd_ps(v, scale, acc[R]);
        });
    }
    let offsets = offset_parts(w);
    let live = lanes(w, g);
    for (r, acc) in acc.into_iter().enumerate() {
        let mut off = _mm512_setzero_ps();
        if let Some((cs, _)) = offsets {
            for b in 0..nb {
                // SAFETY: as above; row r's sum of block b.
                let c = unsafe { _mm512_loadu_ps(cs.as_ptr().add((g * nb + b) * LANES)) };
                off = _mm512_fmadd_ps(c, _mm512_set1_ps(unsafe { *bsums.add(r * nb + b) }), off);
            }
        }
        // SAFETY: row r's live cells of the group, the caller's.
        unsafe { _mm512_mask_storeu_ps(out.add(r * stride), live, finish(acc, off, offsets.map(|(_, f)| f))) };
    }
}
