//! The radix tree itself.

use std::collections::HashMap;

use smallvec::SmallVec;

use crate::common_prefix;

/// A node's children by their first page. Hashed with foldhash, seeded per process: a
/// match hashes one page per node it passes (and a router's match asks every shard's root),
/// which SipHash took ~35 ns for. foldhash calls itself minimally DoS-resistant: its random
/// seed keeps a prompt's collisions from being known in advance, short of a cryptographic
/// hash.
type Children = HashMap<Box<[u32]>, NodeId, foldhash::fast::RandomState>;

/// A node of a [`RadixTree`]. Ids of removed nodes are reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);

impl NodeId {
    /// The root, which holds no tokens and no payload.
    pub const ROOT: NodeId = NodeId(0);

    /// The id as an index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a node carries for its pages.
pub trait Payload: Sized {
    /// Splits at page `at`: `self` keeps pages `..at`, the returned value holds `at..`.
    /// Per-node metadata (locks, timestamps) belongs to both halves.
    fn split_off(&mut self, at: usize) -> Self;
}

/// A node's tokens, in chunks of whole pages: each at most the tree's chunk size and not
/// empty (a split can leave one shorter than the others). One chunk unless the tree chunks
/// its keys ([`RadixTree::with_chunks`]); two are kept inline.
type Key = SmallVec<[Vec<u32>; 2]>;

struct Node<V> {
    parent: Option<NodeId>,
    key: Key,
    /// Tokens in `key`.
    len: usize,
    children: Children,
    value: Option<V>,
}

impl<V> Node<V> {
    /// The first page of the key, which names the node among its siblings (empty for the
    /// root).
    fn first_page(&self, ps: usize) -> &[u32] {
        self.key.first().map_or(&[], |c| &c[..ps])
    }
}

/// Length of the longest common prefix of `key`'s chunks, read in order, and `tokens`.
fn chunks_prefix(key: &[Vec<u32>], tokens: &[u32]) -> usize {
    let mut n = 0;
    for c in key {
        let k = common_prefix(c, &tokens[n..]);
        n += k;
        if k < c.len() {
            break;
        }
    }
    n
}

/// The path of a match, node by node ([`RadixTree::walk_prefix`]).
pub struct PrefixWalk<'a, V> {
    tree: &'a RadixTree<V>,
    tokens: &'a [u32],
    /// `tokens`' whole pages.
    full: usize,
    /// Tokens matched so far.
    pos: usize,
    /// The node to continue below; None once the match ended inside a node.
    cur: Option<NodeId>,
}

impl<V: Payload> Iterator for PrefixWalk<'_, V> {
    type Item = (NodeId, usize);

    fn next(&mut self) -> Option<(NodeId, usize)> {
        let ps = self.tree.page_size;
        let cur = self.cur?;
        if self.pos + ps > self.full {
            return None;
        }
        let Some(&child) = self.tree.node(cur).and_then(|n| n.children.get(&self.tokens[self.pos..self.pos + ps]))
        else {
            self.cur = None;
            return None;
        };
        let node = self.tree.node(child)?;
        let pages = chunks_prefix(&node.key, &self.tokens[self.pos..self.full]) / ps;
        self.pos += pages * ps;
        self.cur = (pages * ps == node.len).then_some(child);
        Some((child, pages))
    }
}

/// How far a prompt is in the tree.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Match {
    /// Tokens matched, a multiple of the page size.
    pub tokens: usize,
    /// The nodes on the matched path (root excluded) and the pages matched in each; only the
    /// last may be matched partly.
    pub path: Vec<(NodeId, usize)>,
}

impl Match {
    /// The deepest node reached, or None when nothing matched.
    pub fn last(&self) -> Option<NodeId> {
        self.path.last().map(|p| p.0)
    }
}

/// What an insert did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Insert {
    /// Existing nodes that cover the already-present part of the inserted tokens, root
    /// excluded, after any split.
    pub path: Vec<NodeId>,
    /// Pages that were already present.
    pub existing_pages: usize,
    /// The node created for the new pages, if any.
    pub new_node: Option<NodeId>,
    /// A node split to end the existing part on a node boundary: `(upper, lower)`.
    pub split: Option<(NodeId, NodeId)>,
}

impl Insert {
    /// The deepest node covering the inserted tokens.
    pub fn last(&self) -> Option<NodeId> {
        self.new_node.or_else(|| self.path.last().copied())
    }
}

/// A page-granular radix tree over token ids.
pub struct RadixTree<V> {
    page_size: usize,
    /// The most tokens in one chunk of a key (whole pages; unbounded unless
    /// [`Self::with_chunks`] set it).
    chunk: usize,
    nodes: Vec<Option<Node<V>>>,
    free: Vec<u32>,
    len: usize,
    /// Chunks of the keys of removed nodes, kept for new keys: a tree that evicts as fast as
    /// it grows then allocates no key memory, so touches no fresh pages (a router's index
    /// measured 1.7 page faults, ~8 µs, per placement without it). At most
    /// [`SPARE_TOKENS`] tokens of capacity in all.
    spare: Vec<Vec<u32>>,
    spare_tokens: usize,
}

/// Capacity, in tokens, of the removed nodes' keys a tree keeps for reuse (4 MiB).
const SPARE_TOKENS: usize = 1 << 20;

impl<V> std::fmt::Debug for RadixTree<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixTree").field("page_size", &self.page_size).field("nodes", &self.len).finish()
    }
}

impl<V: Payload> RadixTree<V> {
    /// An empty tree whose keys are whole pages of `page_size` tokens.
    ///
    /// # Panics
    /// When `page_size` is 0.
    pub fn new(page_size: usize) -> Self {
        assert!(page_size > 0, "page size must be positive");
        let root = Node { parent: None, key: Key::new(), len: 0, children: Children::default(), value: None };
        Self {
            page_size,
            chunk: usize::MAX,
            nodes: vec![Some(root)],
            free: Vec::new(),
            len: 0,
            spare: Vec::new(),
            spare_tokens: 0,
        }
    }

    /// A tree ([`Self::new`]) that keeps its keys in chunks of at most `max_tokens` tokens
    /// (rounded down to whole pages, at least one). Every run of `max_tokens` or more then
    /// fills whole chunks of one size, so the chunks of a long node removed fit the long
    /// parts of any new key: a tree that evicts as fast as it grows touches no fresh memory
    /// for them even when its nodes' lengths change (a router's index whose 4,096-token
    /// nodes replaced 2,048-token ones took ~3 page faults a placement, one key at a time).
    /// A key's last chunk, and the tail a split copies out, are sized to their tokens, so
    /// shorter keys reuse memory only as the allocator finds it. Such a tree also writes
    /// chunks of 256 tokens or more with non-temporal stores: its keys are written into the
    /// cold memory of evicted nodes and read again, if ever, much later. Nodes are as in any
    /// tree: a match compares a key chunk by chunk.
    ///
    /// # Panics
    /// When `page_size` is 0.
    pub fn with_chunks(page_size: usize, max_tokens: usize) -> Self {
        let mut t = Self::new(page_size);
        t.chunk = (max_tokens / page_size).max(1) * page_size;
        t
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Nodes, root excluded.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether only the root is left.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn node(&self, id: NodeId) -> Option<&Node<V>> {
        self.nodes.get(id.index()).and_then(Option::as_ref)
    }

    fn node_mut(&mut self, id: NodeId) -> Option<&mut Node<V>> {
        self.nodes.get_mut(id.index()).and_then(Option::as_mut)
    }

    /// Whether `id` names a live node.
    pub fn contains(&self, id: NodeId) -> bool {
        self.node(id).is_some()
    }

    /// The node's own tokens (a whole number of pages; empty for the root), in the chunks it
    /// keeps them in, in order.
    pub fn key_chunks(&self, id: NodeId) -> impl Iterator<Item = &[u32]> + '_ {
        self.node(id).into_iter().flat_map(|n| n.key.iter().map(Vec::as_slice))
    }

    /// The node's own tokens, copied out.
    pub fn key(&self, id: NodeId) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.key_len(id));
        for c in self.key_chunks(id) {
            out.extend_from_slice(c);
        }
        out
    }

    /// The first page of the node's tokens (empty for the root).
    pub fn first_page(&self, id: NodeId) -> &[u32] {
        self.node(id).map_or(&[], |n| n.first_page(self.page_size))
    }

    /// Tokens in the node's key.
    pub fn key_len(&self, id: NodeId) -> usize {
        self.node(id).map_or(0, |n| n.len)
    }

    /// The node's payload (None for the root and dead ids).
    pub fn value(&self, id: NodeId) -> Option<&V> {
        self.node(id).and_then(|n| n.value.as_ref())
    }

    /// The node's payload, for changing it.
    pub fn value_mut(&mut self, id: NodeId) -> Option<&mut V> {
        self.node_mut(id).and_then(|n| n.value.as_mut())
    }

    /// The node's parent (None for the root).
    pub fn parent(&self, id: NodeId) -> Option<NodeId> {
        self.node(id).and_then(|n| n.parent)
    }

    /// The node's children, in no particular order.
    pub fn children(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.node(id).into_iter().flat_map(|n| n.children.values().copied())
    }

    /// Number of children.
    pub fn child_count(&self, id: NodeId) -> usize {
        self.node(id).map_or(0, |n| n.children.len())
    }

    /// Pages in the node's key.
    pub fn pages(&self, id: NodeId) -> usize {
        self.key_len(id) / self.page_size
    }

    /// The full token prefix from the root to the end of `id`.
    pub fn prefix(&self, id: NodeId) -> Vec<u32> {
        let mut chain = Vec::new();
        let mut cur = Some(id);
        while let Some(c) = cur {
            chain.push(c);
            cur = self.parent(c);
        }
        let mut out = Vec::new();
        for c in chain.iter().rev().flat_map(|&c| self.key_chunks(c)) {
            out.extend_from_slice(c);
        }
        out
    }

    /// Every node, parents before children (pre-order), root excluded; siblings in the order
    /// of their ids, so that two trees built by the same changes walk alike (a node's
    /// children are hashed with a seed of their own).
    pub fn walk(&self) -> Vec<NodeId> {
        self.walk_below(NodeId::ROOT)
    }

    /// [`Self::walk`] from `top` (included unless it is the root) down.
    pub fn walk_below(&self, top: NodeId) -> Vec<NodeId> {
        let mut out = Vec::with_capacity(if top == NodeId::ROOT { self.len } else { 1 });
        let mut stack = vec![top];
        while let Some(n) = stack.pop() {
            if n != NodeId::ROOT {
                out.push(n);
            }
            let from = stack.len();
            stack.extend(self.children(n));
            // Popped last first: the smallest id is walked first.
            stack[from..].sort_unstable_by(|a, b| b.cmp(a));
        }
        out
    }

    /// How much of `tokens` the tree holds, in whole pages.
    pub fn match_prefix(&self, tokens: &[u32]) -> Match {
        self.match_from(NodeId::ROOT, 0, tokens)
    }

    /// Continues a match below `node`, which already matched `tokens[..pos]` in full.
    pub fn match_from(&self, node: NodeId, pos: usize, tokens: &[u32]) -> Match {
        let mut walk = PrefixWalk {
            tree: self,
            tokens,
            full: tokens.len() / self.page_size * self.page_size,
            pos,
            cur: Some(node),
        };
        let path: Vec<(NodeId, usize)> = walk.by_ref().collect();
        Match { tokens: walk.pos, path }
    }

    /// The nodes a match of `tokens` passes through and the pages matched in each (the path
    /// of [`Self::match_prefix`]), without allocating.
    pub fn walk_prefix<'a>(&'a self, tokens: &'a [u32]) -> PrefixWalk<'a, V> {
        PrefixWalk {
            tree: self,
            tokens,
            full: tokens.len() / self.page_size * self.page_size,
            pos: 0,
            cur: Some(NodeId::ROOT),
        }
    }

    /// A key holding `tokens`, in chunks of at most the tree's chunk size.
    fn key_of(&mut self, tokens: &[u32]) -> Key {
        tokens.chunks(self.chunk).map(|c| self.chunk_of(c)).collect()
    }

    /// A chunk holding `tokens`: a kept one with room for them (the most recently kept of the
    /// last few), else a new one.
    fn chunk_of(&mut self, tokens: &[u32]) -> Vec<u32> {
        let n = self.spare.len();
        let fit = (n.saturating_sub(8)..n).rev().find(|&i| self.spare[i].capacity() >= tokens.len());
        let mut key = match fit {
            Some(i) => {
                let k = self.spare.swap_remove(i);
                self.spare_tokens -= k.capacity();
                k
            }
            None => Vec::with_capacity(tokens.len()),
        };
        key.clear();
        if self.chunk == usize::MAX {
            // A tree that reads new keys straight back (the engine's cache hashes them).
            key.extend_from_slice(tokens);
        } else {
            crate::stream::extend(&mut key, tokens);
        }
        key
    }

    fn alloc_node(&mut self, node: Node<V>) -> NodeId {
        self.len += 1;
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = Some(node);
                NodeId(i)
            }
            None => {
                self.nodes.push(Some(node));
                NodeId((self.nodes.len() - 1) as u32)
            }
        }
    }

    /// Splits `id` after `at` pages; returns the new upper node, which takes `id`'s place under
    /// its parent. `id` keeps the lower part (so references to the deeper part stay valid).
    /// Returns `id` unchanged when `at` is 0 or covers the whole node.
    pub fn split(&mut self, id: NodeId, at: usize) -> NodeId {
        let ps = self.page_size;
        let cut = at * ps;
        let Some(n) = self.node_mut(id) else { return id };
        if at == 0 || cut >= n.len || n.value.is_none() {
            return id;
        }
        let len = n.len;
        // The upper part keeps the chunks before the cut and the head of the one it falls in;
        // the lower part the chunks after it and a copy of that one's tail.
        let mut upper_key = std::mem::take(&mut n.key);
        let (mut i, mut start) = (0, 0);
        while start + upper_key[i].len() <= cut {
            start += upper_key[i].len();
            i += 1;
        }
        let mut lower_key = Key::new();
        if cut > start {
            lower_key.push(self.chunk_of(&upper_key[i][cut - start..]));
            upper_key[i].truncate(cut - start);
            i += 1;
        }
        lower_key.extend(upper_key.drain(i..));
        let Some(n) = self.node_mut(id) else { return id };
        (n.key, n.len) = (lower_key, len - cut);
        let lower_val = n.value.as_mut().map(|v| v.split_off(at));
        let upper_val = std::mem::replace(&mut n.value, lower_val);
        let parent = n.parent;
        let lower_first: Box<[u32]> = n.first_page(ps).into();
        let upper =
            self.alloc_node(Node { parent, key: upper_key, len: cut, children: Children::default(), value: upper_val });
        if let Some(u) = self.node_mut(upper) {
            u.children.insert(lower_first, id);
        }
        if let Some(n) = self.node_mut(id) {
            n.parent = Some(upper);
        }
        // The upper part starts with the node's first page: its parent's entry, made to name
        // the upper node (no new key).
        let u = self.nodes[upper.index()].take();
        if let (Some(u), Some(p)) = (&u, parent.and_then(|p| self.node_mut(p))) {
            let entry = p.children.get_mut(u.first_page(ps));
            debug_assert!(entry.is_some(), "a node's parent has an entry for its first page");
            if let Some(entry) = entry {
                *entry = upper;
            }
        }
        self.nodes[upper.index()] = u;
        upper
    }

    /// Inserts the whole pages of `tokens`. Pages already present are left as they are; when
    /// some are new, `make(existing_pages)` gives the payload for the new ones
    /// (`tokens[existing_pages * page_size..]`).
    pub fn insert(&mut self, tokens: &[u32], make: impl FnOnce(usize) -> V) -> Insert {
        let full = tokens.len() / self.page_size * self.page_size;
        let m = self.match_prefix(&tokens[..full]);
        self.insert_below(NodeId::ROOT, tokens, &m, make)
    }

    /// [`Self::insert`] below `node`, for a caller that has just matched there: `tokens`
    /// follow the end of `node`, and `m` is `self.match_from(node, 0, tokens)` (the tree
    /// unchanged since), so the match is not walked again.
    pub fn insert_below(&mut self, node: NodeId, tokens: &[u32], m: &Match, make: impl FnOnce(usize) -> V) -> Insert {
        let ps = self.page_size;
        let full = tokens.len() / ps * ps;
        let mut out = Insert { existing_pages: m.tokens / ps, ..Insert::default() };
        out.path = m.path.iter().map(|p| p.0).collect();
        if let Some(&(last, pages)) = m.path.last()
            && pages < self.pages(last)
        {
            let upper = self.split(last, pages);
            out.split = Some((upper, last));
            if let Some(l) = out.path.last_mut() {
                *l = upper;
            }
        }
        if m.tokens < full {
            let parent = out.path.last().copied().unwrap_or(node);
            let key = self.key_of(&tokens[m.tokens..full]);
            let first: Box<[u32]> = key[0][..ps].into();
            let id = self.alloc_node(Node {
                parent: Some(parent),
                key,
                len: full - m.tokens,
                children: Children::default(),
                value: Some(make(out.existing_pages)),
            });
            if let Some(p) = self.node_mut(parent) {
                p.children.insert(first, id);
            }
            out.new_node = Some(id);
        }
        out
    }

    /// Removes a childless node and returns its payload; None for the root, dead ids and
    /// nodes with children.
    pub fn remove_leaf(&mut self, id: NodeId) -> Option<V> {
        let ps = self.page_size;
        let n = self.node(id)?;
        if id == NodeId::ROOT || !n.children.is_empty() {
            return None;
        }
        let parent = n.parent;
        let mut node = self.nodes[id.index()].take()?;
        // Found by the removed node's own first page: no key made to remove it.
        if let Some(p) = parent.and_then(|p| self.node_mut(p)) {
            p.children.remove(node.first_page(ps));
        }
        for chunk in std::mem::take(&mut node.key) {
            if self.spare_tokens + chunk.capacity() <= SPARE_TOKENS {
                self.spare_tokens += chunk.capacity();
                self.spare.push(chunk);
            }
        }
        self.free.push(id.0);
        self.len -= 1;
        node.value
    }
}
