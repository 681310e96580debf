//! Each CUDA kernel against the CPU backend, one operation at a time, on random inputs: where
//! the engine's whole-model parity test fails, this says which operation is wrong.
//!
//! Needs a GPU, so it is built only with the `gpu-tests` feature (`scripts/gpu-kit` builds it
//! for a lent GPU; `scripts/test` says it did not run elsewhere): a missing GPU, or a module or
//! kernel that fails to load, fails every test here.
#![cfg(feature = "gpu-tests")]

use ferry_kernels::cpu::CpuBackend;
use ferry_kernels::cuda::CudaBackend;
use ferry_kernels::{AttnSeq, AttnShape, Backend, KvLayout, PoolLayer, RopeScaling, RopeTable};

fn gpu() -> CudaBackend {
    CudaBackend::for_tests()
}

/// Deterministic values in [-1, 1) (xorshift), so a failure reproduces.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Largest absolute difference, relative to the largest absolute reference value.
fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn close(op: &str, got: &[f32], want: &[f32], tol: f32) {
    let d = rel(got, want);
    eprintln!("{op}: relative difference {d:.2e}");
    assert!(d <= tol, "{op}: relative difference {d:.2e} above {tol:.0e}");
}

/// bf16 rounding of the CUDA backend's weights and GEMM inputs.
const BF16: f32 = 2e-2;

#[test]
fn elementwise_ops_match_the_cpu() {
    let g = gpu();
    let c = CpuBackend::default();
    let (rows, d) = (7, 576);
    let x = values(rows * d, 1);
    let w = values(d, 2);

    // rms_norm
    let (mut oc, mut og) = (c.zeros(rows * d).expect("zeros"), g.zeros(rows * d).expect("zeros"));
    c.rms_norm(&c.upload(&x).expect("up"), &c.upload(&w).expect("up"), 1e-5, &mut oc).expect("cpu");
    g.rms_norm(&g.upload(&x).expect("up"), &g.upload(&w).expect("up"), 1e-5, &mut og).expect("cuda");
    close("rms_norm", &g.download(&og).expect("down"), &c.download(&oc).expect("down"), 1e-5);

    // silu_mul
    let y = values(rows * d, 3);
    let (mut oc, mut og) = (c.zeros(rows * d).expect("zeros"), g.zeros(rows * d).expect("zeros"));
    c.silu_mul(&c.upload(&x).expect("up"), &c.upload(&y).expect("up"), &mut oc).expect("cpu");
    g.silu_mul(&g.upload(&x).expect("up"), &g.upload(&y).expect("up"), &mut og).expect("cuda");
    close("silu_mul", &g.download(&og).expect("down"), &c.download(&oc).expect("down"), 1e-5);

    // add_assign and add_bias
    let (mut xc, mut xg) = (c.upload(&x).expect("up"), g.upload(&x).expect("up"));
    c.add_assign(&mut xc, &c.upload(&y).expect("up")).expect("cpu");
    g.add_assign(&mut xg, &g.upload(&y).expect("up")).expect("cuda");
    c.add_bias(&mut xc, &c.upload(&w).expect("up")).expect("cpu");
    g.add_bias(&mut xg, &g.upload(&w).expect("up")).expect("cuda");
    close("add_assign + add_bias", &g.download(&xg).expect("down"), &c.download(&xc).expect("down"), 1e-6);

    // gather_rows
    let pick = [6, 0, 3, 3];
    let (mut oc, mut og) = (c.zeros(pick.len() * d).expect("zeros"), g.zeros(pick.len() * d).expect("zeros"));
    c.gather_rows(&c.upload(&x).expect("up"), d, &pick, &mut oc).expect("cpu");
    g.gather_rows(&g.upload(&x).expect("up"), d, &pick, &mut og).expect("cuda");
    close("gather_rows", &g.download(&og).expect("down"), &c.download(&oc).expect("down"), 0.0);

    // rope, with and without Llama-3 scaling, positions out of order
    for scaling in [
        None,
        Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }),
    ] {
        let (heads, hd) = (9, 64);
        let t = RopeTable::new(hd, 100_000.0, 4096, scaling);
        let pos = [0, 17, 4095, 3, 1000, 2, 9];
        let q = values(pos.len() * heads * hd, 4);
        let (mut qc, mut qg) = (c.upload(&q).expect("up"), g.upload(&q).expect("up"));
        c.rope(&mut qc, heads, &pos, &t).expect("cpu");
        g.rope(&mut qg, heads, &pos, &t).expect("cuda");
        close("rope", &g.download(&qg).expect("down"), &c.download(&qc).expect("down"), 1e-5);
    }
}

#[test]
fn embed_matmul_and_greedy_match_the_cpu() {
    let g = gpu();
    let c = CpuBackend::default();
    // Shapes of SmolLM2 (576 → 1536) and a vocabulary row count not a multiple of anything.
    for (rows, n, k) in [(1, 1536, 576), (5, 576, 1536), (33, 4099, 576), (128, 192, 64)] {
        let w = values(n * k, 10 + rows as u64);
        let x = values(rows * k, 20 + rows as u64);
        let (wc, wg) = (c.matrix(n, k, w.clone()).expect("mat"), g.matrix(n, k, w).expect("mat"));
        let (mut oc, mut og) = (c.zeros(rows * n).expect("zeros"), g.zeros(rows * n).expect("zeros"));
        c.matmul(&c.upload(&x).expect("up"), rows, &wc, &mut oc).expect("cpu");
        g.matmul(&g.upload(&x).expect("up"), rows, &wg, &mut og).expect("cuda");
        close(
            &format!("matmul {rows}x{k} · ({n}x{k})ᵀ"),
            &g.download(&og).expect("down"),
            &c.download(&oc).expect("down"),
            BF16,
        );
    }

    // embed: bf16 table rows, so within bf16 rounding of the CPU's f32 rows.
    let (vocab, d) = (1000, 576);
    let table = values(vocab * d, 30);
    let (tc, tg) = (c.matrix(vocab, d, table.clone()).expect("mat"), g.matrix(vocab, d, table).expect("mat"));
    let ids = [0, 999, 5, 5, 123];
    let (mut oc, mut og) = (c.zeros(ids.len() * d).expect("zeros"), g.zeros(ids.len() * d).expect("zeros"));
    c.embed(&tc, &ids, &mut oc).expect("cpu");
    g.embed(&tg, &ids, &mut og).expect("cuda");
    close("embed", &g.download(&og).expect("down"), &c.download(&oc).expect("down"), 1e-2);

    // greedy_rows: the same picks (lowest index among equals) and logprobs.
    let vocab = 49_152;
    let mut logits = values(4 * vocab, 40);
    logits[vocab + 7] = 5.0; // row 1: a tie at 7 and 900, the lower index wins
    logits[vocab + 900] = 5.0;
    logits[2 * vocab + vocab - 1] = 9.0; // row 2: the last column
    let (lc, lg) = (c.upload(&logits).expect("up"), g.upload(&logits).expect("up"));
    let (a, b) = (c.greedy_rows(&lc, 4, vocab).expect("cpu"), g.greedy_rows(&lg, 4, vocab).expect("cuda"));
    eprintln!("greedy_rows: cpu {a:?} cuda {b:?}");
    for ((ta, la), (tb, lb)) in a.iter().zip(&b) {
        assert_eq!(ta, tb, "greedy token");
        assert!((la - lb).abs() < 1e-4, "greedy logprob {la} vs {lb}");
    }
    assert_eq!(b[1].0, 7);
    assert_eq!(b[2].0, vocab as u32 - 1);
}

#[test]
fn kv_pages_and_attention_match_the_cpu() {
    let g = gpu();
    let c = CpuBackend::default();
    for (heads, kv_heads, hd) in [(9, 3, 64), (32, 8, 128), (4, 4, 256)] {
        let layout = KvLayout { num_layers: 3, num_kv_heads: kv_heads, head_dim: hd, page_size: 16 };
        let num_pages = 40;
        let (pc, pg) = (c.kv_pool(&layout, num_pages).expect("pool"), g.kv_pool(&layout, num_pages).expect("pool"));
        // Three sequences on scattered pages: a decode row at position 40 (3 pages), a
        // prefill chunk of 20 rows starting at position 13 (3 pages) and a decode row at
        // position 200 (13 pages: many positions for each of a block's warps).
        let seq_pages: [Vec<u32>; 3] = [vec![5, 2, 19], vec![11, 0, 7], (20..33).rev().collect()];
        let lens = [41usize, 33, 201];
        let layer = 1;
        for (s, pages) in seq_pages.iter().enumerate() {
            let slots: Vec<(u32, u32)> = (0..lens[s]).map(|t| (pages[t / 16], (t % 16) as u32)).collect();
            let w = kv_heads * hd;
            let k = values(slots.len() * w, 50 + s as u64);
            let v = values(slots.len() * w, 60 + s as u64);
            c.write_kv(&pc, &layout, layer, &slots, &c.upload(&k).expect("up"), &c.upload(&v).expect("up"))
                .expect("cpu");
            g.write_kv(&pg, &layout, layer, &slots, &g.upload(&k).expect("up"), &g.upload(&v).expect("up"))
                .expect("cuda");
        }
        // The pools agree page for page (device → host copy of every page).
        let mut host = vec![0f32; num_pages * layout.page_floats()];
        g.kv_to_host(&pg, &layout, 0, &mut host).expect("to host");
        let mut want = vec![0f32; host.len()];
        c.kv_to_host(&pc, &layout, 0, &mut want).expect("to host");
        close(&format!("write_kv + kv_to_host ({heads}/{kv_heads}x{hd})"), &host, &want, 0.0);

        let shape = AttnShape { n_heads: heads, n_kv_heads: kv_heads, head_dim: hd };
        let seqs = [
            AttnSeq { pages: &seq_pages[0], q_row: 0, n_q: 1, pos0: 40 },
            AttnSeq { pages: &seq_pages[1], q_row: 1, n_q: 20, pos0: 13 },
            AttnSeq { pages: &seq_pages[2], q_row: 21, n_q: 1, pos0: 200 },
        ];
        let q = values(22 * heads * hd, 70);
        let (mut oc, mut og) = (c.zeros(q.len()).expect("zeros"), g.zeros(q.len()).expect("zeros"));
        c.attention(&c.upload(&q).expect("up"), PoolLayer { pool: &pc, layout: &layout, layer }, shape, &seqs, &mut oc)
            .expect("cpu");
        g.attention(&g.upload(&q).expect("up"), PoolLayer { pool: &pg, layout: &layout, layer }, shape, &seqs, &mut og)
            .expect("cuda");
        close(
            &format!("attention ({heads}/{kv_heads}x{hd})"),
            &g.download(&og).expect("down"),
            &c.download(&oc).expect("down"),
            1e-4,
        );

        // Host → device: pages written from the host read back unchanged.
        let pages = values(2 * layout.page_floats(), 80);
        g.kv_from_host(&pg, &layout, 3, &pages).expect("from host");
        let mut back = vec![0f32; pages.len()];
        g.kv_to_host(&pg, &layout, 3, &mut back).expect("to host");
        close("kv_from_host round trip", &back, &pages, 0.0);
    }
}
