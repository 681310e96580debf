//! Issue 20's third choice: a prefill node pulls from the decode node the leading prompt pages
//! that node holds and it lacks (a conversation's first turn and the answer the decode node
//! generated, which no prefill node saw), computes only the rest, and answers exactly as the
//! colocated reference; the pulled pages stay in its cache for later prompts. A pull that
//! fails costs only time: the prompt is computed whole, with the same answer. Through the
//! router, placement chooses the pull and says so in `ferry_router_decode_prefix_total`.

use ferry_tests::{
    Client, TinyModel, colocated_scored, decode_256, greedy, metric_sum, prefill_256, router_over, scrape, settle,
};

/// The tests here read counters every daemon in this process shares: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// (pulls ok, pulls failed, pages the prefill node received, prompt tokens it computed).
async fn counts(metrics: std::net::SocketAddr) -> (f64, f64, f64, f64) {
    let body = scrape(metrics).await;
    let s = |name: &str, label: &str| metric_sum(&body, name, label);
    (
        s("ferry_pulls_total", "outcome=\"ok\""),
        s("ferry_pulls_total", "outcome=\"failed\""),
        s("ferry_pull_pages_total", "role=\"prefill\""),
        s("ferry_prefill_tokens_total", "role=\"prefill\""),
    )
}

fn delta(a: (f64, f64, f64, f64), b: (f64, f64, f64, f64)) -> (f64, f64, f64, f64) {
    (b.0 - a.0, b.1 - a.1, b.2 - a.2, b.3 - a.3)
}

/// The first turn (100 tokens, `answered` more) and the second (the first, its answer, 5 more).
async fn first_turn(c: &Client, answered: u32) -> (Vec<u32>, Vec<u32>) {
    let prompt: Vec<u32> = (0..100).map(|i| 3 + (i * 37 + 11) % 340).collect();
    let answer = c.generate(&prompt, &greedy(answered)).await.expect("first turn");
    let mut turn = prompt.clone();
    turn.extend(&answer);
    turn.extend([5, 6, 7, 8, 9]);
    (prompt, turn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_node_pulls_what_the_decode_node_holds_and_answers_the_same() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let p = prefill_256(&m).await;
    let ds = [decode_256(&m, true).await, decode_256(&m, false).await];
    let (d, plain) = (&ds[0], &ds[1]);
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await.pulling_from(d.grpc_addr.to_string());
    let (_, turn) = first_turn(&c, 40).await;
    settle(&p, &ds).await;
    let want = colocated_scored(&m.path(), std::slice::from_ref(&turn), &greedy(20));
    let before = counts(p.metrics_addr).await;
    let got = c.generate_scored(&turn, &greedy(20)).await.expect("second turn");
    let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(ids(&got), ids(&want[0]), "the second turn, its history pulled");
    for (g, w) in got.iter().zip(&want[0]) {
        assert!((g.1 - w.1).abs() < 1e-4, "logprob {} against {}", g.1, w.1);
    }
    // The decode node holds 139 tokens' KV (8 whole pages); the prefill node computed the
    // first 100 (6 whole pages): it pulls 2 and computes 145 - 128 tokens.
    assert_eq!(delta(before, counts(p.metrics_addr).await), (1.0, 0.0, 2.0, 17.0), "one pull of 2 pages");
    settle(&p, &ds).await;

    // The pulled pages stay in the prefill node's cache: a prompt sharing them sent to a decode
    // node that holds nothing is computed from page 8 on (without them, from page 6).
    let mut other = turn[..140].to_vec();
    other.extend([9, 9, 9]);
    let want = colocated_scored(&m.path(), std::slice::from_ref(&other), &greedy(8));
    let c2 = Client::new(plain.grpc_addr, Some(p.grpc_addr)).await;
    let before = counts(p.metrics_addr).await;
    let got = c2.generate(&other, &greedy(8)).await.expect("a prompt sharing the pulled pages");
    assert_eq!(got, ids(&want[0]));
    assert_eq!(delta(before, counts(p.metrics_addr).await), (0.0, 0.0, 0.0, 15.0), "143 - 128 computed");
    settle(&p, &ds).await;
    for d in ds {
        d.stop().await;
    }
    p.stop().await;
}

/// A pull that cannot happen (nothing answers at the address) is counted and the prompt
/// computed whole: the same answer, every page back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pull_computes_the_prompt_instead() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let p = prefill_256(&m).await;
    let d = decode_256(&m, true).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await.pulling_from(closed.to_string());
    let (_, turn) = first_turn(&c, 40).await;
    settle(&p, std::slice::from_ref(&d)).await;
    let want = colocated_scored(&m.path(), std::slice::from_ref(&turn), &greedy(20));
    let before = counts(p.metrics_addr).await;
    let got = c.generate(&turn, &greedy(20)).await.expect("second turn");
    assert_eq!(got, want[0].iter().map(|x| x.0).collect::<Vec<_>>(), "computed after the failed pull");
    // It held 6 pages of its own: 145 - 96 tokens computed.
    assert_eq!(delta(before, counts(p.metrics_addr).await), (0.0, 1.0, 0.0, 49.0), "one failed pull");
    settle(&p, std::slice::from_ref(&d)).await;
    d.stop().await;
    p.stop().await;
}

/// Through the router: a conversation's next turn whose new part is past
/// `--local-prefill-max` goes to the prefill worker, which pulls the history from the decode
/// worker holding it (`choice="pull"`); with `--disable-pull` it computes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_chooses_the_pull_and_says_so() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let p = prefill_256(&m).await;
    let ds = [decode_256(&m, true).await];
    let (prefill_addrs, decode_addrs) = (vec![p.grpc_addr.to_string()], vec![ds[0].grpc_addr.to_string()]);
    let pulls = router_over(&m, &prefill_addrs, &decode_addrs, |a| a.local_prefill_max = 0).await;
    let computes = router_over(&m, &prefill_addrs, &decode_addrs, |a| {
        a.local_prefill_max = 0;
        a.disable_pull = true;
    })
    .await;
    let c = Client::new(ds[0].grpc_addr, Some(p.grpc_addr)).await;
    // A long answer, so that computing the history the prefill worker lacks (96 tokens) is
    // estimated well past a pull's overhead even at the tiny model's rate.
    let (_, turn) = first_turn(&c, 100).await;
    settle(&p, &ds).await;
    ferry_tests::seen(&[&pulls, &computes], &turn[..192]).await;
    let want: Vec<u32> =
        colocated_scored(&m.path(), std::slice::from_ref(&turn), &greedy(20))[0].iter().map(|x| x.0).collect();
    let choices = |body: &str| {
        let s = |label: &str| metric_sum(body, "ferry_router_decode_prefix_total", label);
        (s("choice=\"prefill\""), s("choice=\"pull\""))
    };
    let (c0, p0) = (choices(&scrape(pulls.metrics_addr).await), counts(p.metrics_addr).await);
    let (got, _) = ferry_tests::routed(pulls.grpc_addr, &turn, &greedy(20)).await;
    assert_eq!(got, want, "pulled through the router");
    let (c1, p1) = (choices(&scrape(pulls.metrics_addr).await), counts(p.metrics_addr).await);
    assert_eq!((c1.0 - c0.0, c1.1 - c0.1), (0.0, 1.0), "the pull chosen");
    // The decode worker holds 199 tokens' KV (12 pages), the prefill worker 6 pages.
    assert_eq!(delta(p0, p1), (1.0, 0.0, 6.0, 13.0), "6 pages pulled, 205 - 192 tokens computed");
    settle(&p, &ds).await;
    // The same prompt again, pulls disabled: nothing pulled (the prefill node holds the pages
    // since the pull), the prefill worker chosen.
    let (got, _) = ferry_tests::routed(computes.grpc_addr, &turn, &greedy(20)).await;
    assert_eq!(got, want, "computed through the router");
    let (c2, p2) = (choices(&scrape(computes.metrics_addr).await), counts(p.metrics_addr).await);
    assert_eq!((c2.0 - c1.0, c2.1 - c1.1), (0.0, 0.0), "the prefill worker holds as much: no choice to make");
    assert_eq!((p2.0 - p1.0, p2.1 - p1.1), (0.0, 0.0), "no pull");
    settle(&p, &ds).await;
    pulls.stop().await;
    computes.stop().await;
    for d in ds {
        d.stop().await;
    }
    p.stop().await;
}

/// A `Holder.Pull` that cannot be served gets a clear status naming what is wrong, is
/// counted, and the decode node keeps serving with every page back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pulls_are_refused_clearly() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let d = decode_256(&m, true).await;
    let mut h = ferry_proto::v1::holder_client::HolderClient::new(ferry_tests::channel(d.grpc_addr).await);
    let key = ferry_cluster::RoomKey::random();
    let req = |dest: Vec<u32>, backend: &str| ferry_proto::v1::PullRequest {
        room: Some(ferry_cluster::wire::room_key_to_proto(&key)),
        first_page: 0,
        dest_pages: dest,
        data_endpoint: "127.0.0.1:9".into(),
        transfer_backend: backend.into(),
    };
    let cases = [
        (req(vec![1, 2], "rdma"), tonic::Code::FailedPrecondition, "backend_mismatch"),
        (req(Vec::new(), "tcp"), tonic::Code::InvalidArgument, "pull_pages"),
        (req(vec![1, 2], "tcp"), tonic::Code::NotFound, "no_room"),
        (ferry_proto::v1::PullRequest::default(), tonic::Code::InvalidArgument, ""),
    ];
    for (r, code, reason) in cases {
        let e = h.pull(r).await.expect_err("refused");
        assert_eq!(e.code(), code, "{e}");
        let got = e.metadata().get("ferry-reason").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        assert!(got.contains(reason), "reason {got:?}, wanted {reason:?}: {e}");
    }
    // Still serving, nothing held.
    let c = Client::new(d.grpc_addr, None).await;
    c.generate(&[5, 6, 7], &greedy(4)).await.expect("serves on");
    ferry_tests::settle_decode(std::slice::from_ref(&d)).await;
    d.stop().await;
}

/// The decode node answers a pull with success only when the room held its pages until they
/// were sent: a room that ends while they are on the wire (here: its sends held up by a slow
/// link, then the room aborted) spoils the pull (`ABORTED`, `pull_spoiled`), since its pages
/// may have been evicted and reused while they were read. A pull while the room holds them
/// succeeds and delivers every page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_whose_room_ends_mid_send_is_spoiled() {
    use ferry_proto::v1 as pb;
    use ferry_transfer::memory::HostPages;
    use ferry_transfer::table::Outcome;
    use ferry_transfer::tcp::{TcpConfig, TcpReceiver};
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let p = prefill_256(&m).await;
    let d = decode_256(&m, true).await;
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    let (_, turn) = first_turn(&c, 40).await;
    settle(&p, std::slice::from_ref(&d)).await;
    // The second turn on the decode node, its prefill call never made: the prefill node keeps
    // the room bootstrapping, the decode node keeps it waiting for its transfer, holding the
    // first turn's 8 pages.
    let key = ferry_cluster::RoomKey::random();
    let room = Some(ferry_cluster::wire::room_key_to_proto(&key));
    let mut dc = pb::decode_client::DecodeClient::new(ferry_tests::channel(d.grpc_addr).await);
    let stream = dc
        .generate(pb::DecodeRequest {
            request_id: "spoiled".into(),
            room: room.clone(),
            prefill_bootstrap_addr: p.grpc_addr.to_string(),
            token_ids: turn.clone(),
            sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(4))),
        })
        .await
        .expect("accepted");
    let page_bytes = ferry_engine::Model::load(&m.path(), ferry_kernels::cpu::CpuBackend::default())
        .expect("model")
        .kv_layout(16)
        .page_floats()
        * 4;
    let receiver = || async {
        let mem = std::sync::Arc::new(HostPages::new(page_bytes, 16).expect("arena"));
        let any = "127.0.0.1:0".parse().expect("addr");
        TcpReceiver::bind(any, std::sync::Arc::clone(&mem), TcpConfig::default()).await.expect("bind")
    };
    let mut h = pb::holder_client::HolderClient::new(ferry_tests::channel(d.grpc_addr).await);
    let pull = |endpoint: String| pb::PullRequest {
        room: room.clone(),
        first_page: 0,
        dest_pages: (0..8).collect(),
        data_endpoint: endpoint,
        transfer_backend: "tcp".into(),
    };
    // Held throughout: delivered (asked until the handshake reached the prefill node).
    let direct = receiver().await;
    let done = direct.open(key.room, key.secret, &(0..8).collect::<Vec<_>>()).expect("open");
    let mut sent = None;
    for _ in 0..200 {
        match h.pull(pull(direct.local_addr().to_string())).await {
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            r => {
                sent = Some(r);
                break;
            }
        }
    }
    assert_eq!(sent.expect("the room reached its transfer").expect("pulled").into_inner().pages, 8);
    assert!(matches!(done.await, Ok(Outcome::Success(_))), "every page arrived");
    // Through a slow link (each chunk held 1 s), the room aborted while its pages are sent.
    let slow = receiver().await;
    let _open = slow.open(key.room, key.secret, &(0..8).collect::<Vec<_>>()).expect("open");
    let link = ferry_tests::proxy::Proxy::start(slow.local_addr().to_string()).await;
    link.delay(std::time::Duration::from_secs(1));
    let spoiled = tokio::spawn({
        let (mut h, req) = (h.clone(), pull(link.addr().to_string()));
        async move { h.pull(req).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let abort = pb::AbortRequest { room: room.clone(), reason: "test".into(), sequence: None };
    assert!(dc.abort(abort.clone()).await.expect("abort").into_inner().found);
    let e = spoiled.await.expect("task").expect_err("spoiled");
    assert_eq!(e.code(), tonic::Code::Aborted, "{e}");
    assert_eq!(e.metadata().get("ferry-reason").and_then(|v| v.to_str().ok()), Some("pull_spoiled"), "{e}");
    drop(stream);
    let mut pc = pb::prefill_client::PrefillClient::new(ferry_tests::channel(p.grpc_addr).await);
    // The prefill node still holds the room, bootstrapping (its prefill call never came, and
    // the decode node's abort is not relayed): aborted here, not left to its timeout.
    let found = pc.abort(abort).await.expect("abort").into_inner().found;
    assert!(found, "the prefill node no longer knew the room");
    settle(&p, std::slice::from_ref(&d)).await;
    d.stop().await;
    p.stop().await;
}
