//! One engine step: waiting requests join the batch, running ones get the pages their next
//! token needs (the queues retract victims when the pool has none to give), then one forward pass
//! decodes a token for every running request and advances local prefills (fresh prompts and
//! the recomputation of retracted requests).

use std::time::Instant;

use ferry_cluster::Room;
use ferry_cluster::metrics as m;
use ferry_engine::{Guide, PageAlloc, Sampled, SeqChunk};
use ferry_kernels::Backend;

use super::Engine;
use crate::queues::{Event, Stage};

/// Most threads computing a step's token masks beside its forward pass.
const MASK_THREADS: usize = 4;

/// One sequence of the step's batch.
struct Row {
    room: Room,
    /// First position computed.
    start: usize,
    /// Tokens computed.
    n: usize,
    /// Whether it samples a token (decode rows, and the last chunk of a fresh prompt).
    samples: bool,
}

impl<B: Backend> Engine<B> {
    /// One batch: waiting requests join, running ones decode a token, local prefills advance.
    pub(super) fn step(&mut self) -> Result<(), ferry_engine::EngineError> {
        let now = Instant::now();
        // Waiting → running: the first token (sampled by the prefill node) goes out first.
        for room in self.queues.in_stage(Stage::Waiting) {
            let Some(first) = self.reqs.get_mut(&room).and_then(|r| r.first.take()) else { continue };
            if let Some(r) = self.reqs.get_mut(&room) {
                r.sampler.observe(first.token);
            }
            self.queues.on(Event::Joined(room), now);
            if let Some(f) = self.emit_and_jump(room, first) {
                self.end(room, f);
            }
        }
        // Every running request gets the pages its next token needs, victims retracted when
        // the pool is short.
        for a in self.queues.on(Event::MakeRoom, now) {
            self.act(a, now);
        }
        let plan = self.plan();
        if plan.is_empty() {
            return Ok(());
        }
        let decoding = plan.iter().any(|r| r.samples && self.queues.stage(r.room) == Some(Stage::Running));
        // Fresh prompts computed here that report prompt logprobs want every row's logits.
        let every: Vec<bool> = plan
            .iter()
            .map(|row| {
                let r = &self.reqs[&row.room];
                self.queues.stage(row.room) == Some(Stage::Prefill)
                    && r.generated.is_empty()
                    && r.first.is_none()
                    && r.sampler.params().prompt_logprobs.is_some()
            })
            .collect();
        // Plain greedy rows only: the backend picks the tokens where the logits are (a GPU
        // then sends back a token and a logprob per row, not a row of logits).
        let on_backend = !every.contains(&true)
            && plan.iter().all(|row| !row.samples || self.reqs[&row.room].sampler.plain_greedy());
        // Constrained rows: their next masks are computed on another thread while the forward
        // pass runs (they depend only on the tokens so far).
        let mut guides: Vec<(Room, Box<Guide>)> = plan
            .iter()
            .filter(|row| row.samples)
            .filter_map(|row| Some((row.room, self.reqs.get_mut(&row.room)?.sampler.take_guide()?)))
            .collect();
        let t0 = Instant::now();
        let tokens: Vec<Vec<u32>> =
            plan.iter().map(|r| (r.start..r.start + r.n).map(|i| self.reqs[&r.room].token_at(i)).collect()).collect();
        let batch: Vec<SeqChunk<'_>> = plan
            .iter()
            .zip(&tokens)
            .map(|(row, toks)| SeqChunk {
                tokens: toks,
                start: row.start,
                pages: self.reqs[&row.room].pages.as_ref().map_or(&[][..], PageAlloc::pages),
                logits: row.samples,
            })
            .collect();
        let (model, pool) = (&self.model, &mut self.pool);
        // Up to MASK_THREADS helpers, each a share of the rows.
        let per = guides.len().div_ceil(MASK_THREADS).max(1);
        let passed = std::thread::scope(|s| {
            let masks: Vec<_> = guides
                .chunks_mut(per)
                .map(|share| {
                    s.spawn(move || {
                        for (_, g) in share {
                            g.prepare();
                        }
                    })
                })
                .collect();
            let passed = if on_backend {
                model.forward_greedy(pool, &batch).map(|p| (Vec::new().into_iter(), p.into_iter()))
            } else {
                model.forward_rows(pool, &batch, &every).map(|l| (l.into_iter(), Vec::new().into_iter()))
            };
            for h in masks {
                if let Err(e) = h.join() {
                    std::panic::resume_unwind(e);
                }
            }
            passed
        });
        drop(batch);
        for (room, g) in guides {
            if let Some(r) = self.reqs.get_mut(&room) {
                r.sampler.put_guide(Some(g));
            }
        }
        let (mut logits, mut picked) = passed?;
        metrics::histogram!(m::STEP_SECONDS, "role" => "decode").record(t0.elapsed().as_secs_f64());
        let running = plan.iter().filter(|r| self.queues.stage(r.room) == Some(Stage::Running)).count();
        metrics::histogram!(m::DECODE_BATCH, "worker" => self.cfg.worker.clone()).record(running as f64);
        for (row, &every) in plan.iter().zip(&every) {
            let Some(r) = self.reqs.get_mut(&row.room) else { continue };
            if every {
                // Row j predicts the token at row.start + j + 1; a sampling row's last is the
                // first token's, taken below.
                let k = r.sampler.params().prompt_logprobs.unwrap_or(0);
                for j in 0..row.n - usize::from(row.samples) {
                    let Some(l) = logits.next() else { break };
                    let next = r.token_at(row.start + j + 1);
                    r.prompt_logprobs.push(ferry_engine::prompt_logprob(&l, next, k));
                }
            }
            if self.queues.stage(row.room) == Some(Stage::Prefill) {
                r.computed = row.start + row.n;
                metrics::counter!(m::PREFILL_TOKENS, "role" => "decode").increment(row.n as u64);
                if r.computed < r.kv_target() {
                    continue;
                }
                if !row.samples {
                    // A retracted request's KV is back: it decodes again from its last token.
                    if let Some(at) = r.retracted_at.take() {
                        metrics::histogram!(m::RETRACTION_PAUSE).record(now.duration_since(at).as_secs_f64());
                    }
                    self.queues.on(Event::Computed(row.room), now);
                    continue;
                }
            }
            if !row.samples {
                continue;
            }
            r.behind = 0;
            let s = if on_backend {
                let Some((token, logprob)) = picked.next() else { break };
                r.sampler.observe(token);
                Sampled { token, logprob, top: Vec::new() }
            } else {
                let Some(mut l) = logits.next() else { break };
                r.sampler.sample(&mut l)
            };
            // A fresh prompt computed here is running from its first token on; its other
            // sequences, if any, fork from it now.
            let fresh = self.queues.stage(row.room) == Some(Stage::Prefill);
            self.queues.on(Event::Computed(row.room), now);
            if fresh {
                self.fork(row.room, now);
            }
            if let Some(f) = self.emit_and_jump(row.room, s) {
                self.end(row.room, f);
            }
        }
        self.queues.on(Event::Stepped { decoding }, now);
        Ok(())
    }

    /// This step's rows: every running request's next token, then local prefill chunks
    /// (oldest room first) within the chunk budget.
    fn plan(&self) -> Vec<Row> {
        let mut rooms: Vec<Room> = self.reqs.keys().copied().collect();
        rooms.sort_unstable();
        let mut plan = Vec::new();
        let mut budget = self.cfg.chunk_size.max(1);
        for room in rooms {
            let Some(r) = self.reqs.get(&room) else { continue };
            let have = r.pages.as_ref().map_or(0, PageAlloc::len) * self.pool.layout().page_size;
            match self.queues.stage(room) {
                Some(Stage::Running) if have > r.kv_target() => {
                    // With the forced tokens before it, if any, as one chunk.
                    plan.push(Row { room, start: r.kv_target() - r.behind, n: 1 + r.behind, samples: true });
                }
                Some(Stage::Prefill) if budget > 0 && r.pages.is_some() => {
                    let n = (r.kv_target() - r.computed).min(budget);
                    budget -= n;
                    let fresh = r.generated.is_empty() && r.first.is_none();
                    plan.push(Row { room, start: r.computed, n, samples: fresh && r.computed + n == r.kv_target() });
                }
                _ => {}
            }
        }
        plan
    }
}
