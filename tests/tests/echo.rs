//! Prompt logprobs (`echo`), end to end: the official `openai` client against a router over
//! real prefill and decode workers, and against a second router on the same workers that
//! prefills on the decode worker (colocated) — tests/py/echo.py; and the gRPC `Router` API's
//! `prompt_logprobs`.

use ferry_tests::{TinyModel, one_of_each, python, router_for, served_model, settle};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_come_back_through_prefill_decode_and_colocated() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 2048, |_| ()).await;
    let colocated = router_for(&m, &p, &d, |a| a.local_prefill_below = usize::MAX).await;
    let model = served_model(r.http_addr).await;
    let (pd, co) = (format!("http://{}/v1", r.http_addr), format!("http://{}/v1", colocated.http_addr));
    python("echo.py", &[&pd, &co, &model], "echo: ok").await;
    grpc_prompt_logprobs(r.grpc_addr).await;
    settle(&p, std::slice::from_ref(&d)).await;
    colocated.stop().await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}

/// `SamplingParams.prompt_logprobs` on the gRPC API: the first message carries a logprob for
/// every prompt token after the first, with the alternatives asked for.
async fn grpc_prompt_logprobs(router: std::net::SocketAddr) {
    use ferry_proto::v1 as pb;
    let mut c = pb::router_client::RouterClient::new(ferry_tests::channel(router).await);
    let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
    let req = pb::GenerateRequest {
        request_id: String::new(),
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: ids.clone() })),
        sampling: Some(pb::SamplingParams { max_new_tokens: 2, prompt_logprobs: Some(3), ..Default::default() }),
        stop: Vec::new(),
        return_token_ids: true,
        return_phases: false,
    };
    let mut s = c.generate(req).await.expect("generate").into_inner();
    let first = s.message().await.expect("stream").expect("a message");
    let got: Vec<u32> = first.prompt_logprobs.iter().map(|t| t.token_id).collect();
    assert_eq!(got, ids[1..], "every prompt token after the first, in order");
    assert!(first.prompt_logprobs.iter().all(|t| t.logprob <= 0.0), "{first:?}");
    assert_eq!(first.prompt_top_logprobs.len(), ids.len() - 1);
    assert!(first.prompt_top_logprobs.iter().all(|t| t.candidates.len() == 3), "{first:?}");
    while let Some(m) = s.message().await.expect("stream") {
        assert!(m.prompt_logprobs.is_empty(), "only the first message carries them");
    }
}
