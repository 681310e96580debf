//! The tree against a naive model: random inserts, matches and leaf removals.

use ferry_radix::{NodeId, Payload, RadixTree, common_prefix};
use proptest::prelude::*;

const PS: usize = 4;

/// A payload that names each page by the tokens of the whole prefix up to its end, so a
/// wrong split shows as a wrong label.
#[derive(Debug, Clone, PartialEq)]
struct Labels(Vec<Vec<u32>>);

impl Payload for Labels {
    fn split_off(&mut self, at: usize) -> Self {
        Labels(self.0.split_off(at))
    }
}

fn labels(tokens: &[u32], from_page: usize) -> Labels {
    Labels((from_page..tokens.len() / PS).map(|p| tokens[..(p + 1) * PS].to_vec()).collect())
}

fn check_invariants(t: &RadixTree<Labels>) {
    for id in t.walk() {
        let key = t.key(id);
        assert!(!key.is_empty() && key.len().is_multiple_of(PS), "key of {} tokens", key.len());
        let prefix = t.prefix(id);
        let v = t.value(id).expect("payload");
        assert_eq!(v.0.len(), key.len() / PS);
        let start = prefix.len() / PS - v.0.len();
        for (i, l) in v.0.iter().enumerate() {
            assert_eq!(l, &prefix[..(start + i + 1) * PS].to_vec(), "page label");
        }
        let parent = t.parent(id).expect("parent");
        assert!(t.children(parent).any(|c| c == id));
        let mut firsts: Vec<&[u32]> = t.children(id).map(|c| t.first_page(c)).collect();
        firsts.sort();
        let n = firsts.len();
        firsts.dedup();
        assert_eq!(firsts.len(), n, "children share a first page");
    }
}

fn expected_match(t: &RadixTree<Labels>, q: &[u32]) -> usize {
    let full = q.len() / PS * PS;
    t.walk()
        .into_iter()
        .filter(|&n| t.child_count(n) == 0)
        .map(|l| common_prefix(&t.prefix(l), &q[..full]) / PS * PS)
        .max()
        .unwrap_or(0)
}

/// Token sequences over a tiny alphabet, so prefixes are shared often.
fn seq() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(0u32..3, 0..40)
}

#[derive(Debug, Clone)]
enum Op {
    Insert(Vec<u32>),
    Match(Vec<u32>),
    RemoveLeaf(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![3 => seq().prop_map(Op::Insert), 2 => seq().prop_map(Op::Match), 1 => (0usize..64).prop_map(Op::RemoveLeaf)]
}

proptest! {
    #[test]
    fn matches_agree_with_the_naive_model(ops in proptest::collection::vec(op(), 1..60)) {
        let mut t: RadixTree<Labels> = RadixTree::new(PS);
        // Built by the same changes, a second tree makes the same ids and walks alike (the
        // router's two copies of its index share one table of node ids); keeping its keys in
        // chunks of two pages changes none of that, nor any key or match.
        let mut twin: RadixTree<Labels> = RadixTree::with_chunks(PS, 2 * PS + 1);
        for op in ops {
            match op {
                Op::Insert(s) => {
                    let before = t.match_prefix(&s).tokens;
                    twin.insert(&s, |existing| labels(&s, existing));
                    let ins = t.insert(&s, |existing| labels(&s, existing));
                    prop_assert_eq!(ins.existing_pages * PS, before);
                    prop_assert_eq!(t.match_prefix(&s).tokens, s.len() / PS * PS);
                    if let Some(last) = ins.last() {
                        prop_assert_eq!(t.prefix(last), s[..s.len() / PS * PS].to_vec());
                    }
                }
                Op::Match(q) => {
                    let m = t.match_prefix(&q);
                    prop_assert_eq!(m.tokens, expected_match(&t, &q));
                    prop_assert_eq!(&twin.match_prefix(&q), &m);
                    let covered: usize = m.path.iter().map(|p| p.1).sum::<usize>() * PS;
                    prop_assert_eq!(covered, m.tokens);
                }
                Op::RemoveLeaf(i) => {
                    let leaves: Vec<NodeId> = t.walk().into_iter().filter(|&n| t.child_count(n) == 0).collect();
                    if let Some(&l) = leaves.get(i % leaves.len().max(1)) {
                        let n = t.len();
                        prop_assert!(t.remove_leaf(l).is_some());
                        prop_assert!(twin.remove_leaf(l).is_some());
                        prop_assert_eq!(t.len(), n - 1);
                        prop_assert!(!t.contains(l));
                    }
                }
            }
            check_invariants(&t);
            check_invariants(&twin);
            prop_assert_eq!(t.walk(), twin.walk());
            for id in t.walk() {
                prop_assert_eq!(t.key(id), twin.key(id));
                prop_assert!(twin.key_chunks(id).all(|c| !c.is_empty() && c.len() <= 2 * PS && c.len() % PS == 0));
            }
        }
    }
}

#[test]
fn split_keeps_the_lower_id_and_removal_refuses_inner_nodes() {
    let mut t: RadixTree<Labels> = RadixTree::new(PS);
    let a: Vec<u32> = (0..12).collect();
    let ins = t.insert(&a, |e| labels(&a, e));
    let node = ins.new_node.expect("new");
    let mut b = a.clone();
    b[9] = 99;
    let ins2 = t.insert(&b, |e| labels(&b, e));
    assert_eq!(ins2.existing_pages, 2);
    let (upper, lower) = ins2.split.expect("split");
    assert_eq!(lower, node, "the deeper part keeps its id");
    assert_eq!(t.key(upper), &a[..8]);
    assert_eq!(t.key(node), &a[8..12]);
    assert!(t.remove_leaf(upper).is_none(), "inner node");
    assert!(t.remove_leaf(NodeId::ROOT).is_none());
    assert!(t.remove_leaf(node).is_some());
    assert_eq!(t.match_prefix(&a).tokens, 8);
}

/// `insert_below` continues a path from an inner node as `insert` would from the root: the
/// same pages, the same split, the node ids of what was there kept.
#[test]
fn insert_below_continues_a_path_from_a_node() {
    let mut t: RadixTree<Labels> = RadixTree::new(PS);
    let a: Vec<u32> = (0..16).collect();
    let top = t.insert(&a[..8], |e| labels(&a[..8], e)).new_node.expect("new");
    let below = t.insert(&a, |e| labels(&a, e)).new_node.expect("new");
    let mut b: Vec<u32> = a[8..].to_vec();
    b.extend([50, 51, 52, 53]);
    b[1] = 99;
    let m = t.match_from(top, 0, &b);
    assert_eq!(m.tokens, 0, "the child differs in its first page");
    let mut full = a[..8].to_vec();
    full.extend(&b);
    let ins = t.insert_below(top, &b, &m, |e| labels(&full, 2 + e));
    let new = ins.new_node.expect("a sibling of the old child");
    assert_eq!((t.parent(new), t.parent(below)), (Some(top), Some(top)));
    assert_eq!(t.prefix(new), full);
    assert_eq!(t.match_prefix(&full).tokens, 20);
    let c: Vec<u32> = vec![8, 9, 10, 11, 7, 7, 7, 7];
    let m = t.match_from(top, 0, &c);
    assert_eq!(m.tokens, 4, "one page of the old child");
    let full: Vec<u32> = a[..8].iter().chain(&c).copied().collect();
    let ins = t.insert_below(top, &c, &m, |e| labels(&full, 2 + e));
    assert_eq!(ins.split.map(|s| s.1), Some(below), "split, the deeper part keeping its id");
    check_invariants(&t);
}

/// At the router's sizes (pages of 16, chunks of 2,048 tokens) and with keys long enough to
/// be copied by non-temporal stores: a chunked tree and a plain one, split at pages on and
/// around chunk boundaries, then emptied and filled again from the kept chunks, hold the
/// same keys and answer the same matches.
#[test]
fn long_keys_split_alike_in_chunks_and_whole() {
    const P: usize = 16;
    struct Unit;
    impl Payload for Unit {
        fn split_off(&mut self, _: usize) -> Self {
            Unit
        }
    }
    let mut x: u64 = 0x9e37_79b9;
    let mut tokens = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 50_000) as u32
            })
            .collect()
    };
    let mut plain: RadixTree<Unit> = RadixTree::new(P);
    let mut chunked: RadixTree<Unit> = RadixTree::with_chunks(P, 2048);
    for round in 0..2 {
        let key = tokens(5_008);
        let a = plain.insert(&key, |_| Unit).new_node.expect("new");
        let b = chunked.insert(&key, |_| Unit).new_node.expect("new");
        assert_eq!(a, b);
        let lower = a;
        // Each split leaves the lower part with the id: cut it further down, page by page.
        let mut cut = 0;
        for at in [1, 127, 128, 129, 255, 256, 300] {
            let (u1, u2) = (plain.split(lower, at - cut), chunked.split(lower, at - cut));
            assert_eq!(u1, u2, "round {round}, split at page {at}");
            cut = at;
        }
        for id in plain.walk() {
            assert_eq!(plain.key(id), chunked.key(id), "round {round}, node {id:?}");
            assert_eq!(chunked.key_len(id), chunked.key(id).len());
            assert_eq!(chunked.first_page(id), &chunked.key(id)[..P]);
            assert!(chunked.key_chunks(id).all(|c| !c.is_empty() && c.len() <= 2048 && c.len() % P == 0));
        }
        let mut probe = key.clone();
        probe[3_000] = 50_001;
        assert_eq!(plain.match_prefix(&probe), chunked.match_prefix(&probe));
        assert_eq!(chunked.match_prefix(&key).tokens, 5_008 / P * P);
        // Empty both, leaves first, so the next round's keys come from the kept chunks.
        while let Some(leaf) = plain.walk().into_iter().find(|&n| plain.child_count(n) == 0) {
            assert!(plain.remove_leaf(leaf).is_some() && chunked.remove_leaf(leaf).is_some());
        }
        assert!(chunked.is_empty());
    }
}
