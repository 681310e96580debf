//! Prompt tokens this router has sent each prefill worker and not yet seen computed: a
//! worker's own report of its queue comes a poll interval late (`--load-poll`), so a burst
//! of requests sharing a cached prefix all saw the worker holding it idle and all went there
//! while another prefill worker idled. Placement scores a worker's queue as the larger of
//! what it reported and what this router has pending there (the report counts this router's
//! requests too once they arrive, and other routers' besides).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::placement::PrefillBoard;

/// Pending prompt tokens by prefill slot and the serial of the worker holding it ([`Board`]:
/// a slot may change hands while a request is pending on its old holder).
///
/// [`Board`]: super::Board
#[derive(Debug, Default)]
pub struct PrefillPending {
    tokens: Mutex<HashMap<(usize, u64), u64>>,
}

/// A request's prompt tokens pending on one prefill worker, until dropped (its prefill
/// ended: the first token came, or the attempt failed).
#[derive(Debug)]
pub struct Pending {
    table: Arc<PrefillPending>,
    key: (usize, u64),
    tokens: u64,
}

impl PrefillPending {
    /// Counts `tokens` pending on the worker `serial` in `slot` while the guard lives.
    pub fn add(self: &Arc<Self>, slot: usize, serial: u64, tokens: u64) -> Pending {
        *self.tokens.lock().entry((slot, serial)).or_default() += tokens;
        Pending { table: Arc::clone(self), key: (slot, serial), tokens }
    }

    /// Writes into `out` the pending tokens of each slot of `board` whose holder has some
    /// (a slot's earlier holder's are not its successor's).
    pub fn by_slot(&self, board: &PrefillBoard, out: &mut Vec<(usize, f64)>) {
        out.clear();
        let tokens = self.tokens.lock();
        out.extend(
            tokens
                .iter()
                .filter(|((slot, serial), _)| board.holder(*slot) == *serial)
                .map(|(&(s, _), &t)| (s, t as f64)),
        );
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut tokens = self.table.tokens.lock();
        if let Some(t) = tokens.get_mut(&self.key) {
            *t = t.saturating_sub(self.tokens);
            if *t == 0 {
                tokens.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::PrefillState;

    /// Pending tokens add up per worker, leave with their guards, and are a slot's holder's
    /// only.
    #[test]
    fn pending_tokens_are_their_holders_until_their_guards_drop() {
        let table = Arc::new(PrefillPending::default());
        let mut board = PrefillBoard::from_states(&[PrefillState::new(true, 0, 1.0); 3]);
        board.hold(0, 7);
        board.hold(2, 9);
        let mut out = Vec::new();
        let seen = |out: &mut Vec<(usize, f64)>, board: &PrefillBoard| {
            table.by_slot(board, out);
            out.sort_by_key(|&(s, _)| s);
            out.clone()
        };
        let a = table.add(0, 7, 100);
        let b = table.add(0, 7, 20);
        let c = table.add(2, 9, 5);
        assert_eq!(seen(&mut out, &board), [(0, 120.0), (2, 5.0)]);
        drop(a);
        assert_eq!(seen(&mut out, &board), [(0, 20.0), (2, 5.0)]);
        // Slot 2 changes hands: its old holder's pending tokens are not the newcomer's.
        board.hold(2, 10);
        assert_eq!(seen(&mut out, &board), [(0, 20.0)]);
        drop((b, c));
        assert_eq!(seen(&mut out, &board), []);
        assert!(table.tokens.lock().is_empty(), "nothing left behind");
    }
}
