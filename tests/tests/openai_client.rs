//! The official `openai` Python client (installed by scripts/setup) against a router and real
//! workers: the requests SDKs send must be answered, not refused (tests/py/openai_client.py).

use ferry_tests::{TinyModel, one_of_each, settle};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_is_served() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 512, |_| ()).await;
    let (_, _, models) = ferry_tests::http(r.http_addr, "GET", "/v1/models", b"").await;
    let v: serde_json::Value = serde_json::from_str(&models).expect("JSON");
    let model = v["data"][0]["id"].as_str().expect("a model").to_string();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("py/openai_client.py");
    let base = format!("http://{}/v1", r.http_addr);
    let out =
        tokio::process::Command::new("python3").arg(&script).arg(&base).arg(&model).output().await.expect("python3");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client failed:\n{text}");
    assert!(text.contains("openai client: ok"), "{text}");
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}
