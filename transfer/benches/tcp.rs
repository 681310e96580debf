//! TCP data-plane benchmark (run: `cargo bench -p ferry-transfer --bench tcp`).
//!
//! 1. Baselines: plain loopback TCP, 1 MiB writes (what iperf3 measures), over one connection
//!    from one cache-resident buffer and from a 256 MiB one, and over 4 connections.
//! 2. Ferry's tcp backend moving a 256 MiB KV cache (SmolLM2 pages: 720 KiB for 16 tokens)
//!    from one arena into another, in page runs, over 1 and 4 connections, plaintext and
//!    under mutual TLS (the daemons' default); each row's ratio to plain TCP over as many
//!    connections from buffers as large, and TLS against plaintext. Every repetition runs
//!    every row once, interleaved.
//! 3. Streaming: the same KV in 32 chunks sent as a simulated prefill produces them; how long
//!    after the last chunk is produced the receiver completes, relative to one chunk's
//!    transfer time alone.
//!
//! `FERRY_BENCH_QUICK=1` uses 32 MiB (CI smoke run). Medians of 7 rounds (3 when quick).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{Room, RoomSecret};
use ferry_transfer::frame::Aux;
use ferry_transfer::memory::HostPages;
use ferry_transfer::room::Timeouts;
use ferry_transfer::runs::PageRun;
use ferry_transfer::secure::{DataTls, PeerCheck, Security};
use ferry_transfer::table::Outcome;
use ferry_transfer::tcp::{TcpConfig, TcpReceiver, TcpSender};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PAGE: usize = 720 * 1024;
const MIB: usize = 1 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Plain TCP over `conns` connections, 1 MiB writes, `bytes` split evenly among them. With
/// `arena`, the bytes come from and land in buffers of the connection's whole share (as KV
/// pages do) instead of one cache-resident 1 MiB buffer. Buffers are made and touched before
/// the clock starts.
async fn baseline(bytes: usize, conns: usize, arena: bool) -> std::io::Result<f64> {
    let share = bytes / conns / MIB * MIB;
    let len = if arena { share } else { MIB };
    let listener = tokio::net::TcpListener::bind(addr()).await?;
    let a = listener.local_addr()?;
    let (mut readers, mut writers) = (Vec::new(), Vec::new());
    for _ in 0..conns {
        let s = tokio::net::TcpStream::connect(a).await?;
        let (mut r, _) = listener.accept().await?;
        let mut buf = vec![1u8; len];
        readers.push(tokio::spawn(async move {
            let mut got = 0;
            while got < share {
                // Into the arena, as much as the socket holds (as Ferry's receiver reads a
                // frame's payload); into the small buffer, at most its 1 MiB.
                let n = if arena { r.read(&mut buf[got..]).await? } else { r.read(&mut buf[..]).await? };
                if n == 0 {
                    break;
                }
                got += n;
            }
            Ok::<usize, std::io::Error>(got)
        }));
        writers.push((s, vec![1u8; len]));
    }
    let t = Instant::now();
    let writers: Vec<_> = writers
        .into_iter()
        .map(|(mut s, buf)| {
            tokio::spawn(async move {
                for i in 0..share / MIB {
                    let at = if arena { i * MIB } else { 0 };
                    s.write_all(&buf[at..at + MIB]).await?;
                }
                Ok::<(), std::io::Error>(())
            })
        })
        .collect();
    for w in writers {
        w.await.map_err(std::io::Error::other)??;
    }
    let mut got = 0;
    for r in readers {
        got += r.await.map_err(std::io::Error::other)??;
    }
    assert_eq!(got, share * conns);
    Ok(got as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// Mutual TLS as the daemons run it (a throwaway CA, one certificate for both ends, roles not
/// checked: the cost is the handshake and the record layer).
fn tls() -> Security {
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    use tokio_rustls::rustls::server::WebPkiClientVerifier;
    use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_der = ca.self_signed(&ca_key).expect("ca").der().clone();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().expect("key");
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
    let leaf = leaf.signed_by(&key, &issuer).expect("leaf").der().clone();
    let pk = || PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let mut roots = RootCertStore::empty();
    roots.add(CertificateDer::from(ca_der.to_vec())).expect("root");
    let provider = ferry_core::tls::crypto_provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots.clone()), Arc::clone(&provider))
        .build()
        .expect("verifier");
    let server = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![leaf.clone()], pk())
        .expect("server");
    let client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![leaf], pk())
        .expect("client");
    let any: PeerCheck = Arc::new(|_| Ok(()));
    Security::Tls(Arc::new(DataTls::new(&server, &client, None, Arc::clone(&any), any)))
}

struct Setup {
    src: HostPages,
    receiver: TcpReceiver,
    sender: TcpSender,
}

async fn setup(pages: usize, connections: usize, security: &Security) -> std::io::Result<Setup> {
    let src = HostPages::new(PAGE, pages).ok_or_else(|| std::io::Error::other("alloc"))?;
    let dst = Arc::new(HostPages::new(PAGE, pages).ok_or_else(|| std::io::Error::other("alloc"))?);
    let frame_pages = std::env::var("FERRY_BENCH_FRAME_PAGES").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let cfg = TcpConfig { connections, max_frame_pages: frame_pages, timeouts: Timeouts::default() };
    let receiver = TcpReceiver::bind_secure(addr(), dst, cfg, security.clone()).await?;
    let faults = Arc::new(ferry_transfer::tcp::NoFaults);
    let sender = TcpSender::connect_secure(receiver.local_addr(), cfg, security, faults).await?;
    Ok(Setup { src, receiver, sender })
}

async fn send_room(s: &Setup, id: u64, chunks: &[PageRun], pace: Option<Duration>) -> std::io::Result<(f64, f64)> {
    let total: u32 = chunks.iter().map(|r| r.len).sum();
    let dest: Vec<u32> = chunks.iter().flat_map(|r| r.dst..r.dst + r.len).collect();
    let (room, secret) = (Room::new(id).expect("63 bits"), RoomSecret::from([3; 16]));
    let done = s.receiver.open(room, secret, &dest).map_err(|r| std::io::Error::other(r.label()))?;
    let t = Instant::now();
    // The producer "computes" chunks (sleeps `pace` each) and hands them over; the consumer
    // sends each as soon as it is produced, overlapping the next chunk's compute.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<PageRun>(chunks.len().max(1));
    let producer = async {
        let mut last = Instant::now();
        for c in chunks {
            if let Some(p) = pace {
                tokio::time::sleep(p).await;
            }
            last = Instant::now();
            if tx.send(*c).await.is_err() {
                break;
            }
        }
        drop(tx);
        last
    };
    let consumer = async {
        while let Some(c) = rx.recv().await {
            s.sender.send_pages(room, secret, &[c], &s.src).await?;
        }
        Ok::<(), std::io::Error>(())
    };
    let (last_produced, sent) = tokio::join!(producer, consumer);
    sent?;
    s.sender.send_done(room, secret, Aux { first_token: 0, logprob: 0.0, room_echo: id, total_pages: total }).await?;
    let outcome = tokio::time::timeout(Duration::from_secs(60), done)
        .await
        .map_err(std::io::Error::other)?
        .map_err(std::io::Error::other)?;
    let end = Instant::now();
    s.receiver.close(room);
    match outcome {
        Outcome::Success(_) => Ok(((end - t).as_secs_f64(), (end - last_produced).as_secs_f64())),
        Outcome::Failed(r) => Err(std::io::Error::other(format!("{r:?}"))),
    }
}

async fn run(quick: bool) -> std::io::Result<()> {
    let bytes = if quick { 32 * MIB } else { 256 * MIB };
    let pages = bytes / PAGE;
    let kv = pages * PAGE;
    let reps = if quick { 3 } else { 7 };
    let whole = [PageRun { src: 0, dst: 0, len: pages as u32 }];
    let tls = tls();
    // Ferry's rows, each beside plain TCP over as many connections; every repetition runs
    // every row once, in turn, so a noisy moment of the machine falls on all of them.
    let mut ferry = Vec::new();
    for conns in [1usize, 4] {
        for (security, mode) in [(&Security::Plain, "plaintext"), (&tls, "mutual TLS")] {
            ferry.push((conns, mode, setup(pages, conns, security).await?, Vec::new()));
        }
    }
    let (mut base, mut base_arena, mut base4) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..reps {
        base.push(baseline(bytes, 1, false).await?);
        base_arena.push(baseline(bytes, 1, true).await?);
        base4.push(baseline(bytes, 4, true).await?);
        for (_, _, s, v) in &mut ferry {
            let (t, _) = send_room(s, r as u64 + 1, &whole, None).await?;
            v.push(kv as f64 / t / 1e9);
        }
    }
    let (base, base_arena, base4) = (median(base), median(base_arena), median(base4));
    println!(
        "KV transfer over loopback TCP, {} pages of {} KiB ({:.0} MiB), median of {reps} interleaved rounds",
        pages,
        PAGE / 1024,
        kv as f64 / MIB as f64
    );
    println!("{:<48} {:>8} {:>22}", "", "GB/s", "vs plain TCP, same conns");
    println!("{:<48} {:>8.2} {:>22}", "plain TCP, 1 connection, 1 MiB buffer (baseline)", base, "1.00");
    println!("{:<48} {:>8.2} {:>22.2}", "plain TCP, 1 connection, whole-share buffers", base_arena, base_arena / base);
    println!("{:<48} {:>8.2} {:>22}", "plain TCP, 4 connections, whole-share buffers", base4, "-");
    let mut by_mode = [0.0f64; 2];
    for (i, (conns, mode, _, v)) in ferry.into_iter().enumerate() {
        let g = median(v);
        // Like with like: the arena rows (Ferry's pages are an arena too), as many connections.
        let plain = if conns == 1 { base_arena } else { base4 };
        println!("{:<48} {:>8.2} {:>22.2}", format!("ferry tcp, {conns} connection(s), {mode}"), g, g / plain);
        by_mode[i % 2] = g;
        if i % 2 == 1 {
            println!(
                "{:<48} {:>8} {:>22.2}",
                format!("  mutual TLS / plaintext, {conns} connection(s)"),
                "",
                by_mode[1] / by_mode[0]
            );
        }
    }
    // Streaming: 32 chunks produced one after another.
    let s = setup(pages, 4, &Security::Plain).await?;
    let bound = |i: usize| (i * pages / 32) as u32;
    let chunks: Vec<PageRun> =
        (0..32).map(|i| PageRun { src: bound(i), dst: bound(i), len: bound(i + 1) - bound(i) }).collect();
    let per = chunks[0].len;
    let mut one = Vec::new();
    for r in 0..reps {
        one.push(send_room(&s, 100 + r as u64, &chunks[..1], None).await?.0);
    }
    let one = median(one);
    let pace = Duration::from_secs_f64(one * 1.5);
    let mut tails = Vec::new();
    let mut totals = Vec::new();
    for r in 0..reps {
        let (total, tail) = send_room(&s, 200 + r as u64, &chunks, Some(pace)).await?;
        tails.push(tail);
        totals.push(total);
    }
    let tail = median(tails);
    println!(
        "\nStreaming {} chunks of ~{} pages, one produced every {:.1} ms (1.5x one chunk's transfer of {:.1} ms):",
        chunks.len(),
        per,
        pace.as_secs_f64() * 1e3,
        one * 1e3
    );
    println!(
        "  receiver complete {:.1} ms after the last chunk was produced = {:.2} chunk transfer times; whole room {:.0} ms",
        tail * 1e3,
        tail / one,
        median(totals) * 1e3
    );
    Ok(())
}

fn main() -> std::io::Result<()> {
    let quick = ferry_core::bench::quick();
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(run(quick))
}
