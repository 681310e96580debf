//! A request's way in and out of the engine: validated and queued, admitted (pages, the
//! receiver room, the handshake), its transfer's outcome, timeouts, and its end (the last
//! message, the room closed, the pages freed once no write can land in them).

use std::time::Instant;

use ferry_cluster::Room;
use ferry_cluster::metrics as m;
use ferry_engine::{FinishReason, Sampled, Sampler};
use ferry_kernels::Backend;
use ferry_transfer::table::Outcome;
use tokio::sync::oneshot;

use super::{Engine, Generate, Req, shutting_down};
use crate::error::DecodeError;
use crate::queues::{Action, Event, Stage};

impl<B: Backend> Engine<B> {
    /// Validates and queues a request.
    #[allow(clippy::result_large_err)]
    pub(super) fn accept(
        &mut self,
        g: Box<Generate>,
    ) -> Result<(), (DecodeError, oneshot::Sender<Result<(), DecodeError>>)> {
        let Generate { key, incarnation, bootstrap, prompt, params, guide, forks, out, accepted, span, trace } = *g;
        if self.stopping {
            return Err((shutting_down(), accepted));
        }
        let req = ferry_engine::Request { prompt: prompt.clone(), params: params.clone() };
        if let Err(e) = ferry_engine::generate::validate(&self.model, &req) {
            let ctx = self.model.config().max_position_embeddings;
            let reason = if prompt.len() >= ctx { "prompt_too_long" } else { "invalid_request" };
            return Err((DecodeError::invalid(reason, e.to_string()), accepted));
        }
        let ctx = self.model.config().max_position_embeddings;
        let remaining = (params.max_new_tokens as usize).min(ctx - prompt.len());
        let room = key.room;
        let ev = Event::Request {
            room,
            prompt: prompt.len(),
            limit: remaining,
            local: bootstrap.is_none(),
            n: params.n.max(1) as usize,
            forks: forks.len(),
        };
        if let Some(Action::Refuse(why)) = self.queues.on(ev, Instant::now()).into_iter().next() {
            return Err((DecodeError::Refused { why, room }, accepted));
        }
        let forks = (1..).zip(forks).map(|(i, g)| Sampler::new(params.sequence(i), &prompt).guided(g)).collect();
        let sampler = Sampler::new(params.sequence(0), &prompt).guided(guide);
        let r = Req {
            key,
            incarnation,
            prompt,
            sampler,
            out,
            pages: None,
            computed: 0,
            generated: Vec::new(),
            behind: 0,
            prompt_logprobs: Vec::new(),
            first: None,
            bootstrap,
            retracted_at: None,
            span,
            trace,
            clock: ferry_cluster::phases::PhaseClock::start("decode", Instant::now()),
            index: 0,
            family: room,
            forks,
            cached: None,
            held: 0,
            pulls: Vec::new(),
            hit: 0,
        };
        self.reqs.insert(room, r);
        let _ = accepted.send(Ok(()));
        Ok(())
    }

    /// Admits what fits: allocates prompt pages, opens the room and starts the handshake (or
    /// starts prefilling here).
    pub(super) fn admit(&mut self, now: Instant) {
        if self.stopping {
            return;
        }
        for a in self.queues.on(Event::Admit, now) {
            self.act(a, now);
        }
    }

    /// A room's transfer ended (`outcome`; None: the room vanished): while the request is
    /// still in Transfer, its pages reach the device and it waits to join the batch, or it
    /// fails with the transfer's reason. A late report changes nothing (the queues decide).
    pub(super) fn transferred(&mut self, room: Room, outcome: Option<Outcome>, now: Instant) {
        let ok = matches!(outcome, Some(Outcome::Success(_)));
        for a in self.queues.on(Event::TransferEnded { room, ok }, now) {
            match (a, &outcome) {
                (Action::Land(_), Some(Outcome::Success(aux))) => self.land(room, aux, now),
                (Action::Fail(_), Some(Outcome::Failed(reason))) => {
                    self.end(room, Err(DecodeError::Transfer(reason.clone())))
                }
                (Action::Fail(_), _) => self.end(room, Err(DecodeError::RoomLost)),
                (a, _) => self.act(a, now),
            }
        }
    }

    /// A handshake failed (`why`): the request ends with it while still in Transfer.
    pub(super) fn handshake_failed(&mut self, room: Room, why: DecodeError, now: Instant) {
        for a in self.queues.on(Event::TransferEnded { room, ok: false }, now) {
            match a {
                Action::Fail(_) => self.end(room, Err(why.clone())),
                a => self.act(a, now),
            }
        }
    }

    /// Every page of `room` arrived (`aux`: the first token): they reach the device and it
    /// waits to join the batch.
    fn land(&mut self, room: Room, aux: &ferry_transfer::frame::Aux, now: Instant) {
        let Some(r) = self.reqs.get_mut(&room) else { return };
        r.clock.lap("transfer", now);
        self.receiver.close(room);
        r.first = Some(Sampled { token: aux.first_token, logprob: aux.logprob, top: Vec::new() });
        // The pages the prefill node sent (the held ones are the cache's, on the device).
        let pages = &r.prompt_pages(self.pool.layout().page_size)[r.held..];
        // SAFETY: the room is complete and closed: every write into its pages has landed and
        // no other is accepted; the request owns the pages.
        match unsafe { self.kv.to_device(self.model.backend(), &self.pool, pages) } {
            Ok(()) => {
                self.queues.on(Event::Transferred(room), now);
                self.fork(room, now);
            }
            Err(e) => {
                let why = DecodeError::internal("kv_copy", format!("copying the KV pages in: {e}"));
                self.end(room, Err(why));
            }
        }
    }

    /// Requests past their stage's timeout.
    pub(super) fn expire(&mut self, now: Instant) {
        for a in self.queues.on(Event::Tick, now) {
            self.act(a, now);
        }
    }

    /// Ends a request: a last message to the client, its room closed, its pages freed (after
    /// any write still landing in them).
    pub(super) fn end(&mut self, room: Room, result: Result<FinishReason, DecodeError>) {
        self.close(room, result, true);
    }

    /// [`end`](Self::end), telling the client of an error only when `tell` (a sequence the
    /// router no longer wants ends quietly: the request's stream goes on for the others).
    pub(super) fn close(&mut self, room: Room, result: Result<FinishReason, DecodeError>, tell: bool) {
        let stage = self.queues.stage(room);
        let Some(mut r) = self.reqs.remove(&room) else { return };
        let outcome = match &result {
            Ok(f) => f.as_str(),
            Err(e) if e.is_abort() => "abort",
            Err(_) => "error",
        };
        metrics::counter!(m::REQUESTS, "role" => "decode", "outcome" => outcome).increment(1);
        if let Err(why) = result {
            // A failure is an operator's business; a client or router that went away is not.
            let stage = stage.map(Stage::label);
            let _in = r.span.enter();
            if outcome == "error" {
                tracing::warn!(room = %room, ?stage, error = ?why, "request failed");
            } else {
                tracing::debug!(room = %room, ?stage, error = ?why, "request ended");
            }
            if tell {
                let _ = r.out.send(Err(why));
            }
        }
        let mut released = None;
        if stage == Some(Stage::Transfer) {
            self.receiver.close(room);
            released = self.receiver.inbox().released(room);
        }
        // Kept in the prefix cache, unless kept aside until the last write lands.
        let mut pages = r.pages.take();
        // Pages aside only when it has some (a request whose allocation failed has none).
        let writing = released.is_some() && pages.is_some();
        for a in self.queues.on(Event::End { room, writing }, Instant::now()) {
            if let Action::Drain { .. } = a
                && let (Some(p), Some(released)) = (pages.take(), released.take())
            {
                // Its cached prefix stays locked while the room drains: the queues count it
                // among the draining pages until the last write lands.
                self.draining.push((room, p, r.cached.take()));
                self.wake.released(room, released);
            }
        }
        // The KV its pages hold: a transfer's only once complete.
        let kv = match stage {
            Some(Stage::Running) => r.kv_target() - r.behind,
            Some(Stage::Prefill) => r.computed,
            Some(Stage::Waiting) => r.prompt.len(),
            _ => 0,
        };
        self.keep(&mut r, pages, kv);
    }
}
