//! Colocated generation: prefill in chunks and decode with continuous batching on one pool.
//!
//! Each step forms one mixed batch under a token budget: every sequence still prefilling
//! contributes its next chunk, every decoding sequence its last token. A finished sequence
//! drops its pages at once.

use std::time::{Duration, Instant};

use ferry_kernels::Backend;
use ferry_tokenize::{FinishReason, SamplingParams};

use crate::EngineError;
use crate::forward::SeqChunk;
use crate::model::Model;
use crate::pool::{PageAlloc, PagePool};
use crate::sampler::{Sampled, Sampler};

/// A request for [`generate`].
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling parameters.
    pub params: SamplingParams,
}

/// What a request produced.
#[derive(Debug, Clone)]
pub struct Output {
    /// Generated token ids, stop token included.
    pub tokens: Vec<u32>,
    /// Per generated token: logprob and the top alternatives.
    pub sampled: Vec<Sampled>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Time to the first token.
    pub ttft: Duration,
    /// Time to the last token.
    pub total: Duration,
}

/// Batching limits.
#[derive(Debug, Clone, Copy)]
pub struct BatchOptions {
    /// Most prompt tokens one sequence computes in one step.
    pub chunk_size: usize,
    /// Most tokens in one forward pass (at least one sequence always runs).
    pub max_batch_tokens: usize,
}

impl Default for BatchOptions {
    fn default() -> Self {
        Self { chunk_size: 512, max_batch_tokens: 2048 }
    }
}

struct Seq {
    prompt: Vec<u32>,
    computed: usize,
    out: Vec<u32>,
    sampled: Vec<Sampled>,
    sampler: Sampler,
    pages: Option<PageAlloc>,
    finish: Option<FinishReason>,
    ttft: Duration,
    total: Duration,
}

/// Checks a request against the model: non-empty, known token ids, fits the context, valid
/// sampling parameters.
pub fn validate<B: Backend>(model: &Model<B>, req: &Request) -> Result<(), EngineError> {
    let cfg = model.config();
    if req.prompt.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(EngineError::InvalidRequest(format!(
            "token id {bad} is outside the vocabulary of {}",
            cfg.vocab_size
        )));
    }
    if req.prompt.len() >= cfg.max_position_embeddings {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt has {} tokens; the context holds {} (including at least one generated token)",
            req.prompt.len(),
            cfg.max_position_embeddings
        )));
    }
    req.params.validate(cfg.vocab_size)?;
    if req.params.resumed as usize >= req.prompt.len() {
        return Err(EngineError::InvalidRequest(format!(
            "resumed = {}: a resumed request's output must follow at least one prompt token (the prompt has {})",
            req.params.resumed,
            req.prompt.len()
        )));
    }
    Ok(())
}

/// Runs `requests` to completion together; outputs are in request order.
pub fn generate<B: Backend>(
    model: &Model<B>,
    pool: &mut PagePool<B>,
    requests: &[Request],
    opts: BatchOptions,
) -> Result<Vec<Output>, EngineError> {
    generate_streaming(model, pool, requests, opts, |_, _| {})
}

/// Like [`generate`], calling `on_token(request index, token)` as each token is sampled.
pub fn generate_streaming<B: Backend>(
    model: &Model<B>,
    pool: &mut PagePool<B>,
    requests: &[Request],
    opts: BatchOptions,
    mut on_token: impl FnMut(usize, &Sampled),
) -> Result<Vec<Output>, EngineError> {
    for r in requests {
        validate(model, r)?;
    }
    let start = Instant::now();
    let ctx = model.config().max_position_embeddings;
    let eos = model.tokenizer().eos_ids().to_vec();
    let guides = requests.iter().map(|r| model.guide(&r.params)).collect::<Result<Vec<_>, _>>()?;
    let mut seqs: Vec<Seq> = requests
        .iter()
        .zip(guides)
        .map(|(r, guide)| Seq {
            prompt: r.prompt.clone(),
            computed: 0,
            out: Vec::new(),
            sampled: Vec::new(),
            sampler: Sampler::new(r.params.clone(), &r.prompt).guided(guide),
            pages: None,
            finish: None,
            ttft: Duration::ZERO,
            total: Duration::ZERO,
        })
        .collect();
    let chunk = opts.chunk_size.max(1);
    while seqs.iter().any(|s| s.finish.is_none()) {
        // Plan this step: (sequence, token range start, token count).
        let mut plan = Vec::new();
        let mut budget = opts.max_batch_tokens.max(1);
        for (i, s) in seqs.iter_mut().enumerate() {
            if s.finish.is_some() {
                continue;
            }
            let (from, n) = if s.computed < s.prompt.len() {
                (s.computed, chunk.min(s.prompt.len() - s.computed))
            } else {
                (s.prompt.len() + s.out.len() - 1, 1)
            };
            let n = n.min(budget);
            if n == 0 {
                break;
            }
            budget -= n;
            let need = pool.pages_for(from + n);
            let have = s.pages.as_ref().map_or(0, |p| p.pages().len());
            if need > have {
                match &mut s.pages {
                    Some(p) => p.grow(need - have)?,
                    None => s.pages = Some(pool.alloc(need)?),
                }
            }
            plan.push((i, from, n));
        }
        let tokens: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(i, from, n)| {
                let s = &seqs[i];
                if from < s.prompt.len() { s.prompt[from..from + n].to_vec() } else { vec![s.out[s.out.len() - 1]] }
            })
            .collect();
        let batch: Vec<SeqChunk<'_>> = plan
            .iter()
            .zip(&tokens)
            .map(|(&(i, from, n), toks)| {
                let s = &seqs[i];
                SeqChunk {
                    tokens: toks,
                    start: from,
                    pages: s.pages.as_ref().map_or(&[][..], |p| p.pages()),
                    logits: from + n >= s.prompt.len(),
                }
            })
            .collect();
        let mut logits = model.forward(pool, &batch)?.into_iter();
        drop(batch);
        for &(i, from, n) in &plan {
            let s = &mut seqs[i];
            if from < s.prompt.len() {
                s.computed = from + n;
                if s.computed < s.prompt.len() {
                    continue;
                }
            }
            let Some(mut l) = logits.next() else {
                return Err(EngineError::InvalidRequest("forward returned fewer logits than planned".into()));
            };
            let out = s.sampler.sample(&mut l);
            on_token(i, &out);
            let tok = out.token;
            s.out.push(tok);
            s.sampled.push(out);
            if s.out.len() == 1 {
                s.ttft = start.elapsed();
            }
            let p = s.sampler.params();
            if !p.ignore_eos && eos.contains(&tok) || p.stop_token_ids.contains(&tok) || s.sampler.complete() {
                s.finish = Some(FinishReason::Stop);
            } else if s.out.len() >= p.max_new_tokens as usize || s.prompt.len() + s.out.len() >= ctx {
                s.finish = Some(FinishReason::Length);
            }
            if s.finish.is_some() {
                s.total = start.elapsed();
                s.pages = None;
            }
        }
    }
    Ok(seqs
        .into_iter()
        .map(|s| Output {
            tokens: s.out,
            sampled: s.sampled,
            finish: s.finish.unwrap_or(FinishReason::Abort),
            ttft: s.ttft,
            total: s.total,
        })
        .collect())
}
