//! Prefill and decode daemons in-process, real gRPC and a real data plane between them: the
//! tokens are exactly the colocated engine's, and every page comes back.

use clap::Parser as _;
use ferry_decode::DecodeArgs;
use ferry_prefill::PrefillArgs;
use ferry_tests::{Client, TinyModel, colocated_scored, greedy, prompts_with_shared_prefixes, settle, settle_decode};
use ferry_transfer::BackendKind;
use ferry_worker::Device;

struct Setup {
    page_size: usize,
    chunk: usize,
    transfer: BackendKind,
    decodes: usize,
    /// Pages through host mirrors of the pools (the GPU path, on the CPU).
    mirror: bool,
}

fn prefill_args(m: &TinyModel, s: &Setup) -> PrefillArgs {
    let mut a = PrefillArgs::for_model(m.path());
    a.worker.page_size = s.page_size;
    a.worker.chunked_prefill_size = s.chunk;
    a.worker.pool_pages = 4096;
    a.worker.transfer = s.transfer;
    a.worker.kv_host_mirror = s.mirror;
    a
}

fn decode_args(m: &TinyModel, s: &Setup) -> DecodeArgs {
    let mut a = DecodeArgs::for_model(m.path());
    a.worker.page_size = s.page_size;
    a.worker.chunked_prefill_size = s.chunk;
    a.worker.pool_pages = 4096;
    a.worker.transfer = s.transfer;
    a.worker.kv_host_mirror = s.mirror;
    a
}

/// Same tokens and, within float noise, the same logprobs: a page with the wrong K/V moves
/// the logprobs of a tiny random model even where its greedy tokens stay put.
fn same_scores(got: &[(u32, f32)], want: &[(u32, f32)], what: &str) {
    let tokens = |x: &[(u32, f32)]| x.iter().map(|p| p.0).collect::<Vec<_>>();
    assert_eq!(tokens(got), tokens(want), "{what}: tokens");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g.1 - w.1).abs() <= 1e-3 * (1.0 + w.1.abs()), "{what}: token {k} logprob {} vs {}", g.1, w.1);
    }
}

async fn parity(s: Setup, n: usize, max_len: usize) {
    let m = TinyModel::new();
    let prompts = prompts_with_shared_prefixes(n, max_len, 359, 11);
    let params = greedy(5);
    let want = colocated_scored(&m.path(), &prompts, &params);
    let p = ferry_prefill::start(prefill_args(&m, &s)).await.expect("prefill up");
    assert_eq!(p.kv_mirrored, s.mirror);
    let mut ds = Vec::new();
    for _ in 0..s.decodes {
        let d = ferry_decode::start(decode_args(&m, &s)).await.expect("decode up");
        assert_eq!(d.kv_mirrored, s.mirror);
        ds.push(d);
    }
    let mut clients = Vec::new();
    for d in &ds {
        clients.push(Client::new(d.grpc_addr, Some(p.grpc_addr)).await);
    }
    let runs = prompts.iter().enumerate().map(|(i, prompt)| {
        let c = clients[i % clients.len()].clone();
        let params = params.clone();
        async move { c.generate_scored(prompt, &params).await }
    });
    let got = futures::future::join_all(runs).await;
    for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
        let g = g.unwrap_or_else(|e| panic!("prompt {i} ({} tokens): {e:?}", prompts[i].len()));
        same_scores(&g, w, &format!("prompt {i} ({} tokens)", prompts[i].len()));
    }
    settle(&p, &ds).await;
    p.stop().await;
    for d in ds {
        d.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_parity_32_prompts_chunks_dividing_the_page() {
    parity(Setup { page_size: 16, chunk: 64, transfer: BackendKind::Tcp, decodes: 1, mirror: false }, 32, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_parity_with_chunks_not_dividing_the_page() {
    parity(Setup { page_size: 16, chunk: 50, transfer: BackendKind::Tcp, decodes: 1, mirror: false }, 32, 2000).await;
    parity(Setup { page_size: 7, chunk: 64, transfer: BackendKind::Tcp, decodes: 1, mirror: false }, 12, 700).await;
}

/// The GPU path on the CPU: prefill copies each chunk's pages to a host mirror before they
/// go out, decode copies a complete room's pages from its mirror into the pool. A missing or
/// misplaced copy changes the tokens. Concurrent prompts share cached prefixes, so pages
/// already on the wire for one room are sent again for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_parity_through_host_mirrors() {
    parity(Setup { page_size: 16, chunk: 50, transfer: BackendKind::Tcp, decodes: 2, mirror: true }, 32, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_decode_daemons_share_one_prefill_daemon() {
    parity(Setup { page_size: 16, chunk: 128, transfer: BackendKind::Tcp, decodes: 2, mirror: false }, 32, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_transport_schedules_the_same_way() {
    // Nothing moves: the decode node's pages hold no prompt KV, so only scheduling and page
    // accounting are checked here — every request completes with the requested length.
    let s = Setup { page_size: 16, chunk: 64, transfer: BackendKind::Fake, decodes: 1, mirror: false };
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
    let s = Setup { page_size: 16, chunk: 100, transfer: BackendKind::Tcp, decodes: 1, mirror: false };
    let m = TinyModel::new();
    let prompts = prompts_with_shared_prefixes(8, 1500, 359, 3);
    let params = greedy(5);
    let want = colocated_scored(&m.path(), &prompts, &params);
    let d = ferry_decode::start(decode_args(&m, &s)).await.expect("decode up");
    let c = Client::new(d.grpc_addr, None).await;
    let got = futures::future::join_all(prompts.iter().map(|p| c.generate_scored(p, &params))).await;
    for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
        same_scores(&g.unwrap_or_else(|e| panic!("prompt {i}: {e:?}")), w, &format!("prompt {i}"));
    }
    settle_decode(std::slice::from_ref(&d)).await;
    d.stop().await;
}

/// `--device cuda:4096`, a GPU no machine has: the daemons refuse to start and say why, on any
/// machine (without a GPU, the driver or CUDA libraries are missing; in a build without CUDA,
/// the feature; on a GPU machine, the device).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_daemons_refuse_a_gpu_that_is_not_there_and_say_why() {
    let s = Setup { page_size: 16, chunk: 64, transfer: BackendKind::Tcp, decodes: 1, mirror: false };
    let m = TinyModel::new();
    let mut pa = prefill_args(&m, &s);
    pa.worker.device = Device::Cuda(4096);
    let mut da = decode_args(&m, &s);
    da.worker.device = Device::Cuda(4096);
    let why = |e: ferry_prefill::StartError| {
        let text = e.to_string();
        assert!(text.contains("--device cuda"), "{text}");
    };
    match ferry_prefill::start(pa).await {
        Ok(_) => panic!("prefill started on GPU 4096, which no machine has"),
        Err(e) => why(e),
    }
    match ferry_decode::start(da).await {
        Ok(_) => panic!("decode started on GPU 4096, which no machine has"),
        Err(e) => why(e),
    }
    // A device that is not one fails as the flags are parsed, before anything loads.
    let e = PrefillArgs::try_parse_from(["ferry-prefill", "--model", "m", "--device", "cuda:x"]).expect_err("no index");
    assert!(e.to_string().contains("GPU index"), "{e}");
}

/// On a GPU (feature `gpu-tests`, built by `scripts/gpu-kit` for a lent GPU): `--device cuda`
/// daemons start on GPU 0, their pools mirrored to the host for the data plane.
#[cfg(feature = "gpu-tests")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_daemons_start_on_gpu_0_with_mirrored_pools() {
    let s = Setup { page_size: 16, chunk: 64, transfer: BackendKind::Tcp, decodes: 1, mirror: false };
    let m = TinyModel::new();
    let mut pa = prefill_args(&m, &s);
    pa.worker.device = Device::Cuda(0);
    let mut da = decode_args(&m, &s);
    da.worker.device = Device::Cuda(0);
    let p = ferry_prefill::start(pa).await.unwrap_or_else(|e| panic!("prefill on GPU 0: {e}"));
    assert!(p.kv_mirrored, "a GPU pool travels through a host mirror");
    let d = ferry_decode::start(da).await.unwrap_or_else(|e| panic!("decode on GPU 0: {e}"));
    assert!(d.kv_mirrored, "a GPU pool travels through a host mirror");
    d.stop().await;
    p.stop().await;
}
