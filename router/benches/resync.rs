//! How long a (re)started router takes to hold a complete index again: issue 17 asks for a
//! million pages from the workers' snapshots within 2 s. W fake prefill workers (real gRPC on
//! loopback, `KvEvents` only) each hold 1,000,000 / W pages in chains of 64 pages of 16
//! tokens; the router's own registry joins them (`Registry::upsert`, which subscribes with a
//! snapshot, exactly as at start) and the clock runs until its index holds every page.
//! Prints the time and the snapshots' size on the wire, for W = 1, 4 and 16 — and what a
//! placement meanwhile takes: a thread matches a 4,096-token prompt every 0.2 ms as a
//! placement does (`SharedIndex::matched`, which never waits for ingestion), and reports the
//! match's time (p50 / p99 / max) while the snapshots go in.
//!
//! `cargo bench -p ferry-router --bench resync`; `FERRY_BENCH_QUICK=1` divides the pages by
//! 20 (CI smoke run).

#[path = "../tests/common/snapshots.rs"]
mod snapshots;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferry_cluster::WorkerId;
use ferry_cluster::discovery::{Role, Worker};
use ferry_router::index::SharedIndex;
use ferry_router::workers::Registry;

async fn resync(workers: usize, total: usize) {
    let per = total / workers;
    let mut addrs = Vec::new();
    let mut bytes = 0;
    for w in 0..workers {
        let batch = snapshots::snapshot(per, 1 + w as u64);
        bytes += prost::Message::encoded_len(&batch);
        addrs.push(snapshots::serve(batch).await);
    }
    let index = Arc::new(SharedIndex::new(snapshots::PS, 1 << 21));
    let registry = Registry::new(Arc::clone(&index));
    let done = Arc::new(AtomicBool::new(false));
    let placer = {
        let (index, done) = (Arc::clone(&index), Arc::clone(&done));
        std::thread::spawn(move || {
            let probe: Vec<u32> = (0..4096).collect();
            let mut waits = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let t = Instant::now();
                let m = index.matched(&probe, workers);
                waits.push(t.elapsed().as_secs_f64() * 1e6);
                assert_eq!(m.len(), workers);
                std::thread::sleep(Duration::from_micros(200));
            }
            waits
        })
    };
    let t = Instant::now();
    for (w, addr) in addrs.into_iter().enumerate() {
        let id = WorkerId::new(format!("prefill-{w}")).expect("id");
        registry.upsert(&Worker { id, role: Role::Prefill, addr }).expect("joined");
    }
    let want = per.div_ceil(64) * 64 * workers;
    loop {
        if index.pages() >= want {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "the index never filled");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let took = t.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let mut waits = placer.join().expect("placer");
    let n = waits.len();
    let pct = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let at = |p: f64| v.get(((v.len().max(1) - 1) as f64 * p) as usize).copied().unwrap_or(0.0);
        format!("{:.0} / {:.0} / {:.0}", at(0.5), at(0.99), at(1.0))
    };
    let all = pct(&mut waits);
    println!(
        "resync: {want} pages from {workers} workers' snapshots ({:.0} MB on the wire) in {took:.2} s; a placement's match meanwhile p50 / p99 / max {all} µs ({n} matches) | issue 17's goal: 1 M pages within 2 s",
        bytes as f64 / 1e6,
    );
}

fn main() {
    let div = if ferry_core::bench::quick() { 20 } else { 1 };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    for workers in [1, 4, 16] {
        rt.block_on(resync(workers, 1_000_000 / div));
    }
}
