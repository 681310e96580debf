//! The decode node's prefix cache (issue 20, first step): prompts prefilled on the decode
//! worker compute only what its cache lacks — a shared prefix, or a conversation's earlier
//! turns including the answer the node generated itself — and answer exactly as without the
//! cache; the cached pages stay evictable (the pool is whole again once requests end); the
//! router reports the cached tokens in `usage`.

use ferry_engine::SamplingParams;
use ferry_proto::v1 as pb;
use ferry_tests::{
    TinyModel, colocated_scored, decode_256, greedy, one_of_each, prefill_256, routed, router_for, router_over, seen,
    settle, settle_decode,
};

/// The tests here read counters every daemon in this process shares (bytes sent, pages held,
/// placements): one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The same tokens, and logprobs within float noise (a cached prefix's KV is the same
/// numbers, computed in other chunks).
fn same(got: &[(u32, f32)], want: &[(u32, f32)], what: &str) {
    let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(ids(got), ids(want), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!((g.1 - w.1).abs() < 1e-4, "{what}: logprob {} against {}", g.1, w.1);
    }
}

/// One request prefilled on the decode worker at `addr`: its tokens with their logprobs, and
/// the prompt tokens it found cached.
async fn run(addr: std::net::SocketAddr, prompt: &[u32], params: &SamplingParams) -> (Vec<(u32, f32)>, u32) {
    let mut dc = pb::decode_client::DecodeClient::new(ferry_tests::channel(addr).await);
    let key = ferry_cluster::RoomKey::random();
    let req = pb::DecodeRequest {
        request_id: format!("cache-{}", key.room.get()),
        room: Some(ferry_cluster::wire::room_key_to_proto(&key)),
        prefill_bootstrap_addr: String::new(),
        token_ids: prompt.to_vec(),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(params)),
    };
    let mut s = dc.generate(req).await.expect("generate").into_inner();
    let (mut out, mut cached) = (Vec::new(), None);
    while let Some(m) = s.message().await.expect("stream") {
        cached.get_or_insert(m.cached_tokens);
        out.extend(m.logprobs.iter().map(|l| (l.token_id, l.logprob)));
    }
    (out, cached.unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_prefilled_on_decode_reuse_its_cache_and_answer_the_same() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let prefix: Vec<u32> = (0..100).map(|i| 3 + (i * 37 + 11) % 340).collect();
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|k| prefix.iter().copied().chain((0..10).map(|i| 3 + (i * 7 + k * 53) % 340)).collect())
        .collect();
    let params = greedy(20);
    let want = colocated_scored(&m.path(), &prompts, &params);
    let (on, off) = (decode_256(&m, true).await, decode_256(&m, false).await);
    for (i, p) in prompts.iter().enumerate() {
        let (got, cached) = run(on.grpc_addr, p, &params).await;
        same(&got, &want[i], &format!("prompt {i} with the cache"));
        // The first fills the cache; the others find the prefix's 6 whole pages of 16.
        assert_eq!(cached, if i == 0 { 0 } else { 96 }, "prompt {i}");
        let (got, cached) = run(off.grpc_addr, p, &params).await;
        same(&got, &want[i], &format!("prompt {i} without the cache"));
        assert_eq!(cached, 0);
    }
    // A second turn: the first turn's prompt, the answer the node generated, and more. Its
    // cache holds both (the answer's KV but its last token's, in whole pages).
    let (answer, _) = run(on.grpc_addr, &prompts[0], &params).await;
    let mut turn = prompts[0].clone();
    turn.extend(answer.iter().map(|a| a.0));
    turn.extend([5, 6, 7, 8, 9]);
    let want = colocated_scored(&m.path(), std::slice::from_ref(&turn), &params);
    let (got, cached) = run(on.grpc_addr, &turn, &params).await;
    same(&got, &want[0], "the second turn with the cache");
    let held = (prompts[0].len() + answer.len() - 1) / 16 * 16;
    assert_eq!(cached as usize, held, "the second turn found the first turn and its answer");
    same(&run(off.grpc_addr, &turn, &params).await.0, &want[0], "the second turn without the cache");

    // Every page back: free or evictable; the cache keeps what it holds.
    settle_decode(&[on, off]).await;
}

/// Colocated through the router: the second request for a prompt reports the tokens the
/// decode worker's cache held in `usage.prompt_tokens_details.cached_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_reports_tokens_the_decode_cache_held() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 512, |_| ()).await;
    let colocated = router_for(&m, &p, &d, |a| a.local_prefill_below = usize::MAX).await;
    let model = ferry_tests::served_model(colocated.http_addr).await;
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 13 + 5) % 340).collect();
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}).to_string();
    let mut cached = Vec::new();
    for _ in 0..2 {
        let (s, _, text) = ferry_tests::http(colocated.http_addr, "POST", "/v1/completions", body.as_bytes()).await;
        assert_eq!(s, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens"));
    }
    assert_eq!(cached, [0, 64], "the second found the prompt's 4 whole pages");
    settle_decode(std::slice::from_ref(&d)).await;
    // The cached pages are reported evictable, apart from the free ones, as a prefill
    // worker's are (the router counts both as room).
    let mut load = pb::load_client::LoadClient::new(ferry_tests::channel(d.grpc_addr).await);
    let l = load.report(pb::LoadRequest {}).await.expect("load").into_inner();
    assert!(l.evictable_pages >= 4 && l.free_pages + l.evictable_pages == l.total_pages, "{l:?}");
    colocated.stop().await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}

/// Delta transfer: a prompt prefilled on a prefill node, whose first pages the decode node's
/// cache holds (a conversation's first turn and the answer the decode node generated, which
/// the prefill node never saw), is answered as without the cache, and the prefill node sends
/// only the pages after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_sends_only_the_pages_the_decode_cache_lacks() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let p = prefill_256(&m).await;
    let (on, off) = (decode_256(&m, true).await, decode_256(&m, false).await);
    let (pd_on, pd_off) = (
        ferry_tests::Client::new(on.grpc_addr, Some(p.grpc_addr)).await,
        ferry_tests::Client::new(off.grpc_addr, Some(p.grpc_addr)).await,
    );
    let params = greedy(20);
    // Every daemon here shares the process's metrics: read around one request at a time.
    let counted = || async {
        let body = ferry_tests::scrape(on.metrics_addr).await;
        let sum = |name: &str| ferry_tests::metric_sum(&body, name, "");
        (sum("ferry_transfer_bytes_total"), sum("ferry_transfer_pages_held_total"))
    };
    let prompt: Vec<u32> = (0..100).map(|i| 3 + (i * 37 + 11) % 340).collect();
    let (bytes0, held0) = counted().await;
    let answer = pd_on.generate(&prompt, &params).await.expect("first turn");
    let (bytes1, held1) = counted().await;
    assert_eq!(held1, held0, "nothing cached yet");
    let mut turn = prompt.clone();
    turn.extend(&answer);
    turn.extend([5, 6, 7, 8, 9]);
    let want = colocated_scored(&m.path(), std::slice::from_ref(&turn), &params);
    let got = pd_on.generate_scored(&turn, &params).await.expect("second turn, with the cache");
    same(&got, &want[0], "the second turn, its first pages held by the decode node");
    let (bytes2, held2) = counted().await;
    // The first turn and its answer but the answer's last token: 119 tokens, 7 whole pages of
    // the second turn's 8.
    assert_eq!(held2 - held1, 7.0, "pages the decode cache held");
    let got = pd_off.generate_scored(&turn, &params).await.expect("second turn, without the cache");
    same(&got, &want[0], "the second turn without the cache");
    let (bytes3, _) = counted().await;
    let page = (bytes1 - bytes0) / 7.0;
    assert_eq!(bytes2 - bytes1, page, "one page sent of 8");
    assert_eq!(bytes3 - bytes2, 8.0 * page, "all 8 pages sent without the cache");
    for d in [&on, &off] {
        settle_decode(std::slice::from_ref(d)).await;
    }
    on.stop().await;
    off.stop().await;
    p.stop().await;
}

/// Issue 20: the router follows the decode workers' caches (their KV events). A
/// conversation's second turn goes to the decode worker holding the first turn and its
/// answer, and is prefilled there, from what it holds — or, with `--local-prefill-max 0`, on
/// the prefill worker, which sends only the pages the decode worker lacks — answering as the
/// colocated reference does either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_sends_a_conversations_next_turn_where_its_history_is() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let p = prefill_256(&m).await;
    let ds = [decode_256(&m, true).await, decode_256(&m, true).await];
    let (prefill, decode) =
        (vec![p.grpc_addr.to_string()], ds.iter().map(|d| d.grpc_addr.to_string()).collect::<Vec<_>>());
    let router = |local_max: usize| router_over(&m, &prefill, &decode, move |a| a.local_prefill_max = local_max);
    let (estimate, prefill_always) = (router(512).await, router(0).await);
    let prompt: Vec<u32> = (0..100).map(|i| 3 + (i * 37 + 11) % 340).collect();
    let (answer, _) = routed(estimate.grpc_addr, &prompt, &greedy(20)).await;
    settle_decode(&ds).await;
    let holder = ds.iter().position(|d| d.load().evictable_pages > 0).expect("a decode worker keeps the first turn");
    let mut turn = prompt.clone();
    turn.extend(&answer);
    turn.extend([5, 6, 7, 8, 9]);
    let want: Vec<u32> =
        colocated_scored(&m.path(), std::slice::from_ref(&turn), &greedy(20))[0].iter().map(|x| x.0).collect();
    // The first turn and its answer but the answer's last token: 119 tokens, 7 whole pages.
    let held = 7 * 16;
    // The routers and workers here share the process's metrics.
    let metrics = estimate.metrics_addr;
    let scrape = || async move { ferry_tests::scrape(metrics).await };
    // Both routers follow the decode workers' events; wait until they know the first turn.
    seen(&[&estimate, &prefill_always], &turn[..held]).await;
    let sums = |body: String| {
        let s = |name: &str, label: &str| ferry_tests::metric_sum(&body, name, label);
        (
            s("ferry_router_decode_prefix_total", "choice=\"local\""),
            s("ferry_router_decode_prefix_total", "choice=\"prefill\""),
            s("ferry_router_placements_total", "target=\"local\""),
            s("ferry_transfer_pages_held_total", ""),
            s("ferry_router_decode_prefix_total", "choice=\"pull\""),
        )
    };
    let before = sums(scrape().await);
    let (got, cached) = routed(estimate.grpc_addr, &turn, &greedy(20)).await;
    assert_eq!(got, want, "the second turn, prefilled on the decode worker from its history");
    assert_eq!(cached as usize, held, "it found the first turn and the answer");
    let after = sums(scrape().await);
    assert_eq!((after.0 - before.0, after.1 - before.1, after.2 - before.2), (1.0, 0.0, 1.0), "prefilled locally");
    assert_eq!(after.3, before.3, "nothing transferred");
    settle_decode(&ds).await;
    assert!(ds[1 - holder].load().evictable_pages == 0, "the turn went to the holder");

    // Never by estimate: the prefill worker computes it (pulling the history it lacks, or
    // computing it, as placement estimates: tests/tests/pull.rs), the holder receives the rest.
    let (got, _) = routed(prefill_always.grpc_addr, &turn, &greedy(20)).await;
    assert_eq!(got, want, "the second turn, prefilled on the prefill worker");
    let last = sums(scrape().await);
    assert_eq!((last.0 - after.0, last.1 - after.1 + last.4 - after.4), (0.0, 1.0), "the prefill worker chosen");
    assert_eq!(last.3 - after.3, 7.0, "the holder kept its 7 pages; only the 8th was sent");
    settle_decode(&ds).await;
    assert!(ds[1 - holder].load().evictable_pages == 0, "the turn went to the holder");

    // Asking for prompt logprobs, a turn would compute its whole prompt on the decode worker:
    // the prefill worker takes it, even through the router that estimates.
    let other: Vec<u32> = (0..100).map(|i| 3 + (i * 29 + 7) % 340).collect();
    let (answer, _) = routed(estimate.grpc_addr, &other, &greedy(20)).await;
    settle_decode(&ds).await;
    let mut turn = other;
    turn.extend(&answer);
    turn.extend([9, 8, 7]);
    seen(&[&estimate], &turn[..held]).await;
    let mut scored = greedy(20);
    scored.prompt_logprobs = Some(0);
    let want: Vec<u32> =
        colocated_scored(&m.path(), std::slice::from_ref(&turn), &greedy(20))[0].iter().map(|x| x.0).collect();
    let (got, _) = routed(estimate.grpc_addr, &turn, &scored).await;
    assert_eq!(got, want, "a second turn with prompt logprobs");
    let end = sums(scrape().await);
    assert_eq!((end.0 - last.0, end.2 - last.2), (0.0, 0.0), "prefilled on the prefill worker");
    settle_decode(&ds).await;
    estimate.stop().await;
    prefill_always.stop().await;
    p.stop().await;
    for d in ds {
        d.stop().await;
    }
}

/// A request placed on a decode worker to prefill from the history it holds, whose worker
/// fails before the first token, is retried with a prefill worker: the next decode worker
/// holds none of it and would compute the whole prompt between its decode steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_whose_holder_fails_is_retried_through_a_prefill_worker() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let p = prefill_256(&m).await;
    let d = decode_256(&m, true).await;
    let prompt: Vec<u32> = (0..120).map(|i| 3 + (i * 41 + 3) % 340).collect();
    let holder = ferry_tests::failing_holder::serve(prompt[..112].to_vec(), 16).await;
    let r = router_over(&m, &[p.grpc_addr.to_string()], &[holder.to_string(), d.grpc_addr.to_string()], |_| ()).await;
    seen(&[&r], &prompt[..112]).await;
    let want = ferry_tests::colocated(&m.path(), std::slice::from_ref(&prompt), &greedy(8));
    let sums = || async {
        let body = ferry_tests::scrape(r.metrics_addr).await;
        let s = |name: &str, label: &str| ferry_tests::metric_sum(&body, name, label);
        (
            s("ferry_router_decode_prefix_total", "choice=\"local\""),
            s("ferry_router_retries_total", "stage=\"decode\""),
            s("ferry_prefill_tokens_total", "role=\"prefill\""),
            s("ferry_prefill_tokens_total", "role=\"decode\""),
        )
    };
    let before = sums().await;
    let (got, _) = routed(r.grpc_addr, &prompt, &greedy(8)).await;
    assert_eq!(got, want[0], "answered after the retry");
    let after = sums().await;
    assert_eq!((after.0 - before.0, after.1 - before.1), (1.0, 1.0), "placed on the holder, retried once");
    assert_eq!(after.2 - before.2, 120.0, "the prefill worker computed the prompt");
    assert_eq!(after.3, before.3, "the decode worker computed none of it");
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}
