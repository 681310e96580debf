use super::*;
use crate::cpu::matmul::matmul_t;
use crate::cpu::packed::tests::floats;
use crate::quant::WeightFormat;
use crate::quant_k::tests::k_blocks;

fn matrix(n: usize, k: usize, seed: u64) -> (Q6, Vec<f32>, usize) {
    let data = k_blocks(WeightFormat::Q6K, n, k, seed);
    let mut f = vec![0.0; n * k];
    WeightFormat::Q6K.dequantize(&data, &mut f);
    (Q6::new(n, k, &data), f, data.len())
}

/// Every value survives packing, in every place of a block, and the AVX2 unpacking gives
/// the portable one's bytes.
#[test]
fn blocks_unpack_to_the_values_packed() {
    for shift in 0..64 {
        let v: [i8; BLOCK] = std::array::from_fn(|j| ((j * 7 + shift) % 64) as i8 - 32);
        let packed = pack(&v);
        assert_eq!(unpack(&packed), v, "shift {shift}");
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let mut got = [0i8; BLOCK];
            // SAFETY: the CPU has AVX2 and FMA; `packed` holds PACKED bytes, `got` 32.
            unsafe {
                use std::arch::x86_64::_mm256_storeu_si256;
                _mm256_storeu_si256(got.as_mut_ptr().cast(), avx2::unpack(packed.as_ptr()));
            }
            assert_eq!(got, v, "avx2, shift {shift}");
        }
    }
}

/// Rows dequantize to ggml's values bit for bit, stacked or not, in ≤ 1.01× the file.
#[test]
fn rows_dequantize_to_ggml_values_bit_for_bit() {
    let (mut a, mut want, bytes_a) = matrix(5, 512, 3);
    let (b, f, bytes_b) = matrix(3, 512, 4);
    a.append(b);
    want.extend(f);
    let mut got = vec![0.0; 8 * 512];
    a.dequantize_rows(0, &mut got);
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    got.fill(0.0);
    for (r, o) in got.chunks_exact_mut(512).enumerate() {
        dequantize_row_portable(&a.row(r), o);
    }
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "portable");
    let ggml = bytes_a + bytes_b;
    assert!(a.resident_bytes() * 100 <= ggml * 101, "{} vs {ggml}", a.resident_bytes());
}

/// Every kernel of both modes against an f64 dot product on the dequantized weights:
/// exact within 1e-5 of `Σ|x·w|`, fast within the activations' rounding (`δ/2·Σ|w|` per
/// block of 32) plus that.
#[test]
fn every_kernel_is_within_its_bound_of_the_f64_product() {
    let (n, k) = (6, 768);
    let (w, f, _) = matrix(n, k, 9);
    let x = floats(k, 5);
    for math in [CpuMath::Exact, CpuMath::Fast] {
        let prep = Prepared::new(math, &x, 1, k);
        let p = prep.row(&x, 0);
        let ks = kernels(math);
        assert!(ks.iter().any(|(name, _)| *name == "portable"));
        for (name, kern) in ks {
            for r in 0..n {
                let wr = &f[r * k..(r + 1) * k];
                let want: f64 = x.iter().zip(wr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                let abs: f64 = x.iter().zip(wr).map(|(&a, &b)| f64::from((a * b).abs())).sum();
                let mut bound = 1e-5 * abs;
                if math == CpuMath::Fast {
                    let (xs, ws) = (x.chunks_exact(32), wr.chunks_exact(32));
                    let round: f64 = xs
                        .zip(ws)
                        .map(|(xb, wb)| {
                            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                            f64::from(amax / 127.0) / 2.0 * wb.iter().map(|v| f64::from(v.abs())).sum::<f64>()
                        })
                        .sum();
                    bound += round * 1.01;
                }
                // SAFETY: `kernels` lists only kernels this CPU runs.
                let got = f64::from(unsafe { kern(&p, &w.row(r)) });
                assert!((got - want).abs() <= bound, "{math} {name} row {r}: {got} vs {want} (bound {bound})");
            }
        }
    }
}

/// Exact products against the f32 path on the dequantized matrix (the SGEMM path past 4
/// rows the same bits; cell by cell within 1e-5 of `Σ|x·w|`); cell by cell (both modes),
/// each cell the kernel's result on that row alone, whatever the batch and its place in
/// a rows kernel's group.
#[test]
fn products_match_the_f32_path_and_fast_rows_ignore_their_batch() {
    let (n, k) = (40, 512);
    let (w, f, _) = matrix(n, k, 21);
    for math in [CpuMath::Exact, CpuMath::Fast] {
        for m in [1usize, 2, 3, 4, 5, 6, 9] {
            let x: Vec<f32> = (0..m).flat_map(|r| floats(k, r as u64 + 1)).collect();
            let (mut got, mut want) = (vec![0.0; m * n], vec![0.0; m * n]);
            matmul(math, &x, m, &w, &mut got);
            matmul_t(&x, m, &f, n, k, &mut want);
            for (i, (g, wv)) in got.iter().zip(&want).enumerate() {
                let (a, c) = (i / n, i % n);
                let (xa, wc) = (&x[a * k..(a + 1) * k], &f[c * k..(c + 1) * k]);
                match math {
                    CpuMath::Exact if m > GEMV_MAX_ROWS => assert_eq!(g.to_bits(), wv.to_bits(), "m={m} {i}"),
                    _ => {
                        if math == CpuMath::Exact {
                            let abs: f32 = xa.iter().zip(wc).map(|(p, q)| (p * q).abs()).sum();
                            assert!((g - wv).abs() <= 1e-5 * abs, "m={m} cell {i}: {g} vs {wv}");
                        }
                        let prep = Prepared::new(math, xa, 1, k);
                        // SAFETY: `kernel` picked a kernel this CPU runs.
                        let alone = unsafe { kernel(math)(&prep.row(xa, 0), &w.row(c)) };
                        assert_eq!(g.to_bits(), alone.to_bits(), "{math} m={m} cell {i}");
                    }
                }
            }
        }
    }
}
