//! TLS on the router's public endpoints: with a certificate, gRPC and the OpenAI HTTP API
//! answer over TLS to a client that trusts it; plaintext clients get nowhere, the failed
//! handshakes are counted, and bad certificate files stop the router with a clear error.

use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, scrape};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

struct Cert {
    dir: tempfile::TempDir,
    pem: String,
}

fn self_signed() -> Cert {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("a certificate");
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("cert.pem"), ck.cert.pem()).expect("write cert");
    std::fs::write(dir.path().join("key.pem"), ck.signing_key.serialize_pem()).expect("write key");
    Cert { dir, pem: ck.cert.pem() }
}

/// An HTTPS/1.1 request over rustls trusting `ca`; returns the status and body.
async fn https(addr: std::net::SocketAddr, ca: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(c.expect("pem")).expect("a root");
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("name");
    let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await.expect("TLS handshake");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await; // a close without close_notify is fine here
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, text.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_endpoints_speak_tls() {
    let m = TinyModel::new();
    let cert = self_signed();
    let mut a = ferry_decode::DecodeArgs::for_model(m.path());
    a.worker.pool_pages = 512;
    let d = ferry_decode::start(a).await.expect("decode up");
    let mut args = ferry_router::RouterArgs::new(m.path(), Vec::new(), vec![d.grpc_addr.to_string()]);
    args.tls_cert = Some(cert.dir.path().join("cert.pem"));
    args.tls_key = Some(cert.dir.path().join("key.pem"));
    let r = ferry_router::start(args).await.expect("router up");
    for _ in 0..200 {
        if r.ready(0, 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // gRPC over TLS, trusting the certificate.
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&cert.pem))
        .domain_name("localhost");
    let ch = tonic::transport::Endpoint::from_shared(format!("https://{}", r.grpc_addr))
        .expect("uri")
        .tls_config(tls)
        .expect("tls config")
        .connect()
        .await
        .expect("gRPC over TLS");
    let mut c = pb::router_client::RouterClient::new(ch);
    let t = c
        .tokenize(pb::TokenizeRequest { input: Some(pb::tokenize_request::Input::Text("Once upon".into())) })
        .await
        .expect("tokenize over TLS");
    assert!(!t.into_inner().token_ids.is_empty());

    // A plaintext gRPC client gets nowhere.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{}", r.grpc_addr)).expect("uri");
    let refused = match plain.connect().await {
        Err(_) => true,
        Ok(ch) => pb::router_client::RouterClient::new(ch).tokenize(pb::TokenizeRequest::default()).await.is_err(),
    };
    assert!(refused, "plaintext gRPC must fail against a TLS router");

    // HTTPS: the OpenAI API answers a completion.
    let (s, body) = https(r.http_addr, &cert.pem, "GET", "/v1/models", "").await;
    assert_eq!(s, 200, "{body}");
    let model = serde_json::from_str::<serde_json::Value>(&body).expect("json")["data"][0]["id"].clone();
    let req = serde_json::json!({"model": model, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0});
    let (s, body) = https(r.http_addr, &cert.pem, "POST", "/v1/completions", &req.to_string()).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&body).expect("json")["usage"]["completion_tokens"], 3);

    // Plain HTTP to the TLS port: no answer, and the failed handshake is counted.
    let mut s = tokio::net::TcpStream::connect(r.http_addr).await.expect("connect");
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    assert!(!String::from_utf8_lossy(&out).contains("200 OK"), "plain HTTP must not be served");
    let mut counted = false;
    for _ in 0..100 {
        counted = scrape(r.metrics_addr).await.lines().any(|l| {
            l.starts_with("ferry_bad_requests_total") && l.contains("reason=\"tls_handshake\"") && !l.ends_with(" 0")
        });
        if counted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(counted, "the failed handshake is counted");
    r.stop().await;
    d.stop().await;
}

#[tokio::test]
async fn bad_certificate_files_stop_the_router_with_a_clear_error() {
    let m = TinyModel::new();
    let cert = self_signed();
    let garbage = cert.dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").expect("write");
    for (c, k, why) in [
        (cert.dir.path().join("missing.pem"), cert.dir.path().join("key.pem"), "missing.pem"),
        (garbage.clone(), cert.dir.path().join("key.pem"), "no certificate"),
        (cert.dir.path().join("cert.pem"), garbage, "private key"),
    ] {
        let mut args = ferry_router::RouterArgs::new(m.path(), Vec::new(), vec!["127.0.0.1:1".into()]);
        args.tls_cert = Some(c);
        args.tls_key = Some(k);
        let e = ferry_router::start(args).await.err().expect("refused");
        assert!(e.to_string().contains(why), "{why}: {e}");
    }
}
