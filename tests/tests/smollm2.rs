//! The real model split across a prefill and a decode daemon gives exactly the colocated
//! engine's greedy tokens.

use ferry_engine::{Model, Tokenizer};
use ferry_kernels::cpu::CpuBackend;
use ferry_tests::{Client, colocated, greedy, smollm2};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_split_over_tcp_matches_the_colocated_engine() {
    let path = smollm2();
    let tok: Tokenizer = Model::load(&path, CpuBackend::default()).expect("load").tokenizer().clone();
    let texts = [
        "Once upon a time",
        "The capital of France is",
        "Once upon a time, in a small village by the river, there lived",
        "def fibonacci(n):",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t).expect("encode")).collect();
    // Byte-level BPE: each token's raw bytes (what logprobs report) spell the text, through
    // multi-byte characters split across tokens.
    let text = "héllo wörld ✓ 日本語\n\tdef f():";
    let bytes: Vec<u8> = tok.encode(text).expect("encode").iter().flat_map(|&i| tok.token_bytes(i)).collect();
    assert_eq!(bytes, text.as_bytes());
    let params = greedy(8);
    let want = colocated(&path, &prompts, &params);
    let mut pa = ferry_prefill::PrefillArgs::for_model(&path);
    pa.worker.pool_pages = 128;
    pa.worker.chunked_prefill_size = 8;
    let mut da = ferry_decode::DecodeArgs::for_model(&path);
    da.worker.pool_pages = 128;
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    let got = futures::future::join_all(prompts.iter().map(|x| c.generate(x, &params))).await;
    for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
        let g = g.unwrap_or_else(|e| panic!("{:?}: {e:?}", texts[i]));
        assert_eq!(&g, w, "{:?}: {:?} vs {:?}", texts[i], tok.decode(&g, true), tok.decode(w, true));
    }
    p.stop().await;
    d.stop().await;
}
