//! A shard lent the shared events' index's one page table, and a trace, for one change.

use super::super::table::{Mode, PageTable, Trace};
use super::Shard;

/// A shard lent a page table and a trace for one change, given back when it ends, even by a
/// panic (the writer's one table would otherwise stay in a copy).
pub(super) struct Lent<'a> {
    pub(super) shard: &'a mut Shard,
    table: Option<&'a mut PageTable>,
    trace: &'a mut Trace,
}

impl<'a> Lent<'a> {
    pub(super) fn new(
        shard: &'a mut Shard,
        mode: Mode,
        mut table: Option<&'a mut PageTable>,
        trace: &'a mut Trace,
    ) -> Self {
        if let Some(t) = table.as_deref_mut() {
            std::mem::swap(&mut shard.pages, t);
        }
        std::mem::swap(&mut shard.trace, trace);
        shard.mode = mode;
        Self { shard, table, trace }
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        self.shard.mode = Mode::Own;
        std::mem::swap(&mut self.shard.trace, self.trace);
        if let Some(t) = self.table.as_deref_mut() {
            std::mem::swap(&mut self.shard.pages, t);
        }
    }
}
