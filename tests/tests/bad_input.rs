//! Bad input on the worker APIs is refused with a clear status, counted in /metrics, and
//! disturbs nothing: a good request afterwards still gets its exact tokens, and every page
//! comes back.

use std::time::Duration;

use ferry_cluster::RoomKey;
use ferry_proto::v1 as pb;
use ferry_tests::{Client, TinyModel, channel, colocated, greedy, scrape, settle};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_calls_are_refused_clearly_and_harm_nothing() {
    let m = TinyModel::new();
    let mut pa = ferry_prefill::PrefillArgs::for_model(m.path());
    pa.worker.pool_pages = 512;
    pa.worker.bootstrap_timeout = 1.0;
    pa.max_dest_pages = 200;
    let mut da = ferry_decode::DecodeArgs::for_model(m.path());
    da.worker.pool_pages = 512;
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let mut prefill = pb::prefill_client::PrefillClient::new(channel(p.grpc_addr).await);
    let mut bootstrap = pb::bootstrap_client::BootstrapClient::new(channel(p.grpc_addr).await);
    let mut decode = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
    let layout = ferry_cluster::wire::layout_to_proto(&p.layout);
    let key = RoomKey::random();
    let pk = |k: &RoomKey| Some(ferry_cluster::wire::room_key_to_proto(k));
    let prefill_req = |k: &RoomKey, tokens: Vec<u32>| pb::PrefillRequest {
        request_id: "bad".into(),
        room: pk(k),
        token_ids: tokens,
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(2))),
        priority: 0,
        pull_from: String::new(),
    };
    let handshake = |k: &RoomKey, pages: Vec<u32>, layout: pb::LayoutDescriptor| pb::HandshakeRequest {
        room: pk(k),
        dest_pages: pages,
        data_endpoint: d.data_endpoint.clone(),
        transfer_backend: "tcp".into(),
        layout: Some(layout),
        registration: Vec::new(),
        held_pages: 0,
    };

    // A malformed room key.
    let mut bad_key = prefill_req(&key, vec![1, 2, 3]);
    bad_key.room = Some(pb::RoomKey { room: 5, secret: vec![0; 15] });
    let e = prefill.prefill(bad_key).await.expect_err("malformed");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("room.secret"), "{}", e.message());

    // A prompt over the context, on both nodes.
    let long = vec![1u32; 2048];
    let e = prefill.prefill(prefill_req(&RoomKey::random(), long.clone())).await.expect_err("too long");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("context"), "{}", e.message());
    let dreq = pb::DecodeRequest {
        request_id: "bad".into(),
        room: pk(&RoomKey::random()),
        prefill_bootstrap_addr: p.grpc_addr.to_string(),
        token_ids: long,
        sampling: None,
    };
    let e = decode.generate(dreq).await.expect_err("too long");
    assert_eq!(e.code(), Code::InvalidArgument);

    // A handshake with a mismatched layout, and one with an oversize page list.
    let mut other = layout.clone();
    other.page_size = 32;
    let e = bootstrap.handshake(handshake(&key, vec![1], other)).await.expect_err("layout");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("page_size 16 vs 32"), "{}", e.message());
    let e = bootstrap.handshake(handshake(&key, (0..201).collect(), layout.clone())).await.expect_err("oversize");
    assert_eq!(e.code(), Code::InvalidArgument);
    // A handshake whose held pages (delta transfer) and destination pages do not add up to
    // the prompt's: the request fails, naming both.
    let other_key = RoomKey::random();
    let pending = tokio::spawn({
        let mut prefill = prefill.clone();
        let r = prefill_req(&other_key, vec![5, 6, 7]);
        async move { prefill.prefill(r).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut h = handshake(&other_key, vec![1], layout.clone());
    h.held_pages = 5;
    let _ = bootstrap.handshake(h).await;
    let e = pending.await.expect("join").expect_err("held pages past the prompt");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("1 destination pages after 5 held"), "{}", e.message());

    // A duplicate room and a wrong secret: the first request stays (and times out: no
    // decode node ever shakes hands for it).
    let first = tokio::spawn({
        let mut prefill = prefill.clone();
        let r = prefill_req(&key, vec![5, 6, 7]);
        async move { prefill.prefill(r).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let e = prefill.prefill(prefill_req(&key, vec![5, 6, 7])).await.expect_err("duplicate");
    assert_eq!(e.code(), Code::AlreadyExists);
    let thief = RoomKey { room: key.room, secret: ferry_cluster::RoomSecret::random() };
    let e = bootstrap.handshake(handshake(&thief, vec![1], layout.clone())).await.expect_err("secret");
    assert_eq!(e.code(), Code::PermissionDenied);
    let abort = pb::AbortRequest { room: pk(&thief), reason: "no".into(), sequence: None };
    assert_eq!(prefill.abort(abort).await.expect_err("secret").code(), Code::PermissionDenied);
    let e = first.await.expect("join").expect_err("the first times out");
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(e.message().contains("bootstrap"), "{}", e.message());

    // Unknown rooms: an abort finds nothing.
    let unknown = pb::AbortRequest { room: pk(&RoomKey::random()), reason: "?".into(), sequence: None };
    assert!(!prefill.abort(unknown.clone()).await.expect("ok").into_inner().found);
    assert!(!decode.abort(unknown).await.expect("ok").into_inner().found);

    // Nothing was disturbed.
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    let prompt: Vec<u32> = (0..100).map(|i| (i * 7 % 300) as u32).collect();
    let want = colocated(&m.path(), std::slice::from_ref(&prompt), &greedy(4));
    assert_eq!(c.generate(&prompt, &greedy(4)).await.expect("good request"), want[0]);
    settle(&p, std::slice::from_ref(&d)).await;
    let text = scrape(p.metrics_addr).await;
    for reason in
        ["malformed", "prompt_too_long", "layout_mismatch", "oversize_page_list", "duplicate_room", "wrong_secret"]
    {
        assert!(
            text.lines()
                .any(|l| l.starts_with("ferry_bad_requests_total") && l.contains(&format!("reason=\"{reason}\""))),
            "{reason} not counted:\n{text}"
        );
    }
    p.stop().await;
    d.stop().await;
}
