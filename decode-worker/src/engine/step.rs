//! One engine step: waiting requests join the batch, running ones get the pages their next
//! token needs (retracting victims when the pool has none to give), then one forward pass
//! decodes a token for every running request and advances local prefills (fresh prompts and
//! the recomputation of retracted requests).

use std::time::Instant;

use ferry_cluster::Room;
use ferry_cluster::metrics as m;
use ferry_engine::{PageAlloc, Sampled, SeqChunk};
use ferry_kernels::Backend;

use super::Engine;
use crate::queues::{Stage, victim};

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
        let joined: Vec<Room> =
            self.reqs.keys().copied().filter(|&r| self.queues.stage(r) == Some(Stage::Waiting)).collect();
        for room in joined {
            let Some(first) = self.reqs.get_mut(&room).and_then(|r| r.first.take()) else { continue };
            if let Some(r) = self.reqs.get_mut(&room) {
                r.sampler.observe(first.token);
            }
            self.queues.advance(room, Stage::Running, now);
            if let Some(f) = self.emit(room, first) {
                self.end(room, Ok(f));
            }
        }
        let retracted = self.make_room(now);
        let plan = self.plan();
        if plan.is_empty() {
            return Ok(());
        }
        let decoding = plan.iter().any(|r| r.samples && self.queues.stage(r.room) == Some(Stage::Running));
        self.queues.progress(now);
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
        // Plain greedy rows only: the backend picks the tokens where the logits are (a GPU
        // then sends back a token and a logprob per row, not a row of logits).
        let on_backend = plan.iter().all(|row| !row.samples || self.reqs[&row.room].sampler.plain_greedy());
        let (mut logits, mut picked) = if on_backend {
            (Vec::new().into_iter(), self.model.forward_greedy(&mut self.pool, &batch)?.into_iter())
        } else {
            (self.model.forward(&mut self.pool, &batch)?.into_iter(), Vec::new().into_iter())
        };
        drop(batch);
        metrics::histogram!(m::STEP_SECONDS, "role" => "decode").record(t0.elapsed().as_secs_f64());
        let running = plan.iter().filter(|r| self.queues.stage(r.room) == Some(Stage::Running)).count();
        metrics::histogram!(m::DECODE_BATCH, "worker" => self.cfg.worker.clone()).record(running as f64);
        for row in &plan {
            let Some(r) = self.reqs.get_mut(&row.room) else { continue };
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
                    self.queues.advance(row.room, Stage::Running, now);
                    continue;
                }
            }
            if !row.samples {
                continue;
            }
            let s = if on_backend {
                let Some((token, logprob)) = picked.next() else { break };
                r.sampler.observe(token);
                Sampled { token, logprob, top: Vec::new() }
            } else {
                let Some(mut l) = logits.next() else { break };
                r.sampler.sample(&mut l)
            };
            self.queues.advance(row.room, Stage::Running, now);
            if let Some(f) = self.emit(row.room, s) {
                self.end(row.room, Ok(f));
            }
        }
        if decoding && !retracted {
            self.queues.decoded();
        }
        Ok(())
    }

    /// Gives every running request the pages its next token needs. When the pool has too
    /// few free pages, retracts victims (least decoded progress first, then the newest;
    /// requests prefilling here count as no progress) until it has enough. Returns whether
    /// any request was retracted.
    fn make_room(&mut self, now: Instant) -> bool {
        let mut retracted = false;
        loop {
            let mut short = 0;
            for (&room, r) in &self.reqs {
                if self.queues.stage(room) == Some(Stage::Running) {
                    let have = r.pages.as_ref().map_or(0, PageAlloc::len);
                    short += self.pool.pages_for(r.kv_target() + 1).saturating_sub(have);
                }
            }
            if short <= self.pool.free_pages() {
                break;
            }
            let candidates: Vec<(Room, usize, u64)> = self
                .reqs
                .iter()
                .filter(|(room, r)| match self.queues.stage(**room) {
                    Some(Stage::Running) => true,
                    Some(Stage::Prefill) => r.pages.is_some(),
                    _ => false,
                })
                .map(|(&room, r)| (room, r.generated.len(), self.queues.order(room)))
                .collect();
            let Some(v) = victim(&candidates) else { break };
            self.retract(v, now);
            retracted = true;
        }
        let growing: Vec<Room> =
            self.reqs.keys().copied().filter(|&r| self.queues.stage(r) == Some(Stage::Running)).collect();
        for room in growing {
            let Some(r) = self.reqs.get_mut(&room) else { continue };
            let need = self.pool.pages_for(r.kv_target() + 1);
            let Some(pages) = r.pages.as_mut() else { continue };
            let more = need.saturating_sub(pages.len());
            if more > 0 && pages.grow(more).is_ok() {
                self.queues.grew(room, more);
            }
        }
        retracted
    }

    /// Frees a request's pages and sends it back to the prealloc queue with the context it
    /// must recompute (its prompt and all but its last generated token); its sampler, and so
    /// its random stream, carries on when it resumes.
    fn retract(&mut self, room: Room, now: Instant) {
        let running = self.queues.stage(room) == Some(Stage::Running);
        let Some(r) = self.reqs.get_mut(&room) else { return };
        let lost = if running { r.kv_target() } else { r.computed };
        r.pages = None;
        r.computed = 0;
        let target = r.kv_target();
        let progress = r.generated.len();
        let span = r.span.clone();
        r.retracted_at.get_or_insert(now);
        r.clock.lap(if progress == 0 { "retracted" } else { "decode" }, now);
        self.queues.retract(room, target, now);
        let w = self.cfg.worker.clone();
        metrics::counter!(m::RETRACTIONS, "worker" => w.clone(), "reason" => "out_of_pages").increment(1);
        metrics::counter!(m::RETRACTED_TOKENS, "worker" => w).increment(lost as u64);
        tracing::info!(parent: &span, progress, recompute = target, "retracted: no free KV page");
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
                    plan.push(Row { room, start: r.kv_target(), n: 1, samples: true });
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
