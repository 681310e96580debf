//! The head cache's tree of segments ([`super::HeadCache`]): each node a segment's text and
//! ids below its parent, found by (parent, hash of its text), its leaves kept in order of last
//! use so that eviction takes the least recently used one without a scan.

use std::collections::{BTreeSet, HashMap};

/// The parent of a conversation's first segment.
pub(super) const ROOT: u32 = u32::MAX;
/// Bytes a node costs beyond its text and ids (node, map entry, allocations).
pub(super) const NODE_OVERHEAD: usize = 96;

/// A segment: its text and ids, below its parent.
pub(super) struct Node {
    parent: u32,
    key: u64,
    pub(super) text: Box<str>,
    pub(super) ids: Box<[u32]>,
    pub(super) children: u32,
    pub(super) used: u64,
    /// Bumped when the slot is reused, so a path read before eviction is not extended after.
    pub(super) generation: u32,
    pub(super) alive: bool,
}

/// The segments, the free slots among them, and the leaves in order of last use.
#[derive(Default)]
pub(super) struct Tree {
    pub(super) nodes: Vec<Node>,
    free: Vec<u32>,
    pub(super) by_key: HashMap<(u32, u64), u32>,
    /// The nodes without children, least recently used first: what eviction takes, one at a
    /// time (no scan of the tree, so no pause that grows with the cache).
    pub(super) leaves: BTreeSet<(u64, u32)>,
    pub(super) bytes: usize,
    clock: u64,
}

impl Tree {
    /// Adds a segment below `parent` (a slot freed by eviction reused, its generation
    /// bumped), used now.
    pub(super) fn add(&mut self, parent: u32, key: u64, text: &str, ids: Vec<u32>) -> u32 {
        self.clock += 1;
        self.bytes += text.len() + 4 * ids.len() + NODE_OVERHEAD;
        let node = Node {
            parent,
            key,
            text: text.into(),
            ids: ids.into_boxed_slice(),
            children: 0,
            used: self.clock,
            generation: 0,
            alive: true,
        };
        let n = match self.free.pop() {
            Some(n) => {
                let generation = self.nodes[n as usize].generation.wrapping_add(1);
                self.nodes[n as usize] = Node { generation, ..node };
                n
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if parent != ROOT {
            let p = &mut self.nodes[parent as usize];
            if p.children == 0 {
                self.leaves.remove(&(p.used, parent));
            }
            p.children += 1;
        }
        self.leaves.insert((self.clock, n));
        self.by_key.insert((parent, key), n);
        n
    }

    /// Marks `n` used now.
    pub(super) fn touch(&mut self, n: u32) {
        self.clock += 1;
        let node = &mut self.nodes[n as usize];
        if node.children == 0 {
            self.leaves.remove(&(node.used, n));
            self.leaves.insert((self.clock, n));
        }
        node.used = self.clock;
    }

    /// Past `max` bytes, forgets least recently used leaves until it is within `max` again; a
    /// parent left without children becomes a leaf.
    pub(super) fn evict(&mut self, max: usize) {
        while self.bytes > max {
            let Some((_, n)) = self.leaves.pop_first() else { return };
            self.remove(n);
        }
    }

    fn remove(&mut self, n: u32) {
        let node = &mut self.nodes[n as usize];
        node.alive = false;
        let (parent, key) = (node.parent, node.key);
        self.bytes -= node.text.len() + 4 * node.ids.len() + NODE_OVERHEAD;
        node.text = Box::from("");
        node.ids = Box::new([]);
        self.by_key.remove(&(parent, key));
        if parent != ROOT {
            let p = &mut self.nodes[parent as usize];
            p.children -= 1;
            if p.children == 0 {
                self.leaves.insert((p.used, parent));
            }
        }
        self.free.push(n);
    }
}
