//! The CUDA backend computes what the CPU backend computes: the same prompts through both,
//! last-token logits within bf16 tolerance (weights and GEMM inputs are bf16 on the GPU) and
//! the same greedy tokens on SmolLM2, whose top choices are far apart.
//!
//! Needs a GPU, so it is built only with the `gpu-tests` feature (`scripts/gpu-kit` builds it
//! for a lent GPU; `scripts/test` says it did not run elsewhere): a missing GPU, or a module or
//! kernel that fails to load, fails both tests.

#![cfg(feature = "gpu-tests")]

use ferry_engine::tiny::TinySpec;
use ferry_engine::{BatchOptions, Model, PagePool, Request, SamplingParams, SeqChunk, generate};
use ferry_kernels::Backend;
use ferry_kernels::cpu::CpuBackend;
use ferry_kernels::cuda::CudaBackend;

use crate::common::{TinyModel, prompt, rel_diff, smollm2, whole_prompts};

fn gpu() -> CudaBackend {
    CudaBackend::for_tests()
}

/// Last-token logits of each prompt, all in one batch, chunked by `chunk`.
fn logits<B: Backend>(model: &Model<B>, prompts: &[Vec<u32>], chunk: usize) -> Vec<Vec<f32>> {
    let page = 16;
    let need: usize = prompts.iter().map(|p| p.len().div_ceil(page)).sum();
    let mut pool = PagePool::new(model.backend(), model.kv_layout(page), need + 1).expect("pool");
    let allocs: Vec<_> = prompts.iter().map(|p| pool.alloc(p.len().div_ceil(page)).expect("pages")).collect();
    let pages: Vec<Vec<u32>> = allocs.iter().map(|a| a.pages().to_vec()).collect();
    let mut last = vec![Vec::new(); prompts.len()];
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut start = 0;
    while start < longest {
        let mut batch = Vec::new();
        let mut which = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            if start < p.len() {
                let end = (start + chunk).min(p.len());
                batch.push(SeqChunk { tokens: &p[start..end], start, pages: &pages[i], logits: end == p.len() });
                which.push((i, end == p.len()));
            }
        }
        let out = model.forward(&mut pool, &batch).expect("forward");
        let mut out = out.into_iter();
        for (i, done) in which {
            if done {
                last[i] = out.next().expect("logits");
            }
        }
        start += chunk;
    }
    last
}

fn greedy<B: Backend>(model: &Model<B>, prompts: &[Vec<u32>], n: u32) -> Vec<Vec<u32>> {
    let mut pool = PagePool::new(model.backend(), model.kv_layout(16), 512).expect("pool");
    let reqs: Vec<Request> = prompts
        .iter()
        .map(|p| Request {
            prompt: p.clone(),
            params: SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() },
        })
        .collect();
    let out =
        generate(model, &mut pool, &reqs, BatchOptions { chunk_size: 64, max_batch_tokens: 4096 }).expect("generate");
    out.into_iter().map(|o| o.tokens).collect()
}

#[test]
fn cpu_and_cuda_agree_on_a_tiny_model() {
    let gpu = gpu();
    // A tiny random Llama: decode (chunk 1) and prefill-chunk (chunk 64) shapes, 3 sequences.
    // Its own LM head: tied, its logits are mostly the last token's embedding scored against
    // itself, which would hide a wrong attention inside the tolerance.
    let tiny = TinyModel::new(TinySpec { tie: false, ..TinySpec::default() });
    let cpu = Model::load(&tiny.hf(), CpuBackend::default()).expect("cpu model");
    let cuda = Model::load(&tiny.hf(), gpu).expect("cuda model");
    let vocab = cpu.config().vocab_size;
    let prompts: Vec<Vec<u32>> = [5, 70, 150].iter().zip(1..).map(|(&n, s)| prompt(n, s, vocab)).collect();
    for chunk in [1, 64] {
        let (a, b) = (logits(&cpu, &prompts, chunk), logits(&cuda, &prompts, chunk));
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            let d = rel_diff(b, a);
            eprintln!("tiny, chunk {chunk}, prompt {i}: relative logit difference {d:.2e}");
            assert!(d < 3e-2, "tiny chunk {chunk} prompt {i}: {d}");
        }
    }
}

#[test]
fn cpu_and_cuda_agree_on_smollm2() {
    let gpu = gpu();
    // SmolLM2: logits close and greedy tokens equal.
    let path = smollm2();
    let cpu = Model::load(&path, CpuBackend::default()).expect("cpu model");
    let cuda = Model::load(&path, gpu).expect("cuda model");
    let tok = cpu.tokenizer();
    let prompts: Vec<Vec<u32>> =
        ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
            .iter()
            .map(|t| tok.encode(t).expect("encode"))
            .collect();
    let (a, b) = (logits(&cpu, &prompts, 64), logits(&cuda, &prompts, 64));
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        let d = rel_diff(b, a);
        eprintln!("SmolLM2 prompt {i}: relative logit difference {d:.2e}");
        assert!(d < 3e-2, "SmolLM2 prompt {i}: {d}");
    }
    assert_eq!(greedy(&cuda, &prompts, 16), greedy(&cpu, &prompts, 16), "greedy tokens");

    // Greedy picked on the device: the CPU's arg max, logprobs within bf16 noise.
    for (i, ((token, logprob), l)) in
        whole_prompts(&cuda, &prompts, Model::forward_greedy).into_iter().zip(&a).enumerate()
    {
        assert_eq!(token, ferry_engine::sampler::argmax(l), "SmolLM2 prompt {i}: device arg max");
        let lse = l.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let lse = lse + l.iter().map(|v| (v - lse).exp()).sum::<f32>().ln();
        eprintln!("SmolLM2 prompt {i}: device logprob {logprob:.4}, CPU {:.4}", l[token as usize] - lse);
        assert!((logprob - (l[token as usize] - lse)).abs() < 0.1, "SmolLM2 prompt {i}: logprob {logprob}");
    }
}
