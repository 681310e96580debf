//! `ferry generate`: the engine colocated on this machine, one prompt.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use std::io::Write;

use ferry_engine::{
    BatchOptions, ChatMessage, Detokenizer, Model, PagePool, Request, SamplingParams, generate_streaming,
};
use ferry_kernels::cpu::CpuBackend;
use ferry_worker::Device;
use serde_json::json;

/// Arguments of `ferry generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Model: an HF directory (config.json, *.safetensors, tokenizer.json) or a GGUF file.
    #[arg(long, env = ferry_cluster::env::MODEL)]
    model: PathBuf,
    /// Prompt text.
    #[arg(long, default_value = "", help_heading = "Prompt")]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long, help_heading = "Prompt")]
    chat: bool,
    /// Prompt as comma-separated token ids (replaces --prompt).
    #[arg(long, value_delimiter = ',', help_heading = "Prompt")]
    prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128, help_heading = "Sampling")]
    max_tokens: u32,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, help_heading = "Sampling")]
    temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0, help_heading = "Sampling")]
    top_p: f32,
    /// Keep only the K most likely tokens (0 keeps all).
    #[arg(long, default_value_t = 0, help_heading = "Sampling")]
    top_k: u32,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, default_value_t = 0.0, help_heading = "Sampling")]
    min_p: f32,
    /// Repetition penalty (1 disables).
    #[arg(long, default_value_t = 1.0, help_heading = "Sampling")]
    repetition_penalty: f32,
    /// Random seed (default: random).
    #[arg(long, help_heading = "Sampling")]
    seed: Option<u64>,
    /// Keep generating past the end-of-sequence token, to exactly --max-tokens (benchmarks).
    #[arg(long, help_heading = "Sampling")]
    ignore_eos: bool,
    /// Report this many top alternatives per token (with --json).
    #[arg(long, default_value_t = 0, help_heading = "Sampling")]
    top_logprobs: u32,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16, help_heading = "Engine")]
    page_size: usize,
    /// Prompt tokens computed per forward pass (chunked prefill).
    #[arg(long, default_value_t = 512, help_heading = "Engine")]
    chunk_size: usize,
    /// Print one JSON object (token ids, text, logprobs, timings) instead of the text.
    #[arg(long, help_heading = "Output")]
    json: bool,
    /// Generate the prompt this many times at once, as one batch (with --json; the output is
    /// the first copy's, and the decode rate counts every copy's tokens from the moment all
    /// copies have their first one): the engine's aggregate decode speed at that batch.
    #[arg(long, default_value_t = 1, requires = "json", value_parser = clap::value_parser!(u32).range(1..=4096), help_heading = "Output")]
    batch: u32,
    /// Compute device: `cpu`, or `cuda` (an NVIDIA GPU; needs a build with `--features cuda`
    /// and the CUDA 12 driver and libraries at run time), `cuda:N` for GPU N.
    #[arg(long, env = ferry_cluster::env::DEVICE, default_value = "cpu", help_heading = "Engine")]
    device: Device,
    /// How the CPU multiplies by quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K): `exact`
    /// (f32 activations, the model's values up to summation order) or `fast` (activations
    /// quantized to 8 bits per block, integer dot products as llama.cpp does: faster decode).
    #[arg(long, env = ferry_cluster::env::CPU_MATH, default_value = "exact", help_heading = "Engine")]
    cpu_math: ferry_kernels::cpu::CpuMath,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    match a.device {
        Device::Cpu => {
            let math = a.cpu_math;
            run_on(a, CpuBackend::new(math))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            let backend = ferry_kernels::cuda::CudaBackend::new(n)?;
            run_on(a, backend)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => anyhow::bail!(ferry_worker::NO_CUDA_BUILD),
    }
}

fn run_on<B: ferry_kernels::Backend>(a: GenerateArgs, backend: B) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let model = Model::load(&a.model, backend).with_context(|| format!("loading {}", a.model.display()))?;
    let load_time = t0.elapsed();
    let tok = model.tokenizer();
    let prompt_ids = match &a.prompt_ids {
        Some(ids) => ids.clone(),
        None if a.chat => {
            let text = tok.chat_template()?.render(&[ChatMessage::new("user", a.prompt.clone())], true)?;
            tok.encode(&text)?
        }
        None => tok.encode(&a.prompt)?,
    };
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        seed: a.seed,
        max_new_tokens: a.max_tokens,
        top_logprobs: a.top_logprobs,
        ignore_eos: a.ignore_eos,
        ..SamplingParams::default()
    };
    let batch = a.batch as usize;
    let pages = batch * ((prompt_ids.len() + a.max_tokens as usize).div_ceil(a.page_size.max(1)) + 1);
    let mut pool = PagePool::new(model.backend(), model.kv_layout(a.page_size), pages)?;
    let req = Request { prompt: prompt_ids.clone(), params };
    let opts = BatchOptions { chunk_size: a.chunk_size, max_batch_tokens: a.chunk_size.max(batch) };
    if !a.json {
        // Stream the text as it is generated, never splitting a UTF-8 character.
        let mut detok = Detokenizer::new(true);
        let mut stdout = std::io::stdout().lock();
        let mut failed = None;
        generate_streaming(&model, &mut pool, &[req], opts, |_, s| match detok.push(tok, s.token) {
            Ok(piece) => {
                let _ = stdout.write_all(piece.as_bytes()).and_then(|()| stdout.flush());
            }
            Err(e) => failed = Some(e),
        })?;
        if let Some(e) = failed {
            return Err(e.into());
        }
        writeln!(stdout, "{}", detok.flush(tok)?)?;
        return Ok(());
    }
    // Decoding is timed from the moment every copy has its first token, over the tokens
    // sampled after it (a copy prefilled in an earlier pass than the others may decode some
    // tokens before: neither they nor their time count).
    let (mut first, mut waiting) = (vec![false; batch], batch);
    let (mut decode_from, mut decode_end, mut decode_tokens) = (None, None, 0usize);
    let outs = generate_streaming(&model, &mut pool, &vec![req; batch], opts, |i, _| {
        let now = Instant::now();
        if decode_from.is_some() {
            decode_tokens += 1;
            decode_end = Some(now);
        } else if !std::mem::replace(&mut first[i], true) {
            waiting -= 1;
            if waiting == 0 {
                decode_from = Some(now);
            }
        }
    })?;
    let first_all = outs.iter().map(|o| o.ttft).max().unwrap_or_default();
    let decode_s = match (decode_from, decode_end) {
        (Some(a), Some(b)) => (b - a).as_secs_f64(),
        _ => 0.0,
    };
    let out = outs.into_iter().next().context("a batch of at least one")?;
    let text = tok.decode(&out.tokens, true)?;
    let report = json!({
        "model": a.model.display().to_string(),
        "prompt_token_ids": prompt_ids,
        "token_ids": out.tokens,
        "text": text,
        "finish_reason": out.finish.as_str(),
        "logprobs": out.sampled.iter().map(|s| s.logprob).collect::<Vec<_>>(),
        "top_logprobs": out.sampled.iter().map(|s| s.top.iter().map(|(t, l)| json!({"token_id": t, "logprob": l})).collect::<Vec<_>>()).collect::<Vec<_>>(),
        "timings": {
            "load_ms": load_time.as_secs_f64() * 1e3,
            "prefill_ms": first_all.as_secs_f64() * 1e3,
            "decode_ms": decode_s * 1e3,
            "prefill_tokens_per_s": (batch * prompt_ids.len()) as f64 / first_all.as_secs_f64().max(1e-9),
            "decode_tokens_per_s": if decode_tokens > 0 { decode_tokens as f64 / decode_s.max(1e-9) } else { 0.0 },
        },
    });
    println!("{report}");
    Ok(())
}
