//! No endpoint accepts a write it did not expect: every HTTP listener answers other methods
//! and paths with 405 / 404 and changes nothing; the router's gRPC port serves only the
//! public `Router` service (a worker's `Prefill`, `Decode` or `Bootstrap` called there is
//! UNIMPLEMENTED); a worker serves only its own role's services.

use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, channel, http, one_of_each, settle};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_refuse_what_they_do_not_serve() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 128, |_| ()).await;

    // HTTP: /metrics is read-only everywhere; the OpenAI API takes only its own methods.
    for addr in [p.metrics_addr, d.metrics_addr, r.metrics_addr] {
        for method in ["POST", "PUT", "DELETE", "PATCH"] {
            let (s, _, _) = http(addr, method, "/metrics", b"x").await;
            assert_eq!(s, 405, "{method} /metrics on {addr}");
        }
        assert_eq!(http(addr, "GET", "/admin", b"").await.0, 404);
    }
    let api = r.http_addr;
    for (method, path, want) in [
        ("POST", "/v1/models", 405),
        ("DELETE", "/v1/models", 405),
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
        ("POST", "/health", 405),
        ("POST", "/v1/embeddings", 404),
        ("POST", "/v1/files", 404),
        ("GET", "/../etc/passwd", 404),
    ] {
        let (s, _, body) = http(api, method, path, b"{}").await;
        assert_eq!(s, want, "{method} {path}: {body}");
        // An error body in the API's shape, naming the method.
        let v: serde_json::Value = serde_json::from_str(&body).expect("an error body");
        let code = if want == 404 { "not_found" } else { "method_not_allowed" };
        assert_eq!(v["error"]["code"], code, "{method} {path}: {body}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.starts_with(&format!("{method} "))), "{body}");
    }

    // gRPC: the router's port serves no worker service; a worker serves only its role's.
    let router = channel(r.grpc_addr).await;
    let prefill_req = pb::PrefillRequest::default();
    let e = pb::prefill_client::PrefillClient::new(router.clone()).prefill(prefill_req.clone()).await.expect_err("no");
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    let e = pb::bootstrap_client::BootstrapClient::new(router.clone())
        .handshake(pb::HandshakeRequest::default())
        .await
        .expect_err("no");
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    let e = pb::decode_client::DecodeClient::new(router).generate(pb::DecodeRequest::default()).await.expect_err("no");
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    let e = pb::decode_client::DecodeClient::new(channel(p.grpc_addr).await)
        .generate(pb::DecodeRequest::default())
        .await
        .expect_err("no");
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    let e =
        pb::prefill_client::PrefillClient::new(channel(d.grpc_addr).await).prefill(prefill_req).await.expect_err("no");
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");

    // Nothing changed: a request still works and no page is held.
    let body = serde_json::json!({"model": "hf", "prompt": "Hello", "max_tokens": 2, "temperature": 0}).to_string();
    let (_, _, models) = http(api, "GET", "/v1/models", b"").await;
    let model: serde_json::Value = serde_json::from_str(&models).expect("JSON");
    let body = body.replace("\"hf\"", &model["data"][0]["id"].to_string());
    let (s, _, text) = http(api, "POST", "/v1/completions", body.as_bytes()).await;
    assert_eq!(s, 200, "{text}");
    settle(&p, std::slice::from_ref(&d)).await;
}
