//! `n` > 1: one prompt, several sequences. Once the prompt's KV is complete (its transfer
//! landed, or its local prefill ended), the request forks: each other sequence becomes a
//! request of its own with a room minted here, its own sampler (random stream `seed + i`)
//! and the same client stream. The prompt's full pages become a prefix they all share; each
//! other sequence gets its own copy of the prompt's last page (copy-on-write: the page every
//! sequence's next token is written into) and prefills the prompt's last token itself,
//! sampling its first token from its own stream. The queues count the pages
//! ([`Event::Fork`]); the pool returns the shared ones with their last reader.

use std::time::Instant;

use ferry_cluster::{Room, RoomKey};
use ferry_kernels::Backend;

use super::{Engine, Req};
use crate::error::DecodeError;
use crate::queues::Event;

impl<B: Backend> Engine<B> {
    /// Forks `room` when it has other sequences waiting (nothing otherwise).
    pub(super) fn fork(&mut self, room: Room, now: Instant) {
        let Some(r) = self.reqs.get_mut(&room) else { return };
        if r.forks.is_empty() {
            return;
        }
        let samplers = std::mem::take(&mut r.forks);
        let len = r.prompt.len();
        let shared = ferry_cluster::fork_shared_pages(len, self.pool.layout().page_size);
        let Some(mut pages) = r.pages.take() else { return };
        // Admitted with the prompt's pages and a page for each other sequence.
        let mut extra = pages.split_off(shared + 1);
        if extra.len() != samplers.len() || pages.len() != shared + 1 {
            let why = format!("{} pages for {} more sequences", extra.len(), samplers.len());
            return self.end(room, Err(DecodeError::internal("fork_pages", why)));
        }
        pages.share_prefix(shared);
        let last = pages.pages()[shared];
        let (mut rooms, mut children) = (Vec::with_capacity(samplers.len()), Vec::with_capacity(samplers.len()));
        for sampler in samplers {
            let own = extra.split_off(extra.len() - 1);
            let to = own.pages()[0];
            if let Err(e) = self.pool.copy_page(self.model.backend(), last, to) {
                let why = DecodeError::internal("kv_copy", format!("copying the prompt's last page: {e}"));
                return self.end(room, Err(why));
            }
            rooms.push(self.mint(&rooms));
            children.push((sampler, pages.fork(own)));
        }
        let Some(r) = self.reqs.get_mut(&room) else { return };
        r.pages = Some(pages);
        self.queues.on(Event::Fork { room, children: rooms.clone() }, now);
        let r = &self.reqs[&room];
        let kids: Vec<(Room, Req)> = (1..)
            .zip(rooms.into_iter().zip(children))
            .map(|(index, (child, (sampler, pages)))| {
                let req = Req {
                    key: RoomKey { room: child, secret: r.key.secret },
                    incarnation: r.incarnation,
                    prompt: r.prompt.clone(),
                    sampler,
                    out: r.out.clone(),
                    pages: Some(pages),
                    // The prompt's KV is here but for its last token, which it computes
                    // (into its own page) to sample its first.
                    computed: len - 1,
                    generated: Vec::new(),
                    prompt_logprobs: Vec::new(),
                    behind: 0,
                    first: None,
                    // Its first token's phase is named as sequence 0's (`first_token` after
                    // a transfer); a retraction makes it local like any request.
                    bootstrap: r.bootstrap.clone(),
                    retracted_at: None,
                    span: r.span.clone(),
                    trace: r.trace,
                    // Its time so far is the request's (admission, transfer): the phases it
                    // reports, should it end last, are the request's whole.
                    clock: r.clock.clone(),
                    index,
                    family: room,
                    forks: Vec::new(),
                    cached: None,
                    held: 0,
                    pulls: Vec::new(),
                    hit: 0,
                };
                (child, req)
            })
            .collect();
        tracing::debug!(parent: &r.span, sequences = kids.len() + 1, shared_pages = shared, "forked");
        self.reqs.extend(kids);
    }

    /// A room no request, draining room or fork group here has (nor `taken`).
    fn mint(&self, taken: &[Room]) -> Room {
        loop {
            let room = Room::random();
            let used = self.reqs.contains_key(&room)
                || self.queues.stage(room).is_some()
                || self.queues.is_draining(room)
                || self.queues.is_grouped(room)
                || taken.contains(&room);
            if !used {
                return room;
            }
        }
    }
}
