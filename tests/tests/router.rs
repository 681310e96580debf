//! Through the router: 2 prefill + 2 decode daemons over TCP give the colocated engine's
//! tokens; the cache-aware placement sends a prompt where its prefix is; a client that goes
//! away frees the pages on both workers.

use std::time::Duration;

use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, channel, colocated, greedy, prompts_with_shared_prefixes, settle};

async fn cluster(m: &TinyModel) -> (Vec<ferry_prefill::Running>, Vec<ferry_decode::Running>, ferry_router::Running) {
    let mut ps = Vec::new();
    let mut ds = Vec::new();
    for _ in 0..2 {
        let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
        a.worker.pool_pages = 2048;
        a.worker.chunked_prefill_size = 128;
        ps.push(ferry_prefill::start(a).await.expect("prefill up"));
        let mut a = ferry_decode::DecodeArgs::for_model(m.path());
        a.worker.pool_pages = 2048;
        ds.push(ferry_decode::start(a).await.expect("decode up"));
    }
    let args = ferry_router::RouterArgs::new(
        m.path(),
        ps.iter().map(|p| p.grpc_addr.to_string()).collect(),
        ds.iter().map(|d| d.grpc_addr.to_string()).collect(),
    );
    let r = ferry_router::start(args).await.expect("router up");
    // Wait for the first load reports.
    for _ in 0..200 {
        if r.workers().snapshot().all().all(|w| w.healthy()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (ps, ds, r)
}

fn by_ids(ids: &[u32], n: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: String::new(),
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: ids.to_vec() })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(n))),
        stop: Vec::new(),
        return_token_ids: true,
        return_phases: false,
    }
}

async fn collect(r: &mut tonic::Streaming<pb::GenerateResponse>) -> (Vec<u32>, pb::GenerateResponse) {
    let mut ids = Vec::new();
    let mut last = pb::GenerateResponse::default();
    while let Some(m) = r.message().await.expect("stream") {
        ids.extend(&m.token_ids);
        last = m;
    }
    (ids, last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_router_outputs_equal_the_colocated_engine() {
    let m = TinyModel::new();
    let (ps, ds, r) = cluster(&m).await;
    let prompts = prompts_with_shared_prefixes(16, 1200, 359, 21);
    let want = colocated(&m.path(), &prompts, &greedy(5));
    let client = pb::router_client::RouterClient::new(channel(r.grpc_addr).await);
    let runs = prompts.iter().map(|p| {
        let mut c = client.clone();
        let req = by_ids(p, 5);
        async move { collect(&mut c.generate(req).await.expect("accepted").into_inner()).await }
    });
    let got = futures::future::join_all(runs).await;
    for (i, ((ids, last), w)) in got.into_iter().zip(&want).enumerate() {
        assert_eq!(&ids, w, "prompt {i}");
        assert_eq!(last.finish_reason(), pb::FinishReason::Length);
        assert_eq!((last.prompt_tokens as usize, last.completion_tokens), (prompts[i].len(), 5));
    }
    // The index learnt the cached prefixes from the workers' events.
    assert!(r.index_pages() > 0);
    // Placement weighs a worker's cache against its queue: wait until the router's load
    // reports are from after the burst (every prefill queue empty), or a stale report of a
    // busy worker can send the next prompt to the idle one that lacks its prefix.
    for p in &ps {
        settle(p, &ds).await;
    }
    for _ in 0..500 {
        let snap = r.workers().snapshot();
        if snap.prefill.iter().flatten().all(|w| w.load().is_some_and(|l| l.queued_prefill_tokens == 0)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The same long prompt again: it goes where its prefix is, and reports it cached.
    let again = by_ids(&prompts[0], 2);
    let (_, last) = collect(&mut client.clone().generate(again).await.expect("ok").into_inner()).await;
    assert!(
        last.cached_tokens as usize >= prompts[0].len() / 16 * 16 - 16,
        "cached {} of {}",
        last.cached_tokens,
        prompts[0].len()
    );
    // A client that goes away mid-stream frees the pages on both workers.
    let mut c = client.clone();
    let mut s = c.generate(by_ids(&prompts[1], 1500)).await.expect("ok").into_inner();
    for _ in 0..3 {
        s.message().await.expect("a token");
    }
    drop(s);
    for p in &ps {
        settle(p, &ds).await;
    }
    let list = client.clone().list_workers(pb::ListWorkersRequest {}).await.expect("list").into_inner();
    assert_eq!(list.workers.len(), 4);
    assert!(list.workers.iter().all(|w| w.healthy));
    r.stop().await;
    for p in ps {
        p.stop().await;
    }
    for d in ds {
        d.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_failing_before_the_first_token_is_retried_elsewhere() {
    let m = TinyModel::new();
    let mut ps = Vec::new();
    for _ in 0..2 {
        let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
        a.worker.pool_pages = 512;
        ps.push(ferry_prefill::start(a).await.expect("prefill up"));
    }
    let mut a = ferry_decode::DecodeArgs::for_model(m.path());
    a.worker.pool_pages = 512;
    let d = ferry_decode::start(a).await.expect("decode up");
    let mut args = ferry_router::RouterArgs::new(
        m.path(),
        ps.iter().map(|p| p.grpc_addr.to_string()).collect(),
        vec![d.grpc_addr.to_string()],
    );
    // One load poll at start, then none for the test's length: the router keeps believing in
    // the worker this test stops. Least-load placement with equal (stale) loads picks the
    // first worker every time: the cache-aware policy would too while the prefix index holds
    // the prompt there, but the index forgets a stopped worker's entries as soon as its event
    // stream breaks, and the repeat then went to either worker (retried or not).
    args.load_poll = 60.0;
    args.policy = ferry_router::placement::Policy::LeastLoad;
    // The repeat on a prefill worker: the decode worker's cache holds the prompt too, and the
    // router would otherwise prefill its last page there.
    args.local_prefill_max = 0;
    // Nor pulled: the other prefill worker would pull the prompt from the decode worker's
    // cache, and report it cached (tests/tests/pull.rs).
    args.disable_pull = true;
    let r = ferry_router::start(args).await.expect("router up");
    for _ in 0..200 {
        if r.workers().snapshot().all().all(|w| w.healthy()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let prompt: Vec<u32> = (0..300).map(|i| (i * 11 % 350) as u32).collect();
    let want = colocated(&m.path(), std::slice::from_ref(&prompt), &greedy(4));
    let client = pb::router_client::RouterClient::new(channel(r.grpc_addr).await);
    let (first, _) = collect(&mut client.clone().generate(by_ids(&prompt, 4)).await.expect("ok").into_inner()).await;
    assert_eq!(first, want[0]);
    // The prompt is now cached on the first worker: stop it; the router sends the repeat there,
    // the call fails, and the request is retried on the other.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while ps[0].load().evictable_pages == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ps[0].load().evictable_pages > 0, "the first worker cached the prompt");
    let gone = ps.remove(0);
    gone.stop().await;
    let retries = |m: &str| ferry_tests::metric_sum(m, "ferry_router_retries_total", "stage=\"prefill\"");
    let before = retries(&ferry_tests::scrape(r.metrics_addr).await);
    let (again, last) = collect(&mut client.clone().generate(by_ids(&prompt, 4)).await.expect("ok").into_inner()).await;
    assert_eq!(again, want[0], "same tokens after the retry");
    assert_eq!(last.cached_tokens, 0, "the other worker had nothing cached");
    let metrics = ferry_tests::scrape(r.metrics_addr).await;
    assert!(retries(&metrics) > before, "the prefill retry is counted (was {before}):\n{metrics}");
    settle(&ps[0], std::slice::from_ref(&d)).await;
    r.stop().await;
    for p in ps {
        p.stop().await;
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_failing_before_the_first_token_is_retried_on_another() {
    let m = TinyModel::new();
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 512;
    let p = ferry_prefill::start(a).await.expect("prefill up");
    let mut ds = Vec::new();
    for pages in [512, 256] {
        let mut a = ferry_decode::DecodeArgs::for_model(m.path());
        a.worker.pool_pages = pages;
        ds.push(ferry_decode::start(a).await.expect("decode up"));
    }
    let mut args = ferry_router::RouterArgs::new(
        m.path(),
        vec![p.grpc_addr.to_string()],
        ds.iter().map(|d| d.grpc_addr.to_string()).collect(),
    );
    // As above: the router keeps believing in the decode worker this test stops.
    args.load_poll = 60.0;
    let r = ferry_router::start(args).await.expect("router up");
    for _ in 0..200 {
        if r.ready(1, 2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The router places on the decode worker with the most free pages: stop that one.
    let gone = ds.remove(0);
    gone.stop().await;
    let retries = |m: &str| ferry_tests::metric_sum(m, "ferry_router_retries_total", "stage=\"decode\"");
    let before = retries(&ferry_tests::scrape(r.metrics_addr).await);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 300) as u32).collect();
    let want = colocated(&m.path(), std::slice::from_ref(&prompt), &greedy(4));
    let client = pb::router_client::RouterClient::new(channel(r.grpc_addr).await);
    let (got, last) = collect(&mut client.clone().generate(by_ids(&prompt, 4)).await.expect("ok").into_inner()).await;
    assert_eq!(got, want[0], "same tokens after the retry");
    assert_eq!(last.completion_tokens, 4);
    let metrics = ferry_tests::scrape(r.metrics_addr).await;
    assert!(retries(&metrics) > before, "the decode retry is counted (was {before}):\n{metrics}");
    settle(&p, &ds).await;
    r.stop().await;
    p.stop().await;
    for d in ds {
        d.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_router_calls_are_refused_and_harm_nothing() {
    let m = TinyModel::new();
    let (ps, ds, r) = cluster(&m).await;
    let client = pb::router_client::RouterClient::new(channel(r.grpc_addr).await);
    let text = |t: &str| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(t.into())),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(2))),
        ..Default::default()
    };
    let mut bad_sampling = text("hello");
    if let Some(s) = bad_sampling.sampling.as_mut() {
        s.top_p = 2.0;
    }
    let with = |f: &dyn Fn(&mut pb::GenerateRequest)| {
        let mut r = text("hello");
        f(&mut r);
        r
    };
    let cases = [
        ("no prompt", pb::GenerateRequest::default(), "prompt"),
        ("empty prompt", text(""), "empty"),
        ("token id past the vocabulary", by_ids(&[1, 2, 100_000], 2), "vocabulary"),
        ("prompt over the context", by_ids(&vec![7; 2048], 2), "context"),
        ("invalid sampling", bad_sampling, "top_p"),
        // A newline in the id would forge a line in the router's log.
        ("request id with a newline", with(&|r| r.request_id = "a\nWARN forged".into()), "request_id"),
        ("request id of 129 characters", with(&|r| r.request_id = "x".repeat(129)), "request_id"),
        ("17 stop strings", with(&|r| r.stop = vec!["s".into(); 17]), "stop"),
        ("a stop string of 257 bytes", with(&|r| r.stop = vec!["a".into(), "b".repeat(257)]), "stop[1]"),
    ];
    for (what, req, field) in cases {
        let e = client.clone().generate(req).await.map(|_| ()).expect_err(what);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{what}: {e:?}");
        assert!(e.message().contains(field), "{what}: the message names {field}: {}", e.message());
    }
    // The same bounds over HTTP.
    let (_, _, models) = ferry_tests::http(r.http_addr, "GET", "/v1/models", b"").await;
    let model: serde_json::Value = serde_json::from_str(&models).expect("JSON");
    let body =
        serde_json::json!({"model": model["data"][0]["id"], "prompt": "Hi", "max_tokens": 2, "stop": vec!["s"; 17]});
    let (status, _, text) =
        ferry_tests::http(r.http_addr, "POST", "/v1/completions", body.to_string().as_bytes()).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("`stop`"), "{text}");
    let metrics = ferry_tests::scrape(r.metrics_addr).await;
    for reason in ["bad_request_id", "too_many_stop_strings", "stop_string_too_long"] {
        assert!(
            ferry_tests::metric_sum(&metrics, "ferry_bad_requests_total", &format!("reason=\"{reason}\"")) >= 1.0,
            "{reason} not counted:\n{metrics}"
        );
    }
    let (ids, _) =
        collect(&mut client.clone().generate(by_ids(&[5, 6, 7, 8], 3)).await.expect("ok").into_inner()).await;
    assert_eq!(ids.len(), 3, "a good request after the bad ones");
    let mut c = client.clone();
    let t =
        c.tokenize(pb::TokenizeRequest { input: Some(pb::tokenize_request::Input::Text("Once upon".into())) }).await;
    assert!(!t.expect("tokenize").into_inner().token_ids.is_empty());
    assert_reflection(r.grpc_addr).await;
    for p in &ps {
        settle(p, &ds).await;
    }
    r.stop().await;
    for p in ps {
        p.stop().await;
    }
    for d in ds {
        d.stop().await;
    }
}

/// Server reflection lists the public services and serves the Router's descriptor (what
/// `grpcurl` needs without the .proto files).
async fn assert_reflection(addr: std::net::SocketAddr) {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};
    let mut c = ServerReflectionClient::new(channel(addr).await);
    let ask = |m: MessageRequest| ServerReflectionRequest { host: String::new(), message_request: Some(m) };
    let reqs = vec![
        ask(MessageRequest::ListServices(String::new())),
        ask(MessageRequest::FileContainingSymbol("ferry.v1.Router".into())),
    ];
    let mut out = c.server_reflection_info(tokio_stream::iter(reqs)).await.expect("reflection").into_inner();
    let mut answers: Vec<ServerReflectionResponse> = Vec::new();
    while let Some(r) = out.message().await.expect("an answer") {
        answers.push(r);
        if answers.len() == 2 {
            break;
        }
    }
    let Some(MessageResponse::ListServicesResponse(list)) = answers[0].message_response.clone() else {
        panic!("not a service list: {:?}", answers[0])
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in ["ferry.v1.Router", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
    }
    let Some(MessageResponse::FileDescriptorResponse(files)) = answers[1].message_response.clone() else {
        panic!("no descriptor for ferry.v1.Router: {:?}", answers[1])
    };
    assert!(files.file_descriptor_proto.iter().any(|f| String::from_utf8_lossy(f).contains("Generate")));
}
