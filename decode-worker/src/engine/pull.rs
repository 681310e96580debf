//! Lending a room's held pages to a prefill node that pulls them (issue 20): a conversation's
//! earlier turns and answers live in this node's prefix cache, which no prefill node has;
//! instead of computing them again, the prefill node the router chose asks for them
//! (`Holder.Pull`, [`crate::holder`]) and computes only the rest.
//!
//! The pages stay the room's: they are its cached prefix, locked while it holds them. A pull
//! takes no lock of its own (the queues would count a locked page of an ended request as
//! free); instead the room spoils its pulls when it lets its prefix go ([`Engine::keep`]: it
//! ended or was retracted), and a pull whose pages were sent reports success only when it was
//! not spoiled — so a page evicted and reused while it was read is never cached on the
//! prefill node.

use ferry_cluster::{Room, RoomSecret};
use ferry_kernels::Backend;

use super::Engine;
use crate::error::DecodeError;
use crate::queues::Stage;

impl<B: Backend> Engine<B> {
    /// Lends `n` held pages of `room` from prompt page `first` on to a new pull: its id and
    /// the pages (copied to the host mirror first, when the pool has one).
    pub(super) fn lend(
        &mut self,
        room: Room,
        secret: RoomSecret,
        first: usize,
        n: usize,
    ) -> Result<(u64, Vec<u32>), DecodeError> {
        let page_size = self.pool.layout().page_size;
        let Some(r) = self.reqs.get_mut(&room) else {
            return Err(DecodeError::NoSuchRoom(room));
        };
        if r.key.secret != secret {
            return Err(DecodeError::WrongSecret(room));
        }
        if self.queues.stage(room) != Some(Stage::Transfer) {
            return Err(DecodeError::NotTransferring(room));
        }
        let end = first.checked_add(n).filter(|&e| e <= r.held && n > 0);
        let Some(end) = end else {
            let why = format!("pages {first}..{} asked for; the room holds {} pages", first.saturating_add(n), r.held);
            return Err(DecodeError::invalid("pull_pages", why));
        };
        let pages = r.prompt_pages(page_size)[first..end].to_vec();
        // SAFETY: cached pages are no transfer's destination: nothing writes their mirror.
        if let Err(e) = unsafe { self.kv.to_host(self.model.backend(), &self.pool, &pages) } {
            return Err(DecodeError::internal("kv_mirror", e.to_string()));
        }
        self.next_pull += 1;
        let id = self.next_pull;
        r.pulls.push(id);
        self.pulls.insert(id);
        Ok((id, pages))
    }
}
