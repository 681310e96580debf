//! What zeroing a prompt's last page tail costs (`ferry_prefill::tail::zero_tail`, once per
//! request), against copying that page once (the least the transfer does with it). Worst case:
//! one valid slot; a typical one: half the page. f32 KV, pages of 16 tokens.
//!
//! `cargo bench -p ferry-prefill --bench tail`

use std::time::Instant;

use ferry_kernels::KvLayout;
use ferry_prefill::tail::zero_tail;
use ferry_transfer::memory::HostPages;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let runs = 300;
    for (name, layout) in [
        ("SmolLM2-135M", KvLayout { num_layers: 30, num_kv_heads: 3, head_dim: 64, page_size: 16 }),
        ("Llama-3-8B", KvLayout { num_layers: 32, num_kv_heads: 8, head_dim: 128, page_size: 16 }),
    ] {
        let bytes = layout.page_floats() * 4;
        let pages = 64;
        let mem = HostPages::new(bytes, pages).expect("arena");
        let mut dst = vec![0u8; bytes];
        let mut copy = Vec::new();
        let mut zero = [Vec::new(), Vec::new()];
        for r in 0..runs {
            let page = (r % pages) as u32;
            let t = Instant::now();
            // SAFETY: the bench owns the arena.
            dst.copy_from_slice(unsafe { mem.read(page, 1) }.expect("read"));
            copy.push(t.elapsed().as_secs_f64() * 1e6);
            for (i, valid) in [1, layout.page_size / 2].into_iter().enumerate() {
                let t = Instant::now();
                // SAFETY: the bench owns the arena.
                unsafe { zero_tail(&mem, &layout, page, valid) }.expect("zero");
                zero[i].push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        std::hint::black_box(&dst);
        let (c, z1, z8) = (median(copy), median(zero[0].clone()), median(zero[1].clone()));
        println!(
            "{name:<13} page {:>7} B: copy {c:>7.1} µs; zero tail, 1 slot valid {z1:>7.1} µs ({:.2}x the copy), half valid {z8:>7.1} µs ({:.2}x)",
            bytes,
            z1 / c,
            z8 / c
        );
    }
}
