//! Load spreads (issue 61): a burst of requests sharing a prefix that one worker caches uses
//! every worker, decode and prefill alike, where the router knew only the caches and load
//! reports a poll interval old (all went to the worker holding the prefix). Each test counts
//! the router's placements per worker.

use ferry_tests::{TinyModel, decode_256, greedy, prefill_256, routed, router_over, seen, settle, settle_decode};

/// The tests here read counters every daemon in this process shares (placements): one at a
/// time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `metric`'s count for each of `ids` (its `worker` label), from the router's `/metrics`.
async fn per_worker(r: &ferry_router::Running, metric: &str, ids: &[String]) -> Vec<f64> {
    let body = ferry_tests::scrape(r.metrics_addr).await;
    ids.iter().map(|id| ferry_tests::metric_sum(&body, metric, &format!("worker=\"{id}\""))).collect()
}

/// Issue 61: decode placement spreads load. Twelve chats at once, all opening with one shared
/// system turn that one decode worker already caches: the second, idle decode worker must
/// take its share (at least 30 % each), since a few cached pages save far less than sharing a
/// busy node's batch costs (`--decode-request-tokens`). With it at 0 (the decode caches
/// alone, the rule before) all 12 go to the node holding the system turn: [12, 0].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chats_sharing_a_system_turn_spread_over_both_decode_workers() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let p = prefill_256(&m).await;
    let ds = [decode_256(&m, true).await, decode_256(&m, true).await];
    let decode: Vec<String> = ds.iter().map(|d| d.grpc_addr.to_string()).collect();
    let r = router_over(&m, &[p.grpc_addr.to_string()], &decode, |_| ()).await;
    let system: Vec<u32> = (0..40).map(|i| 3 + (i * 13 + 5) % 340).collect();
    let chat =
        |i: u32| -> Vec<u32> { system.iter().copied().chain((0..12).map(|k| 3 + (i * 31 + k * 7) % 340)).collect() };
    // One chat first: a decode worker caches the system turn, and the router learns it.
    routed(r.grpc_addr, &chat(100), &greedy(8)).await;
    settle_decode(&ds).await;
    seen(&[&r], &system[..32]).await;
    // The router's decode workers, by the id it knows them by.
    let ids: Vec<String> = r.workers().snapshot().decode.iter().map(|w| w.id.to_string()).collect();
    assert_eq!(ids.len(), 2);
    let placed = || per_worker(&r, "ferry_router_decode_placements_total", &ids);
    let before = placed().await;
    let (chats, params) = ((0..12).map(chat).collect::<Vec<_>>(), greedy(24));
    futures::future::join_all(chats.iter().map(|c| routed(r.grpc_addr, c, &params))).await;
    let after = placed().await;
    let served: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(served.iter().sum::<f64>(), 12.0, "{served:?}");
    assert!(served.iter().all(|&n| n >= 4.0), "each decode worker serves at least 30 % of 12 chats: {served:?}");
    settle(&p, &ds).await;
    r.stop().await;
    p.stop().await;
    for d in ds {
        d.stop().await;
    }
}

/// A burst of chats sharing a system turn that one prefill worker caches: the router counts
/// the prompt tokens it has sent each prefill worker and not yet seen computed, so the other
/// worker takes its share at once instead of a poll interval later (with nothing pending
/// counted, all 12 go to the worker holding the system turn). The decode worker computes no
/// prompt here (`--local-prefill-max 0`, no decode cache).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_sharing_a_cached_prefix_spreads_over_both_prefill_workers() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let ps = [prefill_256(&m).await, prefill_256(&m).await];
    let d = decode_256(&m, false).await;
    let prefill: Vec<String> = ps.iter().map(|p| p.grpc_addr.to_string()).collect();
    let r = router_over(&m, &prefill, &[d.grpc_addr.to_string()], |a| a.local_prefill_max = 0).await;
    let system: Vec<u32> = (0..48).map(|i| 3 + (i * 13 + 5) % 340).collect();
    let chat =
        |i: u32| -> Vec<u32> { system.iter().copied().chain((0..160).map(|k| 3 + (i * 31 + k * 7) % 340)).collect() };
    // One chat first: a prefill worker caches the system turn, and the router learns it.
    routed(r.grpc_addr, &chat(100), &greedy(4)).await;
    let held = || r.prefill_index().confirmed_matched(&system, ps.len());
    ferry_tests::until("the router's index to hold the system turn", || held().contains(&system.len())).await;
    let home = held().iter().position(|&t| t == system.len()).expect("a worker holds it");
    let ids: Vec<String> = r
        .workers()
        .snapshot()
        .prefill
        .iter()
        .map(|w| w.as_ref().map_or_else(String::new, |w| w.id.to_string()))
        .collect();
    assert_eq!(ids.len(), 2);
    let placed = || per_worker(&r, "ferry_router_placements_total", &ids);
    let before = placed().await;
    let (chats, params) = ((0..12).map(chat).collect::<Vec<_>>(), greedy(4));
    futures::future::join_all(chats.iter().map(|c| routed(r.grpc_addr, c, &params))).await;
    let after = placed().await;
    let served: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(served.iter().sum::<f64>(), 12.0, "every chat through a prefill worker: {served:?}");
    assert!(
        served.iter().all(|&n| n >= 4.0),
        "each prefill worker computes at least 30 % of 12 chats (worker {home} holds the system turn): {served:?}"
    );
    for p in &ps {
        settle(p, std::slice::from_ref(&d)).await;
    }
    r.stop().await;
    for p in ps {
        p.stop().await;
    }
    d.stop().await;
}
