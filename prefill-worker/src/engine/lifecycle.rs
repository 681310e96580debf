//! A room's way out of the engine: its task reporting (the caller answered, the pages
//! released), a failure or abort (the task stopped; pages freed when it reports), a timeout.

use std::time::Instant;

use ferry_cluster::Room;
use ferry_cluster::metrics as m;
use ferry_kernels::Backend;

use super::{Engine, Handshake, Live, NewRequest, PrefillDone};
use crate::error::{PrefillError, TaskError};
use crate::rooms::{Action, Event, Expired, Phase};

impl<B: Backend> Engine<B> {
    /// A room task ended.
    pub(super) fn sent(&mut self, room: Room, result: Result<(), TaskError>) {
        let finished = self.rooms.on(Event::Finished(room), Instant::now());
        let Some(Action::Finished { live: Some(mut l), closed, .. }) = finished.into_iter().next() else { return };
        let reply = l.reply.take();
        match (&closed, result) {
            (None, Ok(())) => {
                l.clock.lap("transfer", Instant::now());
                metrics::counter!(m::REQUESTS, "role" => "prefill", "outcome" => "sent").increment(1);
                if let (Some(tx), Some(s)) = (reply, l.first.take()) {
                    let done = PrefillDone {
                        cached_tokens: l.cached as u32,
                        first_token: s.token,
                        logprob: s.logprob,
                        top: s.top,
                        phases: l.clock.laps().to_vec(),
                        prompt_logprobs: std::mem::take(&mut l.prompt_logprobs),
                    };
                    let _ = tx.send(Ok(done));
                }
            }
            (closed, result) => {
                let why = match (closed, result) {
                    (Some(a), _) => PrefillError::Closed(a.clone()),
                    (None, Err(e)) => PrefillError::TransferFailed(e),
                    (None, Ok(())) => PrefillError::Closed("transfer ended early".into()),
                };
                metrics::counter!(m::REQUESTS, "role" => "prefill", "outcome" => "error").increment(1);
                let _in = l.span.enter();
                if closed.is_none() {
                    tracing::warn!(room = %room, reason = %why, "room failed");
                } else {
                    tracing::debug!(room = %room, reason = %why, "room ended");
                }
                if let Some(tx) = reply {
                    let _ = tx.send(Err(why));
                }
            }
        }
        self.release(room, l);
    }

    /// Frees what a room holds: its scheduler entry (queued or computing) or its computed
    /// pages (unlocking the cache node).
    pub(super) fn release(&mut self, room: Room, l: Live) {
        if let Some(p) = l.prefilled {
            self.cache.unlock(p.node);
            drop(p.tail);
            drop(p.duplicates);
        } else {
            self.sched.abort(room.get(), &mut self.cache);
        }
    }

    /// Fails a live room: tells the caller, stops the room task; frees now when no page is on
    /// the wire, else when the task reports.
    pub(super) fn fail(&mut self, room: Room, why: PrefillError) {
        // The id stays taken until the room task reports (`sent`); a room still bootstrapping
        // (no task) leaves now, its caller answered.
        for a in self.rooms.on(Event::Close { room, why: why.to_string() }, Instant::now()) {
            if let Action::Gone(gone) = a {
                self.abandon(gone, why.clone());
            }
        }
        let Some(l) = self.rooms.live_mut(room) else { return };
        if let Some(tx) = l.reply.take() {
            let _ = tx.send(Err(why));
        }
        // Dropping the chunk channel makes the task abort the room and report.
        l.chunks = None;
    }

    /// A room left the queue by abort or timeout.
    pub(super) fn abandon(&mut self, gone: Expired<NewRequest, Handshake>, why: PrefillError) {
        if let Some(r) = gone.request {
            let _ = r.reply.send(Err(why.clone()));
        }
        if let Some(h) = gone.handshake {
            let (room, secret, reason) = (gone.room, gone.secret, why.to_string());
            self.rt.spawn(async move {
                let _ = h.sender.abort(room, secret, &reason).await;
            });
        }
        if gone.phase != Phase::Bootstrap {
            self.fail(gone.room, why);
        }
    }

    pub(super) fn expire(&mut self, now: Instant) {
        for a in self.rooms.on(Event::Tick, now) {
            if let Action::Gone(gone) = a {
                self.timed_out(gone);
            }
        }
    }

    /// A room that timed out.
    pub(super) fn timed_out(&mut self, gone: Expired<NewRequest, Handshake>) {
        let why = PrefillError::Timeout(gone.phase.label());
        let span = self.rooms.live(gone.room).map(|l| l.span.clone());
        let span = span.or_else(|| gone.request.as_ref().map(|r| r.span.clone())).unwrap_or_else(tracing::Span::none);
        tracing::warn!(parent: &span, room = %gone.room, phase = gone.phase.label(), "room timed out");
        self.abandon(gone, why);
    }
}
