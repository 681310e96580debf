//! Making room and taking nodes out: eviction by recency, and the removal of a subtree from
//! the tree, the recency order and the page table.

use ferry_radix::NodeId;

use super::{List, Mode, Shard};

impl Shard {
    /// Evicts leaves, least recently used first and pages only placed before pages some worker
    /// confirmed, until `need` pages are free; never a node of `keep` (the path being covered).
    pub(super) fn evict(&mut self, need: usize, keep: &[NodeId]) {
        let mut freed = 0;
        for list in [List::Provisional, List::Held] {
            let mut at = self.lru.oldest(list);
            while let Some(id) = at {
                if freed >= need {
                    break;
                }
                // A parent is newer than its children: once they go it is met again, a leaf.
                at = self.lru.newer(id);
                if !keep.contains(&id) && self.tree.child_count(id) == 0 {
                    freed += self.tree.pages(id);
                    self.lost |= list == List::Held;
                    self.remove_subtree(id);
                }
            }
        }
        self.evicted += freed as u64;
    }

    /// Drops page `h` from the table.
    pub(super) fn forget(&mut self, h: u64) {
        if self.mode != Mode::Replay {
            self.pages.remove(&h);
        }
    }

    /// Removes `root` and every node below it, children before their parents, in an order
    /// set by the nodes' ids (both copies of the shared index free the same ids alike, and
    /// so make the same ids next: the one page table names nodes by id).
    pub(super) fn remove_subtree(&mut self, root: NodeId) {
        if self.tree.child_count(root) == 0 {
            // A leaf (as every eviction removes): no walk to allocate.
            self.remove_one(root);
            return;
        }
        for n in self.tree.walk_below(root).into_iter().rev() {
            self.remove_one(n);
        }
    }

    /// Removes leaf `n` from the tree, the recency order and (its pages) the table.
    fn remove_one(&mut self, n: NodeId) {
        let pages = self.tree.pages(n);
        self.lru.unlink(n);
        if let Some(r) = self.tree.remove_leaf(n) {
            self.count -= pages;
            if r.confirmed {
                for h in r.hashes {
                    self.forget(h);
                }
            }
        }
    }
}
