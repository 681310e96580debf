//! A room's way in: the prompt checked against the model and the pool, then — with the
//! request and the decode node's handshake both here — its transfer task started and the
//! prompt queued in the scheduler.

use std::sync::Arc;
use std::time::Instant;

use ferry_cluster::{Room, RoomSecret};
use ferry_engine::{Sampler, SamplingParams};
use ferry_kernels::Backend;
use ferry_transfer::SendRoom;
use tokio::sync::mpsc;

use super::{Engine, Handshake, Live, NewRequest};
use crate::error::PrefillError;
use crate::room_task::RoomTask;
use crate::rooms::{Action, Event};

impl<B: Backend> Engine<B> {
    pub(super) fn check_prompt(&self, tokens: &[u32], sampling: &SamplingParams) -> Result<(), PrefillError> {
        let req = ferry_engine::Request { prompt: tokens.to_vec(), params: sampling.clone() };
        ferry_engine::generate::validate(&self.model, &req).map_err(|e| {
            let reason = if tokens.len() >= self.model.config().max_position_embeddings {
                "prompt_too_long"
            } else {
                "invalid_request"
            };
            PrefillError::invalid(reason, e.to_string())
        })?;
        let pages = self.pool.pages_for(tokens.len());
        if pages > self.pool.num_pages() {
            return Err(PrefillError::PromptOverPool { pages, pool: self.pool.num_pages() });
        }
        Ok(())
    }

    /// Both halves are here: check the handshake against the prompt, start the room task, queue.
    pub(super) fn admit(&mut self, room: Room, secret: RoomSecret, r: NewRequest, h: Handshake) {
        let need = self.pool.pages_for(r.tokens.len());
        if h.held.checked_add(h.dest.len()) != Some(need) {
            let why = format!(
                "the handshake names {} destination pages after {} held; the prompt needs {need}",
                h.dest.len(),
                h.held
            );
            let _ = r.reply.send(Err(PrefillError::invalid("dest_pages_mismatch", why)));
            self.rooms.on(Event::Finished(room), Instant::now());
            let sender = h.sender;
            self.rt.spawn(async move {
                let _ = sender.abort(room, secret, "destination page count does not fit the prompt").await;
            });
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut send_room = SendRoom::new(room, secret, self.cfg.timeouts, Instant::now());
        if let Err(e) = send_room.handshake_held(Arc::clone(&h.sender), h.dest.clone(), h.held, Instant::now()) {
            let _ = r.reply.send(Err(PrefillError::Internal { reason: "room_state", message: format!("{e:?}") }));
            self.rooms.on(Event::Finished(room), Instant::now());
            return;
        }
        let limit = self.cfg.timeouts.transferring;
        let task = RoomTask {
            mem: Arc::clone(self.kv.mem()),
            engine: self.cmds.clone(),
            limit,
            senders: Arc::clone(&self.cfg.senders),
            sender: h.sender,
            reconnect: h.reconnect,
            secret,
        };
        self.rt.spawn(task.run(send_room, rx));
        let uncached = r.sampling.prompt_logprobs.is_some();
        // Queued now, or once the held pages it pulls are here.
        let ticket = if uncached { None } else { self.start_pull(room, secret, &r, h.held) };
        let pulling = ticket.map(|t| (t, r.priority));
        if pulling.is_none() {
            self.sched.add_request(room.get(), r.tokens.clone(), r.priority, uncached, &self.cache);
        }
        let sampler = Sampler::new(r.sampling, &r.tokens).guided(r.guide);
        let live = Live {
            tokens: r.tokens,
            sampler,
            reply: Some(r.reply),
            chunks: Some(tx),
            sent: 0,
            cached: 0,
            first: None,
            prompt_logprobs: Vec::new(),
            prefilled: None,
            pulling,
            span: r.span,
            clock: ferry_cluster::phases::PhaseClock::start("prefill", Instant::now()),
            started: false,
        };
        for a in self.rooms.on(Event::Started { room, live }, Instant::now()) {
            // No room waiting for it (it cannot happen: the pair was just made).
            if let Action::Finished { live: Some(l), .. } = a {
                self.release(room, l);
            }
        }
    }
}
