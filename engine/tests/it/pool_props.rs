//! Page accounting of the pool under random allocate / grow / drop sequences.

use std::collections::HashSet;

use ferry_engine::{PageAlloc, PagePool};
use ferry_kernels::KvLayout;
use ferry_kernels::cpu::CpuBackend;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Grow(usize, usize),
    Drop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..12).prop_map(Op::Alloc),
        (0usize..8, 0usize..6).prop_map(|(i, n)| Op::Grow(i, n)),
        (0usize..8).prop_map(Op::Drop),
    ]
}

proptest! {
    #[test]
    fn free_plus_held_is_always_the_pool(ops in proptest::collection::vec(op(), 1..80)) {
        let layout = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 2, page_size: 4 };
        let pool = PagePool::new(&CpuBackend::default(), layout, 32).expect("pool");
        let mut live: Vec<PageAlloc> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(n) => {
                    let free = pool.free_pages();
                    match pool.alloc(n) {
                        Ok(a) => live.push(a),
                        Err(_) => prop_assert!(n > free, "refused {n} with {free} free"),
                    }
                    if n > free {
                        prop_assert_eq!(pool.free_pages(), free, "a refused allocation takes nothing");
                    }
                }
                Op::Grow(i, n) => {
                    if let Some(a) = live.get_mut(i) {
                        let (before, free) = (a.pages().len(), pool.free_pages());
                        if a.grow(n).is_err() {
                            prop_assert!(n > free);
                            prop_assert_eq!(a.pages().len(), before);
                        }
                    }
                }
                Op::Drop(i) => {
                    if i < live.len() {
                        live.swap_remove(i);
                    }
                }
            }
            let held: usize = live.iter().map(|a| a.pages().len()).sum();
            prop_assert_eq!(pool.free_pages() + held, 32);
            let distinct: HashSet<u32> = live.iter().flat_map(|a| a.pages().iter().copied()).collect();
            prop_assert_eq!(distinct.len(), held, "a page is held twice");
            prop_assert!(distinct.iter().all(|&p| p < 32));
        }
        drop(live);
        prop_assert_eq!(pool.free_pages(), 32);
    }
}
