//! The shard against hand-worked cases and random traffic.

use super::*;
use ferry_radix::events::page_hashes;
use std::time::Duration;

const PS: usize = 4;

fn hashes(tokens: &[u32], parent: u64) -> Vec<u64> {
    page_hashes(parent, tokens, PS)
}

#[test]
fn stored_runs_chain_and_matches_are_per_worker() {
    let mut ix = Shard::new(PS, 1000);
    let a: Vec<u32> = (0..12).collect();
    let ha = hashes(&a, ROOT_HASH);
    ix.stored(0, ROOT_HASH, &ha[..2], &a[..8]).expect("stored");
    ix.stored(0, ha[1], &ha[2..], &a[8..]).expect("chained below its parent");
    ix.stored(1, ROOT_HASH, &ha[..1], &a[..4]).expect("another worker, shorter");
    assert_eq!(ix.matched(&a, 3), vec![12, 4, 0]);
    let mut b = a[..8].to_vec();
    b.extend([99, 98, 97, 96]);
    assert_eq!(ix.matched(&b, 2), vec![8, 4], "diverges after two pages");
    assert_eq!(ix.stored(0, 12345, &[1], &[1, 2, 3, 4]), Err(IndexError::UnknownParent(12345)));
    assert!(matches!(ix.stored(0, ROOT_HASH, &ha[..1], &a[..5]), Err(IndexError::Malformed(_))));
    assert_eq!(ix.pages(), 3);
}

/// An event finds its parent page where splits moved it: into a new parent node (the
/// node's head), or further down the node it was in (its tail); mid-node parents split.
#[test]
fn events_find_their_parent_pages_after_splits() {
    let mut ix = Shard::new(PS, 1000);
    let a: Vec<u32> = (0..16).collect();
    let ha = hashes(&a, ROOT_HASH);
    ix.stored(0, ROOT_HASH, &ha, &a).expect("one node of 4 pages");
    ix.stored(1, ROOT_HASH, &ha[..2], &a[..8]).expect("worker 1 holds its head: split after page 2");
    assert_eq!(ix.tree.len(), 2);
    let b: Vec<u32> = (100..108).collect();
    let hb = hashes(&b, ha[3]);
    ix.stored(0, ha[3], &hb, &b).expect("below page 4, now page 2 of the lower node");
    let c: Vec<u32> = (200..204).collect();
    ix.stored(1, ha[1], &hashes(&c, ha[1]), &c).expect("below page 2, the end of the upper node");
    let d: Vec<u32> = (300..304).collect();
    ix.stored(2, ha[0], &hashes(&d, ha[0]), &d).expect("below page 1: splits the upper node");
    let cat = |x: &[u32], y: &[u32]| -> Vec<u32> { x.iter().chain(y).copied().collect() };
    assert_eq!(ix.matched(&cat(&a, &b), 3), vec![24, 8, 4]);
    assert_eq!(ix.matched(&cat(&a[..8], &c), 3), vec![8, 12, 4]);
    assert_eq!(ix.matched(&cat(&a[..4], &d), 3), vec![4, 4, 8]);
    ix.removed(0, &hb[1..]).expect("b's last page");
    ix.removed(0, &hb[..1]).expect("and its first");
    assert_eq!(ix.matched(&cat(&a, &b), 3), vec![16, 8, 4]);
    assert_eq!(ix.pages(), 4 + 1 + 1);
    assert_eq!(ix.stored(0, hb[0], &hb[1..], &b[4..]), Err(IndexError::UnknownParent(hb[0])), "gone");
}

#[test]
fn removals_prune_what_nobody_holds() {
    let mut ix = Shard::new(PS, 1000);
    let a: Vec<u32> = (0..16).collect();
    let ha = hashes(&a, ROOT_HASH);
    ix.stored(0, ROOT_HASH, &ha, &a).expect("stored");
    ix.stored(1, ROOT_HASH, &ha[..2], &a[..8]).expect("stored");
    ix.removed(0, &ha[2..]).expect("evicted tail");
    assert_eq!(ix.pages(), 2, "pages 3 and 4 were only worker 0's");
    assert_eq!(ix.matched(&a, 2), vec![8, 8]);
    ix.clear_worker(1).expect("cleared");
    assert_eq!(ix.matched(&a, 2), vec![8, 0]);
    ix.removed(0, &ha[..2]).expect("evicted");
    assert_eq!(ix.pages(), 0);
    assert!(ix.tree.is_empty() || ix.tree.len() <= 1, "only the root is left");
}

#[test]
fn provisional_marks_count_until_they_expire_or_are_confirmed() {
    let t0 = Instant::now();
    let mut ix = Shard::new(PS, 1000);
    let p: Vec<u32> = (100..110).collect();
    ix.provisional(2, &p, t0, Duration::from_secs(1)).expect("placed");
    assert_eq!(ix.matched(&p, 3), vec![0, 0, 8], "two whole pages");
    let hp = hashes(&p[..8], ROOT_HASH);
    ix.stored(1, ROOT_HASH, &hp[..1], &p[..4]).expect("another worker caches one page");
    ix.expire(t0 + Duration::from_secs(1));
    assert_eq!(ix.matched(&p, 3), vec![0, 4, 0]);
    assert_eq!(ix.pages(), 1, "the unconfirmed second page is gone");
}

/// Issue 17: nothing but a unit test called `expire`, so provisional marks never lapsed.
/// Placements now expire what is due before they mark.
#[test]
fn placements_forget_marks_no_worker_confirmed() {
    let t0 = Instant::now();
    let ttl = Duration::from_secs(10);
    let mut ix = Shard::new(PS, 1000);
    let a: Vec<u32> = (100..112).collect();
    let b: Vec<u32> = (200..212).collect();
    ix.provisional(0, &a, t0, ttl).expect("placed");
    ix.provisional(1, &b, t0 + ttl / 2, ttl).expect("placed");
    assert_eq!((ix.matched(&a, 2), ix.pages()), (vec![12, 0], 6));
    ix.provisional(1, &b, t0 + ttl, ttl).expect("placed again");
    assert_eq!(ix.matched(&a, 2), vec![0, 0], "a's marks lapsed");
    assert_eq!(ix.matched(&b, 2), vec![0, 12], "b's were renewed");
    assert_eq!(ix.pages(), 3);
}

/// A placement hashes only the pages the tree lacks, chained from the last known one: the
/// hashes must be those the worker's events will carry (computed from the root), or its
/// confirmation would add a second copy of every page.
#[test]
fn placements_below_known_pages_hash_as_the_workers_do() {
    let t0 = Instant::now();
    let mut ix = Shard::new(PS, 1000);
    let p: Vec<u32> = (0..24).collect();
    let hp = hashes(&p, ROOT_HASH);
    ix.stored(0, ROOT_HASH, &hp[..2], &p[..8]).expect("a known prefix");
    ix.provisional(1, &p, t0, Duration::from_secs(5)).expect("placed below it");
    assert_eq!((ix.pages(), ix.matched(&p, 2)), (6, vec![8, 24]));
    ix.stored(1, hp[1], &hp[2..], &p[8..]).expect("worker 1 confirms");
    assert_eq!(ix.pages(), 6, "the same pages, not new ones");
    ix.expire(t0 + Duration::from_secs(5));
    assert_eq!(ix.matched(&p, 2), vec![8, 24], "confirmed: held, not provisional");
}

/// Issue 17: a full index dropped new pages, so placement quality decayed with uptime. It
/// now evicts: pages only placed before pages a worker confirmed, least recently used first.
#[test]
fn a_full_index_evicts_the_least_recently_used_placements_first() {
    let t0 = Instant::now();
    let ttl = Duration::from_secs(60);
    let mut ix = Shard::new(PS, 5);
    let a: Vec<u32> = (0..4).collect();
    ix.stored(0, ROOT_HASH, &hashes(&a, ROOT_HASH), &a).expect("confirmed");
    let [b, c, d, e]: [Vec<u32>; 4] = [100, 200, 300, 400].map(|x| (x..x + 8).collect());
    ix.provisional(1, &b, t0, ttl).expect("placed");
    ix.provisional(1, &c, t0, ttl).expect("placed");
    assert_eq!(ix.pages(), 5, "full");
    ix.provisional(1, &b, t0, ttl).expect("b used again");
    ix.provisional(2, &d, t0, ttl).expect("placed: c goes, the least recently used");
    assert_eq!((ix.matched(&c, 3), ix.matched(&b, 3), ix.matched(&d, 3)), (vec![0; 3], vec![0, 8, 0], vec![0, 0, 8]));
    assert_eq!((ix.pages(), ix.evicted(), ix.dropped()), (5, 2, 0));
    ix.provisional(2, &e, t0, ttl).expect("placed: b goes");
    ix.provisional(2, &b, t0, ttl).expect("placed again: d goes, the confirmed page stays");
    assert_eq!(ix.matched(&a, 3), vec![4, 0, 0]);
    assert_eq!((ix.matched(&d, 3), ix.matched(&e, 3), ix.matched(&b, 3)), (vec![0; 3], vec![0, 0, 8], vec![0, 0, 8]));
    assert_eq!((ix.pages(), ix.evicted(), ix.dropped()), (5, 6, 0));
    let long: Vec<u32> = (1000..1024).collect();
    ix.provisional(1, &long, t0, ttl).expect("six pages never fit five: dropped, counted");
    assert_eq!((ix.dropped(), ix.matched(&long, 3)), (6, vec![0; 3]));
    assert_eq!((ix.pages(), ix.evicted()), (5, 6), "nothing was evicted for pages that could not fit");
    check_order(&ix);
}

/// The recency lists hold every node once, in the list its holders say, each node older
/// than its parent when both are in one list; the page count is the tree's.
fn check_order(ix: &Shard) {
    let mut seen = std::collections::HashMap::new();
    for list in [List::Provisional, List::Held] {
        let mut at = ix.lru.oldest(list);
        let mut rank = 0;
        while let Some(id) = at {
            let r = ix.tree.value(id).expect("a listed node is alive");
            assert_eq!(ix.lru.list(id), Some(list));
            assert_eq!(r.held != 0, list == List::Held, "node {id:?} is in the list of its holders");
            assert!(seen.insert(id, (list, rank)).is_none(), "listed once");
            rank += 1;
            at = ix.lru.newer(id);
        }
    }
    let nodes = ix.tree.walk();
    assert_eq!(seen.len(), nodes.len(), "every node is listed");
    for &id in &nodes {
        if let Some(p) = ix.tree.parent(id).filter(|&p| p != NodeId::ROOT) {
            let (child, parent) = (seen[&id], seen[&p]);
            assert!(child.0 != parent.0 || child.1 < parent.1, "a parent is newer than its children");
        }
    }
    assert_eq!(nodes.iter().map(|&id| ix.tree.pages(id)).sum::<usize>(), ix.pages());
}

/// Random placements, events (each worker's pages prefix-closed, evicted leaf first, as a
/// cache's are), expiries and resyncs over a small alphabet (so paths share and split)
/// into a shard too small for them: the recency order stays whole and the bound holds.
#[test]
fn the_recency_order_survives_random_traffic() {
    let mut next = crate::testing::rng(0x9e37_79b9_7f4a_7c15);
    let t0 = Instant::now();
    let mut ix = Shard::new(PS, 40);
    // Each worker's cached prefixes, whole pages.
    let mut held: Vec<std::collections::BTreeSet<Vec<u32>>> = vec![Default::default(); 3];
    for step in 0..3000u64 {
        let w = next(3) as usize;
        let pages = 1 + next(6) as usize;
        let t: Vec<u32> = (0..pages * PS).map(|_| next(2) as u32).collect();
        let now = t0 + Duration::from_millis(step);
        match next(6) {
            0 | 1 => ix.provisional(w, &t, now, Duration::from_millis(50)).expect("placed"),
            2 | 3 => {
                ix.stored(w, ROOT_HASH, &hashes(&t, ROOT_HASH), &t).expect("stored");
                held[w].extend((1..=pages).map(|k| t[..k * PS].to_vec()));
            }
            4 => {
                let leaves: Vec<&Vec<u32>> =
                    held[w].iter().filter(|p| !held[w].iter().any(|q| q.len() > p.len() && q.starts_with(p))).collect();
                if !leaves.is_empty() {
                    let leaf = leaves[next(leaves.len() as u64) as usize].clone();
                    let last = *hashes(&leaf, ROOT_HASH).last().expect("a page");
                    ix.removed(w, &[last]).expect("removed");
                    held[w].remove(&leaf);
                }
            }
            _ => {
                if next(8) == 0 {
                    ix.clear_worker(w).expect("cleared");
                    held[w].clear();
                } else {
                    ix.expire(now);
                }
            }
        }
        assert!(ix.pages() <= 40);
        check_order(&ix);
    }
    assert!(ix.evicted() > 0, "the traffic overflowed the shard");
}

/// A run's pages removed from its end, one by one in one event, while another worker
/// still holds them: one cut, not one per page (each cut renamed every page before it).
#[test]
fn removing_a_run_from_its_end_cuts_its_node_once() {
    let mut ix = Shard::new(PS, 1000);
    let a: Vec<u32> = (0..64 * PS as u32).collect();
    let ha = hashes(&a, ROOT_HASH);
    ix.stored(0, ROOT_HASH, &ha, &a).expect("stored");
    ix.stored(1, ROOT_HASH, &ha, &a).expect("stored");
    let backwards: Vec<u64> = ha[8..].iter().rev().copied().collect();
    ix.removed(0, &backwards).expect("removed");
    assert_eq!(ix.tree.len(), 2, "cut once, after page 8");
    assert_eq!(ix.matched(&a, 2), vec![8 * PS, 64 * PS]);
    ix.removed(0, &ha[..8]).expect("removed");
    assert_eq!((ix.tree.len(), ix.matched(&a, 2)), (2, vec![0, 64 * PS]), "none of worker 0's left");
}

/// Once the index evicted pages a worker holds, that worker's next run below one of them
/// is dropped (counted), not refused: refusing made the worker resync its whole cache into
/// the full index, evicting other workers' pages in turn.
#[test]
fn a_run_below_an_evicted_page_is_dropped_not_refused() {
    let t0 = Instant::now();
    let mut ix = Shard::new(PS, 2);
    let a: Vec<u32> = (0..4).collect();
    let ha = hashes(&a, ROOT_HASH);
    ix.stored(0, ROOT_HASH, &ha, &a).expect("stored");
    let b: Vec<u32> = (100..108).collect();
    ix.provisional(1, &b, t0, Duration::from_secs(5)).expect("placed: evicts a, the only page");
    assert_eq!((ix.matched(&a, 2), ix.evicted()), (vec![0, 0], 1));
    let a2: Vec<u32> = (4..8).collect();
    ix.stored(0, ha[0], &hashes(&a2, ha[0]), &a2).expect("dropped, not an error");
    assert_eq!((ix.dropped(), ix.pages()), (1, 2));
    let mut fresh = Shard::new(PS, 100);
    let e = fresh.stored(0, ha[0], &hashes(&a2, ha[0]), &a2);
    assert_eq!(e, Err(IndexError::UnknownParent(ha[0])), "an index that lost nothing still refuses a gap");
}

#[test]
fn a_full_index_drops_new_pages_and_counts_them() {
    let mut ix = Shard::new(PS, 2);
    let a: Vec<u32> = (0..12).collect();
    let ha = hashes(&a, ROOT_HASH);
    ix.stored(0, ROOT_HASH, &ha[..2], &a[..8]).expect("fits");
    ix.stored(0, ha[1], &ha[2..], &a[8..]).expect("dropped, not an error");
    assert_eq!((ix.pages(), ix.dropped()), (2, 1));
    assert!(matches!(ix.stored(64, ROOT_HASH, &ha[..1], &a[..4]), Err(IndexError::Slot(64))));
}
