//! The recency order of a shard's nodes, for eviction: two doubly linked lists through a table
//! indexed by node id — nodes only placed (provisional) and nodes some worker holds — each
//! from the least to the most recently used. Every operation is O(1) and allocates nothing
//! once the table has grown to the tree's size.
//!
//! A shard moves a path to the newest end deepest node first, so a parent is always newer
//! than its children: the oldest node of a list has no children in it, and the oldest
//! provisional node is a leaf (a worker holding a child holds its parent).

use ferry_radix::NodeId;

/// Which list a node is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum List {
    /// No worker's events confirm the node: the router's placements only.
    Provisional = 0,
    /// Some worker holds the node.
    Held = 1,
}

#[derive(Debug, Clone, Copy, Default)]
struct Link {
    prev: Option<NodeId>,
    next: Option<NodeId>,
    list: Option<List>,
}

/// Two recency lists of node ids.
#[derive(Debug, Default)]
pub struct Lru {
    links: Vec<Link>,
    /// (oldest, newest) of each list.
    ends: [(Option<NodeId>, Option<NodeId>); 2],
}

impl Lru {
    fn link(&mut self, id: NodeId) -> &mut Link {
        let i = id.index();
        if self.links.len() <= i {
            self.links.resize(i + 1, Link::default());
        }
        &mut self.links[i]
    }

    /// Takes `id` out of its list (nothing when it is in none).
    pub fn unlink(&mut self, id: NodeId) {
        let Link { prev, next, list } = std::mem::take(self.link(id));
        let Some(list) = list else { return };
        let ends = &mut self.ends[list as usize];
        match prev {
            Some(p) => self.links[p.index()].next = next,
            None => ends.0 = next,
        }
        match next {
            Some(n) => self.links[n.index()].prev = prev,
            None => ends.1 = prev,
        }
    }

    /// Makes `id` the newest of `list` (taking it out of where it was).
    pub fn touch(&mut self, id: NodeId, list: List) {
        self.unlink(id);
        let newest = self.ends[list as usize].1;
        *self.link(id) = Link { prev: newest, next: None, list: Some(list) };
        match newest {
            Some(n) => self.links[n.index()].next = Some(id),
            None => self.ends[list as usize].0 = Some(id),
        }
        self.ends[list as usize].1 = Some(id);
    }

    /// Puts `id` just newer than `anchor`, in its list (a node split off above `anchor`).
    pub fn after(&mut self, anchor: NodeId, id: NodeId) {
        self.unlink(id);
        let a = *self.link(anchor);
        let Some(list) = a.list else { return };
        *self.link(id) = Link { prev: Some(anchor), next: a.next, list: Some(list) };
        self.links[anchor.index()].next = Some(id);
        match a.next {
            Some(n) => self.links[n.index()].prev = Some(id),
            None => self.ends[list as usize].1 = Some(id),
        }
    }

    /// The least recently used node of `list`.
    pub fn oldest(&self, list: List) -> Option<NodeId> {
        self.ends[list as usize].0
    }

    /// The node used just after `id` in its list.
    pub fn newer(&self, id: NodeId) -> Option<NodeId> {
        self.links.get(id.index()).and_then(|l| l.next)
    }

    /// The list `id` is in.
    #[cfg(test)]
    pub fn list(&self, id: NodeId) -> Option<List> {
        self.links.get(id.index()).and_then(|l| l.list)
    }
}
