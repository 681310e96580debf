//! Structured outputs end to end: the official `openai` client against a router over real
//! prefill and decode workers, and against a second router on the same workers that prefills
//! everything on the decode worker (colocated) — tests/py/structured.py; tool calls through
//! the first — tests/py/tools.py.

use ferry_tests::{TinyModel, one_of_each, python, router_for, served_model, settle};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_validate_through_prefill_decode_and_colocated() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 2048, |_| ()).await;
    let colocated = router_for(&m, &p, &d, |a| a.local_prefill_below = usize::MAX).await;
    let model = served_model(r.http_addr).await;
    let (pd, co) = (format!("http://{}/v1", r.http_addr), format!("http://{}/v1", colocated.http_addr));
    python("structured.py", &[&pd, &co, &model], "structured outputs: ok").await;
    python("tools.py", &[&pd, &model], "tools: ok").await;
    let metrics = ferry_tests::http(r.http_addr, "GET", "/metrics", b"").await.2;
    assert!(metrics.contains("reason=\"invalid_constraint\""), "bad constraints are counted");
    // Fixed keys and punctuation were appended without sampling them (jump-forward).
    let forced: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("ferry_decode_jump_forward_tokens_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(forced > 1000.0, "jump-forward tokens: {forced}");
    grpc_constraints(r.grpc_addr).await;
    settle(&p, std::slice::from_ref(&d)).await;
    colocated.stop().await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}

/// The gRPC `Router` API takes the same constraints in `SamplingParams.constraint`: a regex
/// and a choice are obeyed; one that does not compile is INVALID_ARGUMENT naming the field.
async fn grpc_constraints(router: std::net::SocketAddr) {
    use ferry_proto::v1 as pb;
    use pb::output_constraint::Kind;
    let mut c = pb::router_client::RouterClient::new(ferry_tests::channel(router).await);
    let ask = |kind: Kind, seed: u64| pb::GenerateRequest {
        request_id: String::new(),
        prompt: Some(pb::generate_request::Prompt::Text("The answer is".into())),
        sampling: Some(pb::SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_new_tokens: 40,
            constraint: Some(pb::OutputConstraint { kind: Some(kind) }),
            ..Default::default()
        }),
        stop: Vec::new(),
        return_token_ids: false,
        return_phases: false,
    };
    let text = |mut s: tonic::Streaming<pb::GenerateResponse>| async move {
        let (mut text, mut finish) = (String::new(), 0);
        while let Some(m) = s.message().await.expect("stream") {
            text.push_str(&m.text);
            finish = m.finish_reason;
        }
        (text, finish)
    };
    for seed in 0..4 {
        let s = c.generate(ask(Kind::Regex("[0-9]{3}-[a-c]{2}".into()), seed)).await.expect("regex").into_inner();
        let (t, finish) = text(s).await;
        let b = t.as_bytes();
        assert!(t.len() == 6 && b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-', "{t:?}");
        assert_eq!(finish, pb::FinishReason::Stop as i32, "{t:?}");
        let options = vec!["left".to_string(), "right".to_string(), "straight on".to_string()];
        let choice = Kind::Choice(pb::ChoiceList { options: options.clone() });
        let (t, _) = text(c.generate(ask(choice, seed)).await.expect("choice").into_inner()).await;
        assert!(options.contains(&t), "{t:?}");
    }
    let e = c.generate(ask(Kind::Regex("(?<=x)y".into()), 0)).await.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().starts_with("regex:"), "{e:?}");
}
