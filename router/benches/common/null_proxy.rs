//! A proxy that does none of the router's work, for W3's floor: on the router's core, it
//! reads each HTTP request's body whole, makes the same `Prefill` and `Generate` calls the
//! router would (over the router's own `ferry_router::h2_calls::Calls`, messages encoded
//! once at start, before any request: no JSON, no tokenizer, no placement, no encoding) and
//! answers a fixed small JSON body once both are answered. What it adds over the direct
//! baseline is what any router pays on this host for the hops alone: the client's HTTP
//! request to another core and back, and the two calls from there.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry_cluster::roles::PeerRole;
use ferry_router::h2_calls::Calls;
use http_body_util::BodyExt;
use hyper::body::{Buf, Bytes};
use hyper_util::rt::TokioIo;
use prost::Message;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// A running null proxy; stops when dropped.
pub struct NullProxy {
    pub addr: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// One prompt's two messages, encoded.
struct Messages {
    prefill: Bytes,
    decode: Bytes,
}

/// What every connection's requests share.
struct Shared {
    prefill: Calls,
    decode: Calls,
    msgs: Vec<Messages>,
    next: AtomicUsize,
}

/// Starts a null proxy on core 0 (a thread of its own, a current-thread runtime) calling the
/// mock workers `prefill` and `decode` with the prompts `ids` in turn, `max_new_tokens`
/// asked of decode.
pub fn start(prefill: &str, decode: &str, ids: &[Vec<u32>], max_new_tokens: u32) -> NullProxy {
    let msgs = ids
        .iter()
        .map(|ids| {
            let (p, d) = super::mock_workers::requests(ids.clone(), 1, max_new_tokens);
            Messages { prefill: p.encode_to_vec().into(), decode: d.encode_to_vec().into() }
        })
        .collect();
    let (prefill, decode) = (prefill.to_string(), decode.to_string());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    listener.set_nonblocking(true).expect("nonblocking");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        super::pin_this_thread_to_core0();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            // Calls spawn their connections' tasks on first use: in this runtime.
            let t = Duration::from_secs(10);
            let calls = |addr: &str, role| Calls::new(addr, None, role, t, t).expect("calls");
            let shared = Arc::new(Shared {
                prefill: calls(&prefill, PeerRole::Prefill),
                decode: calls(&decode, PeerRole::Decode),
                msgs,
                next: AtomicUsize::new(0),
            });
            serve(listener, shared, stopped).await
        });
    });
    NullProxy { addr, _stop: stop }
}

async fn serve(listener: std::net::TcpListener, shared: Arc<Shared>, mut stopped: tokio::sync::oneshot::Receiver<()>) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => accepted.expect("accept").0,
            _ = &mut stopped => return,
        };
        tcp.set_nodelay(true).expect("nodelay");
        let shared = Arc::clone(&shared);
        let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let shared = Arc::clone(&shared);
            async move {
                let body = req.into_body().collect().await?.to_bytes();
                let m = &shared.msgs[shared.next.fetch_add(1, Ordering::Relaxed) % shared.msgs.len()];
                let (p, d) = tokio::join!(
                    call_unary(shared.prefill.clone(), "/ferry.v1.Prefill/Prefill", m.prefill.clone()),
                    call_stream(shared.decode.clone(), "/ferry.v1.Decode/Generate", m.decode.clone())
                );
                p.expect("prefill");
                d.expect("generate");
                let answer = format!("{{\"object\":\"null\",\"bytes\":{}}}", body.len());
                Ok::<_, hyper::Error>(hyper::Response::new(http_body_util::Full::new(Bytes::from(answer))))
            }
        });
        tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), service));
    }
}

fn client(calls: Calls) -> tonic::client::Grpc<Calls> {
    let origin = calls.origin().clone();
    tonic::client::Grpc::with_origin(calls, origin)
}

async fn call_unary(calls: Calls, path: &'static str, msg: Bytes) -> Result<(), Status> {
    let mut grpc = client(calls);
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    grpc.unary(tonic::Request::new(msg), path, Raw).await.map(drop)
}

async fn call_stream(calls: Calls, path: &'static str, msg: Bytes) -> Result<(), Status> {
    let mut grpc = client(calls);
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    let mut s = grpc.server_streaming(tonic::Request::new(msg), path, Raw).await?.into_inner();
    while s.message().await?.is_some() {}
    Ok(())
}

/// Messages as bytes, both ways.
struct Raw;

impl Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        use prost::bytes::BufMut;
        buf.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining())))
    }
}
