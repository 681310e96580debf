//! Prefill and decode daemons in-process, real gRPC and a real data plane between them: the
//! tokens are exactly the colocated engine's, and every page comes back.

use ferry_decode::DecodeArgs;
use ferry_prefill::PrefillArgs;
use ferry_tests::{Client, TinyModel, colocated, greedy, prompts_with_shared_prefixes, settle};

struct Setup {
    page_size: usize,
    chunk: usize,
    transfer: &'static str,
    decodes: usize,
}

fn prefill_args(m: &TinyModel, s: &Setup) -> PrefillArgs {
    let mut a = PrefillArgs::for_model(m.path());
    a.worker.page_size = s.page_size;
    a.worker.chunked_prefill_size = s.chunk;
    a.worker.pool_pages = 4096;
    a.worker.transfer = s.transfer.into();
    a
}

fn decode_args(m: &TinyModel, s: &Setup) -> DecodeArgs {
    let mut a = DecodeArgs::for_model(m.path());
    a.worker.page_size = s.page_size;
    a.worker.chunked_prefill_size = s.chunk;
    a.worker.pool_pages = 4096;
    a.worker.transfer = s.transfer.into();
    a
}

async fn parity(s: Setup, n: usize, max_len: usize) {
    let m = TinyModel::new();
    let prompts = prompts_with_shared_prefixes(n, max_len, 359, 11);
    let params = greedy(5);
    let want = colocated(&m.path(), &prompts, &params);
    let p = ferry_prefill::start(prefill_args(&m, &s)).await.expect("prefill up");
    let mut ds = Vec::new();
    for _ in 0..s.decodes {
        ds.push(ferry_decode::start(decode_args(&m, &s)).await.expect("decode up"));
    }
    let mut clients = Vec::new();
    for d in &ds {
        clients.push(Client::new(d.grpc_addr, Some(p.grpc_addr)).await);
    }
    let runs = prompts.iter().enumerate().map(|(i, prompt)| {
        let c = clients[i % clients.len()].clone();
        let params = params.clone();
        async move { c.generate(prompt, &params).await }
    });
    let got = futures::future::join_all(runs).await;
    for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
        let g = g.unwrap_or_else(|e| panic!("prompt {i} ({} tokens): {e:?}", prompts[i].len()));
        assert_eq!(&g, w, "prompt {i} ({} tokens)", prompts[i].len());
    }
    settle(&p, &ds).await;
    p.stop().await;
    for d in ds {
        d.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_parity_32_prompts_chunks_dividing_the_page() {
    parity(Setup { page_size: 16, chunk: 64, transfer: "tcp", decodes: 1 }, 32, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_parity_with_chunks_not_dividing_the_page() {
    parity(Setup { page_size: 16, chunk: 50, transfer: "tcp", decodes: 1 }, 32, 2000).await;
    parity(Setup { page_size: 7, chunk: 64, transfer: "tcp", decodes: 1 }, 12, 700).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_decode_daemons_share_one_prefill_daemon() {
    parity(Setup { page_size: 16, chunk: 128, transfer: "tcp", decodes: 2 }, 32, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_transport_schedules_the_same_way() {
    // Nothing moves: the decode node's pages hold no prompt KV, so only scheduling and page
    // accounting are checked here — every request completes with the requested length.
    let s = Setup { page_size: 16, chunk: 64, transfer: "fake", decodes: 1 };
    let m = TinyModel::new();
    let prompts = prompts_with_shared_prefixes(32, 2000, 359, 5);
    let p = ferry_prefill::start(prefill_args(&m, &s)).await.expect("prefill up");
    let d = ferry_decode::start(decode_args(&m, &s)).await.expect("decode up");
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    let params = greedy(4);
    let runs = prompts.iter().map(|prompt| c.generate(prompt, &params));
    for (i, r) in futures::future::join_all(runs).await.into_iter().enumerate() {
        assert_eq!(r.unwrap_or_else(|e| panic!("prompt {i}: {e:?}")).len(), 4);
    }
    let ds = [d];
    settle(&p, &ds).await;
    p.stop().await;
    for d in ds {
        d.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_prefill_on_the_decode_node_matches_too() {
    let s = Setup { page_size: 16, chunk: 100, transfer: "tcp", decodes: 1 };
    let m = TinyModel::new();
    let prompts = prompts_with_shared_prefixes(8, 1500, 359, 3);
    let params = greedy(5);
    let want = colocated(&m.path(), &prompts, &params);
    let d = ferry_decode::start(decode_args(&m, &s)).await.expect("decode up");
    let c = Client::new(d.grpc_addr, None).await;
    let got = futures::future::join_all(prompts.iter().map(|p| c.generate(p, &params))).await;
    for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
        assert_eq!(&g.unwrap_or_else(|e| panic!("prompt {i}: {e:?}")), w, "prompt {i}");
    }
    let l = d.load();
    assert_eq!(l.free_pages, l.total_pages);
    d.stop().await;
}
