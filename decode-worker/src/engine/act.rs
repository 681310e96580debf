//! Carrying out what the queues decide ([`Action`]): allocating an admitted request's pages
//! (and opening its receiver room and handshake), growing and retracting running requests,
//! ending those that waited too long, and returning drained pages to the pool.

use std::time::Instant;

use ferry_cluster::Room;
use ferry_cluster::metrics as m;
use ferry_engine::PageAlloc;
use ferry_kernels::Backend;

use super::Engine;
use crate::error::DecodeError;
use crate::handshake::HandshakeJob;
use crate::queues::{Action, Event, Stage};

impl<B: Backend> Engine<B> {
    /// Carries out one action of the queues. (A refusal, the pages of an ended request and a
    /// transfer's end are carried out where their event was raised: `accept`, `close` and
    /// `transferred`.)
    pub(super) fn act(&mut self, a: Action, now: Instant) {
        match a {
            Action::Allocate { room, pages, local } => self.allocate(room, pages, local, now),
            Action::Grow { room, pages } => {
                self.make_free(pages);
                let grown = self.reqs.get_mut(&room).and_then(|r| r.pages.as_mut()).map(|p| p.grow(pages));
                if let Some(Err(e)) = grown {
                    // A bug, contained: the queues stop counting the pages; the request, short
                    // of its next token's page, asks again at the next step (or is retracted).
                    tracing::error!(room = %room, error = %e, "the pool refused pages the queues counted free");
                    self.queues.on(Event::GrowFailed { room, pages }, now);
                }
            }
            Action::Retract { room, context, running, .. } => self.retract(room, context, running, now),
            Action::Expired { room, stage } => {
                let why = match stage {
                    Stage::Prealloc => DecodeError::NoRoom,
                    _ => DecodeError::Timeout(stage.label()),
                };
                self.end(room, Err(why));
            }
            Action::Free { room, .. } => {
                if let Some(i) = self.draining.iter().position(|d| d.0 == room) {
                    let (_, pages, prefix) = self.draining.swap_remove(i);
                    drop(pages);
                    if let Some(node) = prefix {
                        self.cache.unlock(node);
                    }
                }
            }
            // Decided for the events whose callers carry them out with what they hold: a
            // refusal (`accept`), drained pages (`close`), a transfer's end (`transferred`,
            // `handshake_failed`).
            Action::Refuse(_) | Action::Drain { .. } | Action::Land(_) | Action::Fail(_) => {}
        }
    }

    /// An admitted request's pages: its receiver room opens and its handshake starts (or it
    /// prefills here). The longest prefix the cache holds leads its pages: prefilled here,
    /// it computes the rest; prefilled elsewhere, the prefill node sends only the rest
    /// (delta transfer).
    fn allocate(&mut self, room: Room, pages: usize, local: bool, now: Instant) {
        let hit = self.lookup(room);
        let lent = hit.as_ref().map_or(0, |m| m.pages.len());
        let alloc = match self.take_pages(pages - lent) {
            Ok(p) => p,
            Err(e) => {
                if let Some(m) = hit {
                    self.cache.unlock(m.node);
                }
                tracing::error!(room = %room, error = %e, "the pool refused pages the queues counted free");
                return self.end(room, Err(DecodeError::OutOfPages(e.to_string())));
            }
        };
        // A hit implies the request (`lookup` found it, and nothing since ended it).
        let Some(r) = self.reqs.get_mut(&room) else { return };
        if r.generated.is_empty() {
            // What its prompt found this time (a readmitted request may find less).
            r.hit = hit.as_ref().map_or(0, |m| m.tokens as u32);
        }
        let alloc = match hit {
            Some(found) => {
                metrics::counter!(m::PREFIX_HIT_TOKENS, "role" => "decode").increment(found.tokens as u64);
                if local {
                    r.computed = found.tokens;
                } else {
                    r.held = found.pages.len();
                    metrics::counter!(m::TRANSFER_PAGES_HELD).increment(found.pages.len() as u64);
                }
                r.cached = Some(found.node);
                PageAlloc::lending(&found.pages, alloc)
            }
            None => alloc,
        };
        r.clock.lap("admission", now);
        r.pages = Some(alloc);
        if local {
            return;
        }
        let dest = r.prompt_pages(self.pool.layout().page_size)[r.held..].to_vec();
        match self.receiver.open(room, r.key.secret, &dest) {
            Ok(outcome) => self.wake.outcome(room, r.incarnation, outcome),
            Err(refusal) => return self.end(room, Err(DecodeError::RoomRefused(refusal))),
        }
        let job = HandshakeJob {
            room,
            key: r.key,
            bootstrap: r.bootstrap.clone().unwrap_or_default(),
            dest,
            held: r.held as u32,
            data_endpoint: self.cfg.data_endpoint.clone(),
            backend: self.cfg.backend,
            layout: self.cfg.layout.clone(),
            span: r.span.clone(),
            trace: r.trace,
        };
        self.handshakes.start(job);
    }

    /// A retracted request: its pages go back to the pool; it recomputes `context` tokens
    /// (its prompt and all but its last generated token) when admitted again, and its
    /// sampler, and so its random stream, carries on.
    fn retract(&mut self, room: Room, context: usize, running: bool, now: Instant) {
        let Some(mut r) = self.reqs.remove(&room) else { return };
        let lost = if running { r.kv_target() - r.behind } else { r.computed };
        debug_assert_eq!(context, r.kv_target(), "the queues and the engine disagree on the context");
        // Its pages stay in the prefix cache while no one needs them: readmitted in time, it
        // recomputes only what was evicted.
        let pages = r.pages.take();
        self.keep(&mut r, pages, lost);
        let r = self.reqs.entry(room).or_insert(r);
        r.computed = 0;
        r.behind = 0;
        r.held = 0;
        if r.generated.is_empty() {
            // Its prompt is computed again from the start, its logprobs with it.
            r.prompt_logprobs.clear();
        }
        let progress = r.generated.len();
        r.retracted_at.get_or_insert(now);
        r.clock.lap(if progress == 0 { "retracted" } else { "decode" }, now);
        let w = self.cfg.worker.clone();
        metrics::counter!(m::RETRACTIONS, "worker" => w.clone(), "reason" => "out_of_pages").increment(1);
        metrics::counter!(m::RETRACTED_TOKENS, "worker" => w).increment(lost as u64);
        tracing::info!(parent: &r.span, progress, recompute = context, "retracted: no free KV page");
    }
}
