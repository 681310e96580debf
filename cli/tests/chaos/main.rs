//! The chaos suite: under steady load through the router, real processes are killed with
//! SIGKILL — a prefill daemon, a decode daemon, the router (then restarted), etcd —, the
//! decode nodes' data plane is cut and slowed, and a prefill daemon is frozen (SIGSTOP).
//! Every request must complete with the colocated engine's tokens (retrying retriable
//! errors, as a client would) within its deadline; nothing may hang; the router must drop
//! dead workers; and at the end every worker's page pool must be back at its baseline. A
//! direct caller reusing one room id ([`reuse`]) must get the reference tokens or a clear
//! status, never another request's KV. A decode node's data plane stalled mid-frame and a
//! handshake address that never answers ([`blackhole`]) must each end their room within its
//! timeout with a clear reason. The
//! decode pools are small enough that decode daemons retract running requests (and
//! recompute them) throughout. The figures per fault are printed and written to
//! `target/tmp/chaos-report.md` (docs/reliability.md quotes them).
//!
//! Loopback only, bounded: about 9 fault phases of a few seconds, 3 clients, 32-token answers.

mod blackhole;
mod cluster;
mod freeze;
mod load;
mod reuse;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::Cluster;
use ferry_proto::v1 as pb;
use load::{Load, Tally};

const MAX_TOKENS: u32 = 32;
const CLIENTS: usize = 3;

const SHARED: &str = "You are a helpful assistant for a shipping company. Answer in one short sentence, \
    politely, without lists, and never mention that you are an AI. Our ferries cross the bay every hour \
    from six in the morning to ten at night, and tickets can be bought at the pier or online.";
const QUESTIONS: [&str; 8] = [
    "When does the first ferry leave?",
    "Where can I buy a ticket?",
    "How often do the ferries cross?",
    "What is the capital of France?",
    "Can I bring my bicycle?",
    "When is the last crossing?",
    "Is there a ferry at noon?",
    "Name a colour of the sea.",
];

async fn prompts(c: &Cluster, model: &std::path::Path) -> Vec<(Vec<u32>, Vec<u32>)> {
    let ch = ferry_tests::channel(c.router_grpc.parse().expect("addr")).await;
    let mut r = pb::router_client::RouterClient::new(ch);
    let mut ids = Vec::new();
    for q in QUESTIONS {
        let req = pb::TokenizeRequest { input: Some(pb::tokenize_request::Input::Text(format!("{SHARED}\n\n{q}"))) };
        ids.push(r.tokenize(req).await.expect("tokenize").into_inner().token_ids);
    }
    let want = ferry_tests::colocated(model, &ids, &ferry_tests::greedy(MAX_TOKENS));
    ids.into_iter().zip(want).collect()
}

/// `n` prompts of 160 tokens (20 pages of 8) that share nothing with the load's or each other's
/// (their first words differ), tokenized by the router.
async fn unique_prompts(c: &Cluster, n: usize) -> Vec<Vec<u32>> {
    const WORDS: [&str; 16] = [
        "harbour", "lantern", "copper", "meadow", "violet", "anchor", "thistle", "granite", "orchard", "pepper",
        "saddle", "willow", "ember", "falcon", "marble", "juniper",
    ];
    let ch = ferry_tests::channel(c.router_grpc.parse().expect("addr")).await;
    let mut r = pb::router_client::RouterClient::new(ch);
    let mut out = Vec::new();
    for (i, name) in WORDS.iter().enumerate().take(n) {
        let mut x = 0x9E37_79B9u64 ^ ((i as u64 + 1) * 0x1000_0000_01B3);
        let text: Vec<&str> = (0..200)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                WORDS[(x % 16) as usize]
            })
            .collect();
        let text = format!("Inventory {} of the {name} warehouse: {}", 1000 + i, text.join(" "));
        let req = pb::TokenizeRequest { input: Some(pb::tokenize_request::Input::Text(text)) };
        let ids = r.tokenize(req).await.expect("tokenize").into_inner().token_ids;
        assert!(ids.len() >= 160, "{} tokens", ids.len());
        out.push(ids[..160].to_vec());
    }
    out
}

/// Phase boundaries with the router's retry counters at each.
struct Phases {
    marks: Vec<(String, [f64; 2])>,
    retries: Vec<[f64; 2]>,
}

impl Phases {
    async fn begin(&mut self, c: &Cluster, load: &Load, name: &str) {
        load.wait_sent(Duration::from_secs(30)).await;
        let now = c.router_retries().await;
        if let Some((_, start)) = self.marks.last() {
            // A restarted router counts from zero again.
            let d = |i: usize| if now[i] >= start[i] { now[i] - start[i] } else { now[i] };
            self.retries.push([d(0), d(1)]);
        }
        self.marks.push((name.into(), now));
        load.phase(name);
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn report(
    tallies: &[(String, Tally)],
    retries: &[[f64; 2]],
    notes: &[String],
    pages: &[(String, pb::LoadReport)],
) -> String {
    let mut s = String::from(
        "| fault (phase) | sent | completed | wrong | failed | errors clients saw in the phase | client retries | router retries (prefill / decode) | hung | lost | e2e p50 / max (s) | slowest request |\n|---|---:|---:|---:|---:|---|---:|---|---:|---:|---|---|\n",
    );
    for (i, (name, t)) in tallies.iter().enumerate() {
        let r = retries.get(i).copied().unwrap_or_default();
        let errors: Vec<String> = t.errors.iter().map(|(k, n)| format!("{n}× {k}")).collect();
        let max = t.latencies.iter().copied().fold(0.0, f64::max);
        let slowest = t.slowest.as_ref().map_or(String::new(), |(_, id)| id.clone());
        s += &format!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {:.2} / {:.2} | {slowest} |\n",
            t.sent,
            t.completed,
            t.wrong,
            t.failed,
            if errors.is_empty() { "none".into() } else { errors.join("; ") },
            t.retried,
            r[0] as u64,
            r[1] as u64,
            t.hung,
            t.lost,
            median(&t.latencies),
            max
        );
    }
    s += "\n| worker | pages total | free | evictable (prefix cache) | in use by requests (leaked) |\n|---|---:|---:|---:|---:|\n";
    for (name, l) in pages {
        let leaked = l.total_pages - l.free_pages - l.evictable_pages;
        s += &format!("| {name} | {} | {} | {} | {leaked} |\n", l.total_pages, l.free_pages, l.evictable_pages);
    }
    s += "\n";
    for n in notes {
        s += &format!("- {n}\n");
    }
    s
}

/// Whether no worker holds a page for a request: decode pools all free, prefill pools free or
/// evictable cache, and no queue holds anything.
fn at_baseline(loads: &[(String, pb::LoadReport)]) -> bool {
    loads
        .iter()
        .all(|(_, l)| l.free_pages + l.evictable_pages == l.total_pages && l.queue_depth.values().all(|&n| n == 0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_cuts_and_delays_lose_no_request_and_leak_no_page() {
    let model = ferry_tests::smollm2();
    let t0 = Instant::now();
    let mut c = Cluster::start(&model).await;
    let all = (["p0", "p1"], ["d0", "d1"]);
    let prompts = Arc::new(prompts(&c, &model).await);
    let lens = prompts.iter().map(|p| p.0.len());
    let mut notes = vec![format!(
        "cluster of 5 processes + etcd up and references computed in {:.1} s; prompts of {}–{} tokens",
        t0.elapsed().as_secs_f64(),
        lens.clone().min().unwrap_or(0),
        lens.max().unwrap_or(0)
    )];
    let load = Load::new("steady load");
    let mut phases = Phases { marks: vec![("steady load".into(), c.router_retries().await)], retries: Vec::new() };
    let tasks = load.spawn(CLIENTS, c.router_grpc.clone(), Arc::clone(&prompts), MAX_TOKENS);
    // FERRY_CHAOS_SCALE=3 makes every phase three times longer (more requests per fault).
    let scale: f64 = std::env::var("FERRY_CHAOS_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let pause = |s: f64| tokio::time::sleep(Duration::from_secs_f64(s * scale));
    pause(6.0).await;

    // Each fault hits a worker holding a request (the first one found busy).
    let mut idle_kills = Vec::new();
    phases.begin(&c, &load, "kill -9 a busy prefill").await;
    pause(0.5).await;
    let busy = Cluster::wait_busy(&c.prefill).await;
    let i = busy.unwrap_or(0);
    let (name, other) = (all.0[i], all.0[1 - i]);
    if busy.is_none() {
        idle_kills.push(name);
    }
    c.prefill[i].kill9();
    let unhealthy = c.wait_members(&[other], &all.1, Duration::from_secs(20)).await;
    let gone = c.wait_absent(name, Duration::from_secs(20)).await;
    notes.push(format!(
        "{name} killed{}: the router stopped placing on it after {:.2} s (failed health check) and removed it, freeing its prefix-index slot, after {:.2} s (etcd lease TTL 2 s)",
        if busy.is_some() { " while holding a request" } else { "" },
        unhealthy.as_secs_f64(),
        gone.as_secs_f64()
    ));
    pause(3.0).await;
    c.prefill[i].start();
    c.wait_members(&all.0, &all.1, Duration::from_secs(30)).await;

    phases.begin(&c, &load, "kill -9 a busy decode").await;
    pause(0.5).await;
    let busy = Cluster::wait_busy(&c.decode).await;
    let i = busy.unwrap_or(0);
    let (name, other) = (all.1[i], all.1[1 - i]);
    if busy.is_none() {
        idle_kills.push(name);
    }
    // Its counters restart with the process: keep what it did before the kill.
    let mut retractions = c.retractions(i).await;
    let moved = c.router_migrations().await;
    c.decode[i].kill9();
    let unhealthy = c.wait_members(&all.0, &[other], Duration::from_secs(20)).await;
    let gone = c.wait_absent(name, Duration::from_secs(20)).await;
    notes.push(format!(
        "{name} killed{}: the router stopped placing on it after {:.2} s and removed it after {:.2} s; {} streams moved to {other}",
        if busy.is_some() { " while holding a request" } else { "" },
        unhealthy.as_secs_f64(),
        gone.as_secs_f64(),
        c.router_migrations().await - moved
    ));
    pause(3.0).await;
    c.decode[i].start();
    c.wait_members(&all.0, &all.1, Duration::from_secs(30)).await;

    phases.begin(&c, &load, "kill -9 router, restart").await;
    // Prompts no one else sends, each cached on the one prefill node that computed it: the
    // restarted router, its index empty, must learn where from the workers and place each
    // there again.
    // The router's index then knows every page the prefill nodes cache, these prompts' 40
    // among them; a restarted router must know as many again from the workers' snapshots
    // (the load's prompts, all cached already, store no new pages to make up for a snapshot
    // lost: they hold ~30 distinct pages in all).
    let router_addr: std::net::SocketAddr = c.router_grpc.parse().expect("addr");
    let before = c.router_index_pages().await;
    let homes = unique_prompts(&c, 2).await;
    for p in &homes {
        ferry_tests::routed(router_addr, p, &ferry_tests::greedy(1)).await;
    }
    let unique_pages = homes.iter().map(|p| p.len() / 8).sum::<usize>() as f64;
    let known = c.wait_index_pages(before + unique_pages, Duration::from_secs(20)).await;
    pause(0.5).await;
    c.router.kill9();
    pause(2.0).await;
    let t = Instant::now();
    c.router.start();
    c.wait_members(&all.0, &all.1, Duration::from_secs(30)).await;
    let members = t.elapsed();
    let resynced = c.wait_index_pages(known.unwrap_or(f64::MAX), Duration::from_secs(20)).await;
    let resynced = resynced.map(|pages| (t.elapsed(), pages));
    let mut placed_home = Vec::new();
    for p in &homes {
        let (_, cached) = ferry_tests::routed(router_addr, p, &ferry_tests::greedy(1)).await;
        placed_home.push((cached as usize, p.len()));
    }
    notes.push(format!(
        "router restarted and saw all 4 workers {:.2} s after its start; {}; prompts cached before the kill, sent again: {}",
        members.as_secs_f64(),
        match resynced {
            Some((d, pages)) => format!(
                "its prefix index held {pages} confirmed pages from the workers' snapshots {:.2} s after its start (the old one: {})",
                d.as_secs_f64(),
                known.unwrap_or_default()
            ),
            None => format!(
                "its prefix index held {} pages 20 s after its start, not the old one's {known:?}",
                c.router_index_pages().await
            ),
        },
        placed_home.iter().map(|(c, n)| format!("{c} of {n} tokens found cached")).collect::<Vec<_>>().join(", ")
    ));
    pause(3.0).await;

    phases.begin(&c, &load, "kill -9 etcd, restart").await;
    pause(0.5).await;
    c.etcd.kill();
    pause(5.0).await;
    let t = Instant::now();
    c.etcd.restart();
    c.wait_members(&all.0, &all.1, Duration::from_secs(30)).await;
    notes.push(format!(
        "etcd down 5 s: serving went on from the router's last view; all 4 workers listed {:.2} s after etcd restarted",
        t.elapsed().as_secs_f64()
    ));
    pause(3.0).await;

    phases.begin(&c, &load, "data plane cut").await;
    pause(0.5).await;
    // Cut while a transfer is under way, for 1.5 s and on until a transfer failed for it and
    // the router retried (10 s at most): a cut that hits no transfer tests nothing.
    c.wait_transfer(Duration::from_secs(20)).await;
    let before: f64 = c.router_retries().await.iter().sum();
    let t = Instant::now();
    for p in &c.proxies {
        p.cut();
    }
    pause(1.5).await;
    let mut cut_retried = false;
    while t.elapsed() < Duration::from_secs(10) {
        if c.router_retries().await.iter().sum::<f64>() > before {
            cut_retried = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for p in &c.proxies {
        p.restore();
    }
    notes.push(format!(
        "data plane cut for {:.2} s{}",
        t.elapsed().as_secs_f64(),
        if cut_retried { "; the router retried a transfer it broke" } else { "; no transfer failed" }
    ));
    pause(4.0).await;

    phases.begin(&c, &load, "data plane +20 ms per read").await;
    let delayed = |c: &Cluster| c.proxies.iter().map(ferry_tests::proxy::Proxy::delayed).sum::<u64>();
    let held = delayed(&c);
    for p in &c.proxies {
        p.delay(Duration::from_millis(20));
    }
    pause(5.0).await;
    for p in &c.proxies {
        p.delay(Duration::ZERO);
    }
    let slowed = delayed(&c) - held;
    notes.push(format!("the data plane held {slowed} chunks 20 ms each for 5 s"));

    phases.begin(&c, &load, "a busy prefill frozen (SIGSTOP)").await;
    pause(0.5).await;
    let frozen = freeze::busy_prefill(&c, &load, all.0, &all.1).await;
    notes.push(format!(
        "{} frozen{} for {:.1} s ({} freeze(s) made, a freeze that caught no request made again): the router stopped placing on it after {:.2} s; {}; requests sent before then and unanswered when it thawed: {}",
        frozen.name,
        if frozen.busy { " while holding a request" } else { "" },
        frozen.frozen_for.as_secs_f64(),
        frozen.tries,
        frozen.unhealthy.as_secs_f64(),
        match frozen.moved {
            Some(d) => format!("the request it held was retried elsewhere after {:.2} s", d.as_secs_f64()),
            None => "no request it held was retried while it was frozen".into(),
        },
        frozen.waited
    ));

    phases.begin(&c, &load, "d0 out of file descriptors").await;
    pause(0.5).await;
    // Every new socket of d0 fails (EMFILE) for 2 s: a connection made to its data port then
    // (and the senders' reconnects after a cut) waits in the kernel's queue while the accept
    // loop fails, counts and retries; once descriptors are back it is served.
    let accept_errors = c.accept_errors(0).await;
    let limit = c.decode[0].exhaust_files();
    let pending = tokio::net::TcpStream::connect(&c.decode_data[0]).await.expect("queued by the kernel");
    c.proxies[0].cut();
    pause(0.3).await;
    c.proxies[0].restore();
    pause(2.0).await;
    c.decode[0].set_file_limit(limit);
    pause(0.5).await;
    let accept_errors = c.accept_errors(0).await - accept_errors;
    drop(pending);
    notes.push(format!(
        "d0 had no file descriptor to spare for {:.1} s: its data-plane accept failed {accept_errors} times (each retried after 100 ms); serving went on",
        2.3 * scale
    ));
    pause(2.0).await;

    phases.begin(&c, &load, "a stall mid-frame; a handshake black hole").await;
    pause(0.5).await;
    // One decode node's data plane stops in the middle of a chunk and closes nothing (a
    // frozen or partitioned link); at the same time a direct caller names a bootstrap address
    // that accepts and never answers. Each stuck room must end within its timeout (10 s
    // here) with a clear reason while other rooms go on.
    let stalled = c.wait_transfer_at(Duration::from_secs(20)).await;
    let i = stalled.unwrap_or(0);
    let failures = c.receiver_failures(i).await;
    let retries: f64 = c.router_retries().await.iter().sum();
    let t = Instant::now();
    c.proxies[i].stall(true);
    let (target, prompt) = (c.decode[1 - i].grpc.clone(), prompts[1].0.clone());
    let hole = tokio::spawn(async move { blackhole::run(&target, &prompt, Duration::from_secs(30)).await });
    // The stuck room ends on whichever side notices first: the receiver (no byte for the
    // transferring timeout) or the sender (no acknowledgement within it, the stall holding
    // acknowledgements too), whose failure the router retries.
    let mut stall_ended = None;
    while t.elapsed() < Duration::from_secs(20) {
        let retried = c.router_retries().await.iter().sum::<f64>() > retries;
        if retried || c.receiver_failures(i).await > failures {
            stall_ended = Some(t.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.proxies[i].stall(false);
    let hole = hole.await.expect("black-hole caller");
    notes.push(format!(
        "d{i}'s data plane stalled mid-chunk{}: {}; a Decode call to d{} naming a black-hole bootstrap address ended after {:.1} s with {}",
        if stalled.is_some() { " during a transfer" } else { "" },
        match stall_ended {
            Some(d) => format!("the stuck room ended after {:.1} s (its receiver failed it or the router retried it)", d.as_secs_f64()),
            None => "no room failed on it within 20 s".into(),
        },
        1 - i,
        hole.took.as_secs_f64(),
        hole.status.as_ref().map_or("no status".into(), |s| format!("{:?} ({})", s.code(), s.message())),
    ));
    pause(1.0).await;

    phases.begin(&c, &load, "a direct caller reusing one room id").await;
    let (prompt, want) = &prompts[0];
    // 8 tokens of the reference (greedy: a prefix of its 32), so a round is quick.
    let rounds = (3.0 * scale) as u64;
    let reused = reuse::run(&c.decode[0].grpc, &c.prefill[0].grpc, prompt, &want[..8], rounds).await;
    notes.push(format!(
        "a direct caller sent {} request pairs with one room id to d0 and p0, dropping every other one mid-flight and sending the next at once: {} completed with the reference tokens, {} wrong, {} cancelled, {} hung; errors: {:?}",
        reused.sent, reused.completed, reused.wrong, reused.cancelled, reused.hung, reused.errors
    ));

    phases.begin(&c, &load, "recovery").await;
    pause(3.0).await;
    load.wait_sent(Duration::from_secs(30)).await;
    let t = Instant::now();
    load.finish(tasks).await;
    phases.begin(&c, &load, "end").await;
    notes.push(format!("the last requests finished {:.2} s after the load stopped", t.elapsed().as_secs_f64()));

    // Pools back at baseline on every worker (the restarted ones too).
    let t = Instant::now();
    let mut loads = c.loads().await;
    while !at_baseline(&loads) && t.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        loads = c.loads().await;
    }
    retractions += c.retractions(0).await + c.retractions(1).await;
    notes.push(format!("decode daemons retracted (and recomputed) running requests {} times", retractions as u64));
    notes.push(format!("whole run {:.0} s", t0.elapsed().as_secs_f64()));
    let tallies: Vec<_> = load.tallies().into_iter().filter(|(n, _)| n != "end").collect();
    let text = report(&tallies, &phases.retries, &notes, &loads);
    println!("\n{text}");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("chaos-report.md");
    std::fs::write(&out, &text).expect("write the report");
    println!("written to {}", out.display());

    // Every broken promise, listed together after the report (and last in the output, so a
    // CI log cut short still shows them).
    let mut broken: Vec<String> = Vec::new();
    let mut check = |ok: bool, why: String| {
        if !ok {
            broken.push(why);
        }
    };
    check(at_baseline(&loads), "pages or queues not back at baseline (see the load table)".into());
    check(idle_kills.is_empty(), format!("killed while holding no request (the phase tested nothing): {idle_kills:?}"));
    check(cut_retried, "the data-plane cut broke no transfer".into());
    check(known.is_some(), "the router's index never confirmed the prompts cached before its kill".into());
    check(resynced.is_some(), "the restarted router's prefix index did not learn what the workers cache".into());
    check(
        placed_home.iter().all(|&(cached, n)| cached + 8 >= n),
        format!(
            "the restarted router did not place cached prompts where they were cached (cached / tokens): {placed_home:?}"
        ),
    );
    check(slowed > 0, "the slowed data plane carried nothing: the phase tested nothing".into());
    check(frozen.busy, "no prefill was busy to freeze: the phase tested nothing".into());
    check(
        frozen.waited == 0,
        format!(
            "{} request(s) sent before the router stopped placing on the frozen prefill were still unanswered when it thawed",
            frozen.waited
        ),
    );
    // The router ends a call to a worker as soon as its health checks take it out of
    // placement (`Worker::taken_out`); the HTTP/2 pings, or the decode side failing, would
    // move the request too, ~6 s later.
    let moved = frozen.moved.unwrap_or_default().as_secs_f64();
    check(
        frozen.moved.is_none_or(|d| d <= frozen.unhealthy + Duration::from_secs(2)),
        format!(
            "the frozen prefill's request was retried {moved:.2} s after SIGSTOP, {:.2} s after the router took the daemon out of placement: not when it did",
            moved - frozen.unhealthy.as_secs_f64()
        ),
    );
    check(
        frozen.moved.is_some() || frozen.waited > 0,
        format!("none of {} freezes caught a request in flight: the phase tested nothing", frozen.tries),
    );
    check(retractions > 0.0, "the decode pools were sized to make retractions happen; none did".into());
    check(accept_errors > 0.0, "d0 never failed an accept while out of descriptors".into());
    // Each stuck room ends within its timeout (10 s) and the time to notice it (4 s).
    let bound = Duration::from_secs(14);
    check(stalled.is_some(), "no transfer was under way to stall: the phase tested nothing".into());
    check(stall_ended.is_some_and(|d| d <= bound), format!("the room stalled mid-frame ended after {stall_ended:?}"));
    // Ended by the handshake timeout or, sooner, by the unanswered HTTP/2 keepalive; either
    // way with the reason named.
    let hole_reason = hole.status.as_ref().and_then(|s| s.metadata().get("ferry-reason")?.to_str().ok());
    check(
        matches!(hole_reason, Some("handshake_timeout" | "prefill_unreachable")),
        format!("the black-hole handshake: {hole:?}"),
    );
    check(hole.took <= bound, format!("the black-hole handshake ended after {:?}", hole.took));
    check((reused.wrong, reused.hung) == (0, 0), format!("the direct caller reusing a room id: {reused:?}"));
    check(reused.completed > 0 && reused.cancelled > 0, format!("the room-id reuse phase tested nothing: {reused:?}"));
    check(reused.unclear().is_empty(), format!("room-id reuse met unclear errors: {:?}", reused.unclear()));
    for (i, (name, t)) in tallies.iter().enumerate() {
        check(t.sent > 0, format!("{name}: no request sent"));
        // Errors reach clients only where the phase's fault explains them: a router that is
        // gone. Every other fault the router hides (a killed decode node's streams move to
        // the other: `--migration-limit`).
        let explained: &[&str] = match name.as_str() {
            "kill -9 router, restart" => &["Unavailable", "Unknown"],
            _ => &[],
        };
        let unexplained: Vec<_> = t.errors.keys().filter(|k| !explained.iter().any(|e| k.starts_with(e))).collect();
        check(
            unexplained.is_empty(),
            format!("{name}: clients saw errors no fault of the phase explains: {unexplained:?}"),
        );
        // A slower link is not a failure: nothing may time out and be retried for it.
        if name == "data plane +20 ms per read" {
            let r = phases.retries.get(i).copied().unwrap_or_default();
            check(
                r == [0.0, 0.0],
                format!("{name}: the router retried {r:?} (prefill / decode) on a link only slower"),
            );
        }
        check(
            (t.wrong, t.failed, t.hung, t.lost) == (0, 0, 0, 0),
            format!("{name}: wrong {}, failed {}, hung {}, lost {}", t.wrong, t.failed, t.hung, t.lost),
        );
        check(t.completed == t.sent, format!("{name}: {} of {} requests completed", t.completed, t.sent));
    }
    if !broken.is_empty() {
        // The report above says the rest; a backtrace of this line would only push the
        // reasons out of a log's tail.
        std::panic::set_hook(Box::new(|info| eprintln!("{info}")));
        panic!("chaos: {} promise(s) broken:\n- {}", broken.len(), broken.join("\n- "));
    }
}
