//! Router placement benchmark, issue 17's workload W1, through the router's own path: the
//! workers' published health and load (`Registry::prefill_board`'s board) → match
//! (`SharedIndex::matched`: the workers' events and the router's marks) → the prompt tokens
//! pending on each worker (`PrefillPending::by_slot`) → choose (`Placer::prefill`) →
//! provisional insert (`SharedIndex::provisional`) → count its tokens pending on the chosen
//! worker (`PrefillPending::add`), exactly what every request does. The load is equal
//! on every worker, so each placement's pending tokens are dropped once it is placed (its
//! prefill done before the next placement); a line `(b) with 32 in flight` then repeats (b) with the last 32
//! placements' tokens still pending (as many prefills computing), where placement weighs the
//! pending queues against the cache: it prints the share placed on the group's home and on a
//! worker holding its prefix.
//!
//! W workers (64; `FERRY_BENCH_WORKERS` for others), all healthy, equal load; pages of 16
//! tokens; token ids uniform in [0, 50,000) from a fixed seed; G = 64 prefix groups. Preload
//! N = 10,000 requests of 4,096 tokens (a group's 2,048-token prefix + 2,048 fresh tokens), so
//! the first request of a group defines its home; then time 20,000 requests of each kind:
//! (a) an exact repeat of a preloaded request, (b) a group prefix + 2,048 fresh tokens, (c)
//! 4,096 fresh tokens (10,000). Prints mean / p50 / p99 / max and ops/s per kind, the index cost
//! (match + insert) apart, the affinity of (b) (share placed on its group's home), and smg's
//! `CacheAwarePolicy::select_worker` on this machine beside them (issue 17's figures). Then
//! the two variants, each in an index of its own and its lines tagged: 512-token
//! requests (256 shared) and 32,768-token requests (30,720 shared, N = 1,000); the issue
//! gives no smg figures for them.
//!
//! The index is bounded as the router's is by default (`--max-index-pages`, 2^20 pages): the
//! workload indexes 6.4 M pages, so past the first ~1 M each placement of fresh tokens evicts
//! the least recently used ones, as a long-running router does. Each phase prints the minor
//! page faults it took (first touches of fresh memory, ~5 µs each on this machine's VM); (c)
//! also prints its second half apart, once its nodes evict nodes of their own size.
//!
//! `cargo bench -p ferry-router --bench placement`; `FERRY_BENCH_QUICK=1` divides the counts
//! by 20 (CI smoke run).

#[path = "common/rng.rs"]
mod rng;

use std::time::{Duration, Instant};

use rng::Rng;

use std::sync::Arc;

use ferry_cluster::WorkerId;
use ferry_cluster::discovery::Role;
use ferry_router::index::SharedIndex;
use ferry_router::placement::{Placer, Policy, jitter};
use ferry_router::workers::{Board, Pending, PrefillPending, Worker};

const PS: usize = 16;
const GROUPS: usize = 64;
const PREFIX: usize = 2048;
const LEN: usize = 4096;
const TTL: Duration = Duration::from_secs(3600);
/// smg on this machine, W = 64: (p50, mean) µs for (a), (b), (c).
const SMG: [(f64, f64); 3] = [(5.0, 5.8), (10.7, 14.2), (13.2, 17.3)];

struct Router {
    ix: SharedIndex,
    placer: Placer,
    /// The workers' published health and load, as placement reads them.
    workers: Arc<Board>,
    rng: Rng,
    /// Prompt tokens pending on the workers, and the last placements' guards.
    pending: InFlight,
}

/// The prompt tokens of the last `depth` placements, pending on their workers.
struct InFlight {
    table: Arc<PrefillPending>,
    guards: std::collections::VecDeque<Pending>,
    scratch: Vec<(usize, f64)>,
    depth: usize,
}

/// Prefills in flight in the `(b) with 32 in flight` line.
const IN_FLIGHT: usize = 32;

impl InFlight {
    /// Keeps the last `depth` placements' tokens pending at the next one (0: none).
    fn new(table: Arc<PrefillPending>, depth: usize) -> Self {
        Self { table, guards: Default::default(), scratch: Vec::new(), depth }
    }

    /// The pending tokens by slot, as placement reads them.
    fn read(&mut self, board: &ferry_router::placement::PrefillBoard) -> &[(usize, f64)] {
        self.table.by_slot(board, &mut self.scratch);
        &self.scratch
    }

    /// `tokens` pending on `w` (its holder on `board`), the oldest placement's done.
    fn add(&mut self, board: &ferry_router::placement::PrefillBoard, w: usize, tokens: usize) {
        self.guards.push_back(self.table.add(w, board.holder(w), tokens as u64));
        // The oldest prefills end.
        while self.guards.len() > self.depth {
            self.guards.pop_front();
        }
    }
}

impl Router {
    /// One placement; returns the worker, the prompt tokens it holds and (whole, index-only)
    /// seconds.
    fn place(&mut self, prompt: &[u32], now: Instant) -> (usize, usize, f64, f64) {
        let t = Instant::now();
        let board = self.workers.load();
        let t0 = Instant::now();
        let m = self.ix.matched(&prompt[..prompt.len() - 1], board.len());
        let t_match = t0.elapsed();
        let j = self.rng.next();
        let pending = self.pending.read(&board);
        let c = self.placer.prefill(prompt.len(), (&m, pending), &board, now, jitter(j as u32));
        let (w, held) = c.map_or((0, 0), |c| (c.worker, c.cached_tokens));
        let t1 = Instant::now();
        self.ix.provisional(w, prompt, now, TTL).expect("insert");
        let t_insert = t1.elapsed();
        self.pending.add(&board, w, prompt.len() - held);
        (w, held, t.elapsed().as_secs_f64(), (t_match + t_insert).as_secs_f64())
    }
}

/// Minor page faults of this process so far (`/proc/self/stat`, field 10).
fn faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |r| r.1);
    rest.split_whitespace().nth(7).and_then(|f| f.parse().ok()).unwrap_or(0)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

fn report(kind: &str, whole: &mut [f64], index: &mut [f64], smg: Option<(f64, f64)>, faults: u64) {
    whole.sort_by(f64::total_cmp);
    index.sort_by(f64::total_cmp);
    let us = 1e6;
    let mean = whole.iter().sum::<f64>() / whole.len() as f64;
    let peer = match smg {
        Some((p50, m)) => {
            format!("smg p50 {p50:.1}, mean {m:.1} µs: p50 ratio Ferry/smg {:.2}", pct(whole, 0.5) * us / p50)
        }
        None => "smg: not measured for this shape".to_string(),
    };
    println!(
        "{kind}: mean {:.1} / p50 {:.1} / p99 {:.1} / max {:.0} µs, {:.0} ops/s; index (match + insert) p50 {:.1} µs; {:.2} page faults per placement | {peer}",
        mean * us,
        pct(whole, 0.5) * us,
        pct(whole, 0.99) * us,
        whole.last().copied().unwrap_or(0.0) * us,
        1.0 / mean,
        pct(index, 0.5) * us,
        faults as f64 / whole.len() as f64,
    );
}

/// (b) placements from 1, then 2 threads at once, sharing the index and the placer as the
/// router does (each step takes its lock: match, choose, insert). A prompt is a group's prefix
/// and one of 64 random tails whose first token is made unique (so its pages are fresh),
/// copied into a reused buffer (~1 µs, counted): generating 2,048 random tokens per request
/// would cost more than the placement.
fn threads(r: Router, groups: &[Vec<u32>], rng: &mut Rng, div: usize) {
    let Router { ix, placer, workers, pending, .. } = r;
    let table = pending.table;
    let placer = std::sync::Mutex::new(placer);
    let tails: Vec<Vec<u32>> = (0..64).map(|_| rng.tokens(LEN - PREFIX)).collect();
    let now = Instant::now();
    let per = 10_000 / div;
    for (round, n) in [1usize, 2].into_iter().enumerate() {
        let t = Instant::now();
        let f0 = faults();
        let busy: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|me| {
                    let (ix, placer, workers, tails) = (&ix, &placer, &workers, &tails);
                    let mut pending = InFlight::new(Arc::clone(&table), 0);
                    s.spawn(move || {
                        let mut p = Vec::with_capacity(LEN);
                        let mut busy = 0.0;
                        for i in 0..per {
                            p.clear();
                            p.extend_from_slice(&groups[i % GROUPS]);
                            p.extend_from_slice(&tails[(i * 7 + me) % tails.len()]);
                            p[PREFIX] = (50_000 + (round * 2 + me) * per + i) as u32;
                            let t0 = Instant::now();
                            let board = workers.load();
                            let m = ix.matched(&p[..p.len() - 1], board.len());
                            let on = pending.read(&board);
                            let c = placer.lock().expect("placer").prefill(
                                p.len(),
                                (&m, on),
                                &board,
                                now,
                                jitter(i as u32),
                            );
                            let w = c.map_or(0, |c| c.worker);
                            ix.provisional(w, &p, now, TTL).expect("insert");
                            pending.add(&board, w, p.len() - c.map_or(0, |c| c.cached_tokens));
                            busy += t0.elapsed().as_secs_f64();
                        }
                        busy
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let ops = (n * per) as f64 / t.elapsed().as_secs_f64();
        let each = busy.iter().sum::<f64>() / (n * per) as f64 * 1e6;
        let f = (faults() - f0) as f64 / (n * per) as f64;
        println!(
            "(b) on {n} thread(s) at once: {ops:.0} placements/s, {each:.1} µs a placement (locks included), {f:.2} page faults per placement | smg 129,000 ops/s on 2 threads"
        );
    }
}

/// A W1 request shape: prompts of `len` tokens, `prefix` of them a group's; `preload` of them
/// placed before the timed ones.
struct Shape {
    len: usize,
    prefix: usize,
    preload: usize,
    /// smg's (p50, mean) µs for (a), (b), (c), where the issue measured them (this shape only
    /// at 64 workers).
    smg: Option<[(f64, f64); 3]>,
}

/// The shape, then its two variants.
const SHAPES: [Shape; 3] = [
    Shape { len: LEN, prefix: PREFIX, preload: 10_000, smg: Some(SMG) },
    Shape { len: 512, prefix: 256, preload: 10_000, smg: None },
    Shape { len: 32_768, prefix: 30_720, preload: 1_000, smg: None },
];

fn main() {
    let quick = ferry_core::bench::quick();
    let div = if quick { 20 } else { 1 };
    let workers: usize = std::env::var("FERRY_BENCH_WORKERS").ok().and_then(|s| s.parse().ok()).unwrap_or(64);
    // Workers as the router's registry holds them, each seen healthy with no load report
    // (placement assumes the default rate, 5,000 tokens/s); their channels never connect.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let _in_rt = rt.enter();
    let board = Arc::new(Board::default());
    let _workers: Vec<Worker> = (0..workers)
        .map(|w| {
            let id = WorkerId::new(format!("prefill-{w}")).expect("id");
            let worker = Worker::standalone(id, Role::Prefill, "127.0.0.1:9", w, Some(&board)).expect("worker");
            worker.ok();
            worker
        })
        .collect();
    let mut rng = Rng(0x5eed);
    let mut main_shape = None;
    for (k, shape) in SHAPES.iter().enumerate() {
        let groups: Vec<Vec<u32>> = (0..GROUPS).map(|_| rng.tokens(shape.prefix)).collect();
        // A fresh index for each shape, as a router restarted for it would have.
        let r = w1(shape, workers, Arc::clone(&board), &groups, &mut rng, div);
        if k == 0 {
            main_shape = Some((r, groups));
        }
    }
    if let Some((r, groups)) = main_shape {
        threads(r, &groups, &mut rng, div);
    }
}

/// W1 for one shape: preload, then (a), (b) and (c), each reported; returns the router.
fn w1(shape: &Shape, workers: usize, board: Arc<Board>, groups: &[Vec<u32>], rng: &mut Rng, div: usize) -> Router {
    let Shape { len, prefix, preload, smg } = *shape;
    // The shape prints as before; a variant names itself on each line.
    let tag = if smg.is_some() { String::new() } else { format!("[{len} tokens, {prefix} shared] ") };
    let smg = |k: usize| smg.map(|s| s[k]).filter(|_| workers == 64);
    // SmolLM2-135M: 720 KiB of KV per 16-token page; loopback TCP ~2.5 GB/s.
    let placer = Placer::new(Policy::CacheAware, 5000.0, 737_280.0 / 16.0, 2.5e9);
    let mut r = Router {
        ix: SharedIndex::new(PS, 1 << 20),
        placer,
        workers: board,
        rng: Rng(0xfeed),
        pending: InFlight::new(Arc::default(), 0),
    };
    let now = Instant::now();
    // At least one request per group, so every group has a home (the quick run divides N).
    let n = (preload / div).max(GROUPS);
    let mut preloaded = Vec::with_capacity(n);
    let mut home = vec![None; GROUPS];
    let t0 = Instant::now();
    for i in 0..n {
        let g = i % GROUPS;
        let mut p = groups[g].clone();
        p.extend(rng.tokens(len - prefix));
        let (w, ..) = r.place(&p, now);
        home[g].get_or_insert(w);
        preloaded.push((g, p));
    }
    println!(
        "{tag}W1, {workers} workers: preloaded {n} requests of {len} tokens ({} pages indexed) in {:.2} s",
        r.ix.pages(),
        t0.elapsed().as_secs_f64()
    );
    let (mut whole, mut index) = (Vec::new(), Vec::new());
    let f0 = faults();
    for _ in 0..20_000 / div {
        let (_, p) = &preloaded[(rng.next() % n as u64) as usize];
        let (_, _, a, b) = r.place(p, now);
        whole.push(a);
        index.push(b);
    }
    report(&format!("{tag}(a) exact repeat"), &mut whole, &mut index, smg(0), faults() - f0);
    let count = 20_000 / div;
    for depth in [0, IN_FLIGHT] {
        r.pending = InFlight::new(Arc::default(), depth);
        let (mut whole, mut index, mut at_home, mut holder) = (Vec::new(), Vec::new(), 0usize, 0usize);
        let f0 = faults();
        for i in 0..count {
            let g = i % GROUPS;
            let mut p = groups[g].clone();
            p.extend(rng.tokens(len - prefix));
            let (w, held, a, b) = r.place(&p, now);
            at_home += usize::from(home[g] == Some(w));
            holder += usize::from(held >= prefix);
            whole.push(a);
            index.push(b);
        }
        let share = |n: usize| 100.0 * n as f64 / count as f64;
        if depth == 0 {
            report(&format!("{tag}(b) group prefix + fresh"), &mut whole, &mut index, smg(1), faults() - f0);
            println!("{tag}(b) affinity: {:.1} % placed on the group's home (smg 100 %)", share(at_home));
        } else {
            let name = format!("{tag}(b) with {depth} in flight");
            report(&name, &mut whole, &mut index, None, faults() - f0);
            println!(
                "{name}: {:.1} % placed on the group's home, {:.1} % on a worker holding its prefix",
                share(at_home),
                share(holder)
            );
        }
    }
    r.pending = InFlight::new(Arc::default(), 0);
    let (mut whole, mut index) = (Vec::new(), Vec::new());
    let (f0, count) = (faults(), 10_000 / div);
    let mut f_half = f0;
    for i in 0..count {
        if i == count / 2 {
            f_half = faults();
        }
        let p = rng.tokens(len);
        let (_, _, a, b) = r.place(&p, now);
        whole.push(a);
        index.push(b);
    }
    // In the shape the first ~4,000 of these evict the preload's leaves (2,048 tokens
    // each) for nodes of 4,096, the second half nodes of their own size, as a router long fed
    // fresh prompts does: shown apart. (Keys are kept in chunks of 2,048 tokens, so the first
    // half reuses the evicted leaves' memory too; with whole keys it took ~3 page faults a
    // placement.)
    let (mut late, mut late_index) = (whole[count / 2..].to_vec(), index[count / 2..].to_vec());
    report(&format!("{tag}(c) fresh"), &mut whole, &mut index, smg(2), faults() - f0);
    report(&format!("{tag}(c) its second half"), &mut late, &mut late_index, smg(2), faults() - f_half);
    let s = r.ix.stats();
    println!("{tag}index: {} pages, {} evicted, {} dropped", s.provisional, s.evicted, s.dropped);
    r
}
