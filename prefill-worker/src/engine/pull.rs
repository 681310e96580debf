//! The engine's side of a pull ([`crate::pull`]): deciding to pull, and caching what came.

use ferry_cluster::metrics as m;
use ferry_cluster::{Room, RoomSecret};
use ferry_kernels::Backend;

use super::{Engine, NewRequest};
use crate::error::PullError;
use crate::pull::{PullJob, Pulled};
use crate::rooms::Phase;

impl<B: Backend> Engine<B> {
    /// Starts pulling the leading pages of `r`'s prompt that its decode node holds (`held`)
    /// and this node's cache lacks, when the router allowed it and this node can: pages
    /// allocated (evicting cached ones when short), the cached prefix before them locked.
    /// Returns the pull's ticket; None: nothing to pull, and the prompt is queued now.
    pub(super) fn start_pull(&mut self, room: Room, secret: RoomSecret, r: &NewRequest, held: usize) -> Option<u64> {
        let (Some(from), Some(puller)) = (&r.pull_from, &self.cfg.puller) else { return None };
        let ps = self.pool.layout().page_size;
        // The prompt's last token is always computed here (its logits give the first token).
        let held = held.min(r.tokens.len().saturating_sub(1) / ps);
        let tokens = &r.tokens[..held * ps];
        let m = self.cache.match_prefix(tokens);
        let first = m.pages.len();
        if first >= held {
            return None;
        }
        self.cache.lock(m.node);
        let pages = match self.cache.alloc(&self.pool, held - first) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(room = %room, error = %e, "no pages to pull into; computing the prompt");
                self.cache.unlock(m.node);
                return None;
            }
        };
        self.pulls += 1;
        self.pull_tickets += 1;
        let ticket = self.pull_tickets;
        let job =
            PullJob { room, secret, ticket, from: from.clone(), first, pages, node: m.node, tokens: tokens.to_vec() };
        puller.start(job);
        Some(ticket)
    }

    /// A pull ended: its pages are cached (copied to the device first when the pool has a
    /// host mirror) or freed, and its room, if still here, is queued.
    pub(super) fn pulled(&mut self, p: Pulled) {
        self.pulls -= 1;
        let Pulled { job, result } = p;
        let n = job.pages.len();
        let result = result.and_then(|got| {
            // SAFETY: the pull receiver closed the room: nothing writes these pages' mirror.
            unsafe { self.kv.to_device(self.model.backend(), &self.pool, job.pages.pages()) }
                .map(|()| got)
                .map_err(|e| PullError::Copy(e.to_string()))
        });
        match result {
            Ok(_) => {
                // Cached whether or not its room is still here: the KV is the prompt's.
                self.cache.insert(&job.tokens, job.first, job.pages, 0);
                metrics::counter!(m::PULLS, "outcome" => "ok").increment(1);
                metrics::counter!(m::PULL_PAGES, "role" => "prefill").increment(n as u64);
            }
            Err(why) => {
                tracing::warn!(room = %job.room, from = %job.from, reason = %why, "pull failed; computing the prompt");
                metrics::counter!(m::PULLS, "outcome" => "failed").increment(1);
                drop(job.pages);
            }
        }
        self.cache.unlock(job.node);
        let closing = self.rooms.phase(job.room) == Some(Phase::Closing);
        let Some(l) = self.rooms.live_mut(job.room) else { return };
        // Only the room that started this pull (a later room may have taken its id).
        let Some((_, priority)) = l.pulling.take_if(|p| p.0 == job.ticket) else { return };
        if !closing {
            let tokens = l.tokens.clone();
            self.sched.add_request(job.room.get(), tokens, priority, false, &self.cache);
        }
    }
}
