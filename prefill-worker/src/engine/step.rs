//! One prefill pass: compute the scheduled chunks, then hand each chunk's finished pages to
//! its room task (copied to the host mirror first when there is one; the prompt's partial
//! last page zeroed past the prompt).

use std::time::Instant;

use ferry_cluster::Room;
use ferry_cluster::metrics as m;
use ferry_engine::SeqChunk;
use ferry_kernels::Backend;
use ferry_transfer::frame::Aux;

use super::Engine;
use crate::room_task::ChunkMsg;
use crate::rooms::{Action, Event, Phase};

impl<B: Backend> Engine<B> {
    /// One scheduled pass: compute, then hand each chunk's finished pages to its room task.
    pub(super) fn step(&mut self) -> Result<(), ferry_engine::EngineError> {
        let chunks = self.sched.schedule(&mut self.cache, &self.pool);
        if chunks.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        let batch: Vec<SeqChunk<'_>> = chunks
            .iter()
            .filter_map(|c| {
                let l = self.rooms.live(room_of(c.id))?;
                Some(SeqChunk { tokens: &l.tokens[c.start..c.end], start: c.start, pages: &c.pages, logits: c.last })
            })
            .collect();
        if batch.len() != chunks.len() {
            return Err(ferry_engine::EngineError::InvalidRequest("a scheduled request has no room".into()));
        }
        let computed: usize = chunks.iter().map(|c| c.end - c.start).sum();
        // Requests reporting prompt logprobs want every position's logits.
        let every: Vec<bool> = chunks
            .iter()
            .map(|c| self.rooms.live(room_of(c.id)).is_some_and(|l| l.sampler.params().prompt_logprobs.is_some()))
            .collect();
        let mut logits = self.model.forward_rows(&mut self.pool, &batch, &every)?.into_iter();
        drop(batch);
        let took = t0.elapsed();
        metrics::histogram!(m::STEP_SECONDS, "role" => "prefill").record(took.as_secs_f64());
        metrics::counter!(m::PREFILL_TOKENS, "role" => "prefill").increment(computed as u64);
        let rate = computed as f64 / took.as_secs_f64().max(1e-9);
        self.rate = if self.rate == 0.0 { rate } else { 0.8 * self.rate + 0.2 * rate };
        let ps = self.pool.layout().page_size;
        let now = Instant::now();
        let (mut outgoing, mut computed_rooms) = (Vec::new(), Vec::new());
        for (c, &every) in chunks.iter().zip(&every) {
            let room = room_of(c.id);
            // A closing room computes on to the end of its chunk but sends nothing more.
            let closing = self.rooms.phase(room) == Some(Phase::Closing);
            let Some(l) = self.rooms.live_mut(room) else { continue };
            if every {
                // Row j predicts the token at c.start + j + 1; the prompt's last row is the
                // first sampled token's, taken below.
                let k = l.sampler.params().prompt_logprobs.unwrap_or(0);
                let n = c.end - c.start - usize::from(c.last);
                for (j, row) in logits.by_ref().take(n).enumerate() {
                    l.prompt_logprobs.push(ferry_engine::prompt_logprob(&row, l.tokens[c.start + j + 1], k));
                }
            }
            if !l.started {
                l.started = true;
                l.clock.lap("prefill_queue", t0);
            }
            if c.start == c.cached && c.cached > 0 && l.sent == 0 {
                l.cached = c.cached;
                metrics::counter!(m::PREFIX_HIT_TOKENS, "role" => "prefill").increment(c.cached as u64);
            }
            let upto = if c.last { c.end.div_ceil(ps) } else { c.end / ps };
            let mut aux = None;
            if c.last {
                let Some(mut lg) = logits.next() else { continue };
                let s = l.sampler.sample(&mut lg);
                aux = Some(Aux { first_token: s.token, logprob: s.logprob, room_echo: c.id, total_pages: upto as u32 });
                l.first = Some(s);
                l.clock.lap("prefill_compute", now);
                computed_rooms.push(room);
            }
            if closing {
                continue;
            }
            if upto > l.sent || aux.is_some() {
                outgoing.push((room, ChunkMsg { first: l.sent, pages: c.pages[l.sent..upto].to_vec(), last: aux }));
                l.sent = upto;
            }
        }
        for room in computed_rooms {
            self.rooms.on(Event::Computed(room), now);
        }
        for (room, msg) in outgoing {
            self.hand_over(room, msg)?;
        }
        for p in self.sched.complete(&chunks, &mut self.cache) {
            if let Some(l) = self.rooms.live_mut(room_of(p.id)) {
                l.prefilled = Some(p);
            }
        }
        Ok(())
    }

    /// Gives a chunk's pages to the room task, first copying to the host mirror those no
    /// other room is sending.
    pub(super) fn hand_over(&mut self, room: Room, msg: ChunkMsg) -> Result<(), ferry_engine::EngineError> {
        if self.rooms.live(room).is_none() {
            return Ok(());
        }
        // Without a mirror the transfer reads the pool itself: nothing to copy or count.
        if self.kv.mirrored() {
            for a in self.rooms.on(Event::Handing { room, pages: msg.pages.clone() }, Instant::now()) {
                if let Action::Mirror { pages } = a {
                    // SAFETY: these pages are computed and locked for this room; no task sends
                    // them now (none is on the wire), so nobody reads their mirror pages while
                    // they are copied.
                    unsafe { self.kv.to_host(self.model.backend(), &self.pool, &pages) }?;
                }
            }
        }
        let Some(l) = self.rooms.live_mut(room) else { return Ok(()) };
        if msg.last.is_some()
            && let Some(&page) = msg.pages.last()
        {
            let layout = self.pool.layout();
            let valid = l.tokens.len() % layout.page_size;
            // SAFETY: the prompt's partial last page is this room's alone (the prefix cache
            // holds whole pages), and its task has not been handed it yet.
            unsafe { crate::tail::zero_tail(self.kv.mem(), layout, page, valid) }
                .map_err(|e| ferry_engine::EngineError::InvalidRequest(e.to_string()))?;
        }
        if let Some(tx) = &l.chunks {
            let _ = tx.send(msg);
        }
        Ok(())
    }
}

/// The room a scheduler entry belongs to: the scheduler keeps `Room::get` ids, so every id it
/// hands back is one.
fn room_of(id: u64) -> Room {
    Room::new(id).expect("the scheduler's ids are room ids")
}
