//! `n` > 1 as a fork, end to end: the official `openai` client against a router over real
//! prefill and decode workers, and a second router on the same workers that prefills on the
//! decode worker (colocated) — tests/py/fork.py; the gRPC `Router` API's `sampling.n`; and a
//! decode worker whose pool holds a long prompt's sequences only if they share its pages.

use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, one_of_each, python, router_for, served_model, settle};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_fork_one_prompt_through_prefill_decode_and_colocated() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 2048, |_| ()).await;
    let colocated = router_for(&m, &p, &d, |a| a.local_prefill_below = usize::MAX).await;
    let model = served_model(r.http_addr).await;
    let (pd, co) = (format!("http://{}/v1", r.http_addr), format!("http://{}/v1", colocated.http_addr));
    python("fork.py", &[&pd, &co, &model], "fork: ok").await;
    // The stop strings that ended one sequence each (fork.py, once per router) stopped them on
    // the decode worker too, while their siblings went on.
    let body = ferry_tests::scrape(r.http_addr).await;
    let aborted: f64 = body
        .lines()
        .filter(|l| {
            l.starts_with("ferry_requests_total") && l.contains("role=\"decode\"") && l.contains("outcome=\"abort\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(aborted >= 2.0, "sequences stopped on the decode worker: {aborted}");
    let ids: Vec<u32> = (0..70).map(|i| (i * 7 + 3) % 300).collect();
    let seqs = grpc_sequences(r.grpc_addr, &ids, 3, 5).await;
    assert!(seqs.iter().all(|s| s.len() == 5), "{seqs:?}");
    settle(&p, std::slice::from_ref(&d)).await;
    colocated.stop().await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}

/// 8 sequences of a 400-token prompt (25 pages of 16) and 8 tokens each need 208 pages as
/// separate requests, 40 as a fork (24 shared, 2 own each): a 48-page decode pool serves them
/// only if they share. The pages come back whole after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forked_sequences_share_the_prompts_pages() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 48, |_| ()).await;
    let ids: Vec<u32> = (0..400).map(|i| (i * 13 + 5) % 350).collect();
    let seqs = grpc_sequences(r.grpc_addr, &ids, 8, 8).await;
    assert!(seqs.iter().all(|s| s.len() == 8), "every sequence runs to max_new_tokens: {seqs:?}");
    assert!(seqs.iter().any(|s| s != &seqs[0]), "their own random streams: {seqs:?}");
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}

/// `sampling.n = n` on the gRPC API (temperature 1, a seed, `max_new_tokens`, past EOS):
/// every message names its sequence, each sequence ends once with its own usage, and the
/// phases trailer waits for the last. Returns each sequence's tokens.
async fn grpc_sequences(router: std::net::SocketAddr, ids: &[u32], n: u32, max: u32) -> Vec<Vec<u32>> {
    let mut c = pb::router_client::RouterClient::new(ferry_tests::channel(router).await);
    let req = pb::GenerateRequest {
        request_id: String::new(),
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: ids.to_vec() })),
        sampling: Some(pb::SamplingParams {
            temperature: 1.0,
            seed: Some(99),
            max_new_tokens: max,
            ignore_eos: true,
            n,
            ..Default::default()
        }),
        stop: Vec::new(),
        return_token_ids: true,
        return_phases: true,
    };
    let mut s = c.generate(req).await.expect("generate").into_inner();
    let mut tokens = vec![Vec::new(); n as usize];
    let mut ended = vec![false; n as usize];
    while let Some(msg) = s.message().await.expect("stream") {
        let i = msg.index as usize;
        assert!(i < n as usize && !ended[i], "sequence {i} after its end: {msg:?}");
        tokens[i].extend(&msg.token_ids);
        if msg.finish_reason != pb::FinishReason::Unspecified as i32 {
            ended[i] = true;
            assert_eq!(msg.prompt_tokens as usize, ids.len(), "the prompt, once per sequence's usage");
            assert_eq!(msg.completion_tokens as usize, tokens[i].len(), "its own tokens");
            // The phases come with the last sequence to end, and are the request's whole
            // (whichever sequence that is): its KV came by transfer, none was prefilled on
            // the decode worker.
            assert_eq!(!msg.phases.is_empty(), ended.iter().all(|&e| e), "{msg:?}");
            if !msg.phases.is_empty() {
                let phase = |p: &str| msg.phases.iter().find(|x| x.phase == p).map_or(0.0, |x| x.seconds);
                assert!(phase("transfer") > 0.0 && phase("local_prefill") == 0.0, "{:?}", msg.phases);
            }
        }
    }
    assert!(ended.iter().all(|&e| e), "every sequence ends: {ended:?}");
    tokens
}
