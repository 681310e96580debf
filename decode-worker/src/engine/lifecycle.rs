//! A request's way in and out of the engine: validated and queued, admitted (pages, the
//! receiver room, the handshake), its transfer's outcome, timeouts, and its end (the last
//! message, the room closed, the pages freed once no write can land in them).

use std::time::Instant;

use ferry_cluster::metrics as m;
use ferry_cluster::{Refused, Room};
use ferry_engine::{FinishReason, Sampled, Sampler};
use ferry_kernels::Backend;
use ferry_transfer::room::FailReason;
use ferry_transfer::table::Outcome;
use tokio::sync::oneshot;
use tonic::Code;

use super::{Engine, Generate, Req, shutting_down};
use crate::queues::{Action, Event, Queues, Stage};

impl<B: Backend> Engine<B> {
    /// Validates and queues a request.
    #[allow(clippy::result_large_err)]
    pub(super) fn accept(&mut self, g: Box<Generate>) -> Result<(), (Refused, oneshot::Sender<Result<(), Refused>>)> {
        let Generate { key, incarnation, bootstrap, prompt, params, guide, forks, out, accepted, span, trace } = *g;
        if self.stopping {
            return Err((shutting_down(), accepted));
        }
        let req = ferry_engine::Request { prompt: prompt.clone(), params: params.clone() };
        if let Err(e) = ferry_engine::generate::validate(&self.model, &req) {
            let ctx = self.model.config().max_position_embeddings;
            let reason = if prompt.len() >= ctx { "prompt_too_long" } else { "invalid_request" };
            return Err((Refused::invalid(reason, e.to_string()), accepted));
        }
        let ctx = self.model.config().max_position_embeddings;
        let remaining = (params.max_new_tokens as usize).min(ctx - prompt.len());
        let n = params.n.max(1) as usize;
        if n > self.cfg.limits.max_running {
            let why = format!("n = {n} sequences: this decode worker runs at most {}", self.cfg.limits.max_running);
            return Err((Refused::new(Code::OutOfRange, "n_over_batch", why), accepted));
        }
        // Whole, never half way: a request whose prompt and max tokens cannot fit the pool
        // even alone is refused now; any other is admitted in time and never cut. Forked
        // sequences share the prompt's full pages.
        let ps = self.pool.layout().page_size;
        let whole = ferry_cluster::fork_pages(prompt.len(), prompt.len() + remaining, n, ps);
        if !Queues::could_fit(self.pool.num_pages(), whole) {
            let seqs = if n > 1 { format!(" for {n} sequences") } else { String::new() };
            let why = format!(
                "the prompt ({} tokens) and max_tokens ({remaining}){seqs} need {whole} KV pages; this decode worker has {}: lower max_tokens",
                prompt.len(),
                self.pool.num_pages()
            );
            return Err((Refused::new(Code::OutOfRange, "request_over_pool", why), accepted));
        }
        if forks.len() != n - 1 {
            let why = format!("{} constraints for {} more sequences", forks.len(), n - 1);
            return Err((Refused::new(Code::Internal, "fork_constraints", why), accepted));
        }
        let room = key.room;
        let ev = Event::Request { room, prompt: prompt.len(), limit: remaining, local: bootstrap.is_none(), n };
        if let Some(Action::Refuse(why)) = self.queues.on(ev, Instant::now()).into_iter().next() {
            return Err((Refused::new(Code::AlreadyExists, why.label(), why.message(room)), accepted));
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

    /// A room's transfer ended: its pages reach the device and it waits to join the batch, or
    /// the request fails with the transfer's reason.
    pub(super) fn transferred(&mut self, room: Room, outcome: Option<Outcome>, now: Instant) {
        let aux = match outcome {
            Some(Outcome::Success(aux)) => aux,
            Some(Outcome::Failed(reason)) => return self.end(room, Err(transfer_refusal(&reason))),
            None => {
                return self.end(room, Err(Refused::new(Code::Internal, "room_lost", "the transfer room vanished")));
            }
        };
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
                let why = Refused::new(Code::Internal, "kv_copy", format!("copying the KV pages in: {e}"));
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
    pub(super) fn end(&mut self, room: Room, result: Result<FinishReason, Refused>) {
        self.close(room, result, true);
    }

    /// [`end`](Self::end), telling the client of an error only when `tell` (a sequence the
    /// router no longer wants ends quietly: the request's stream goes on for the others).
    pub(super) fn close(&mut self, room: Room, result: Result<FinishReason, Refused>, tell: bool) {
        let stage = self.queues.stage(room);
        let Some(mut r) = self.reqs.remove(&room) else { return };
        let outcome = match &result {
            Ok(f) => f.as_str(),
            Err(e) if e.code == Code::Cancelled || e.code == Code::Aborted => "abort",
            Err(_) => "error",
        };
        metrics::counter!(m::REQUESTS, "role" => "decode", "outcome" => outcome).increment(1);
        if let Err(why) = result {
            // A failure is an operator's business; a client or router that went away is not.
            let stage = stage.map(Stage::label);
            let _in = r.span.enter();
            if outcome == "error" {
                tracing::warn!(room = %room, ?stage, reason = why.reason, message = %why.message, "request failed");
            } else {
                tracing::debug!(room = %room, ?stage, reason = why.reason, message = %why.message, "request ended");
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

fn transfer_refusal(r: &FailReason) -> Refused {
    let code = match r {
        FailReason::Timeout(_) => Code::DeadlineExceeded,
        FailReason::Aborted(_) => Code::Aborted,
        FailReason::Corrupt(_) | FailReason::PeerGone(_) => Code::Unavailable,
        FailReason::Refused(_) => Code::FailedPrecondition,
    };
    Refused::new(code, r.label(), format!("KV transfer failed: {r:?}"))
}
