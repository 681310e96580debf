//! The `ferry` binary as a user runs it.

use std::path::PathBuf;
use std::process::{Command, Output};

use ferry_engine::tiny::{TinySpec, write_hf};

fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry")).args(args).output().expect("run ferry")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn generate_json_reports_ids_text_logprobs_and_timings() {
    let dir = tempfile::tempdir().expect("tmp");
    write_hf(dir.path(), &TinySpec::default()).expect("tiny");
    let m = dir.path().to_str().expect("path");
    let o = ferry(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        "5,6,7,8",
        "--max-tokens",
        "6",
        "--json",
        "--top-logprobs",
        "3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(j["prompt_token_ids"], serde_json::json!([5, 6, 7, 8]));
    let ids = j["token_ids"].as_array().expect("ids");
    assert!(!ids.is_empty() && ids.len() <= 6);
    assert_eq!(j["logprobs"].as_array().expect("logprobs").len(), ids.len());
    assert!(j["logprobs"].as_array().expect("lp").iter().all(|v| v.as_f64().is_some_and(|x| x <= 0.0)));
    assert_eq!(j["top_logprobs"][0].as_array().expect("top").len(), 3);
    assert!(j["timings"]["prefill_ms"].as_f64().is_some_and(|t| t > 0.0));
    assert!(j["text"].is_string());
    // Greedy is deterministic.
    let again = ferry(&["generate", "--model", m, "--prompt-ids", "5,6,7,8", "--max-tokens", "6", "--json"]);
    let j2: serde_json::Value = serde_json::from_slice(&again.stdout).expect("json");
    assert_eq!(j2["token_ids"], j["token_ids"]);
    // Chat mode renders the template.
    let chat = ferry(&["generate", "--model", m, "--prompt", "hi", "--chat", "--max-tokens", "2", "--json"]);
    let j3: serde_json::Value = serde_json::from_slice(&chat.stdout).expect("json");
    assert_eq!(j3["prompt_token_ids"][0], 1, "starts with <|im_start|>");
    // A batch of copies, past EOS, in fast CPU math (an f32 model: the same tokens).
    let args = ["--prompt-ids", "5,6,7,8", "--max-tokens", "6", "--json", "--ignore-eos", "--cpu-math", "fast"];
    let batch = ferry(&[&["generate", "--model", m, "--batch", "3"][..], &args].concat());
    assert!(batch.status.success(), "{}", stderr(&batch));
    let jb: serde_json::Value = serde_json::from_slice(&batch.stdout).expect("json");
    let one = ferry(&[&["generate", "--model", m][..], &args].concat());
    let j1: serde_json::Value = serde_json::from_slice(&one.stdout).expect("json");
    assert_eq!(jb["token_ids"].as_array().map(Vec::len), Some(6), "exactly --max-tokens past EOS");
    assert_eq!(jb["token_ids"], j1["token_ids"], "a copy in a batch decodes as alone");
    let rate = |j: &serde_json::Value| j["timings"]["decode_tokens_per_s"].as_f64().expect("rate");
    assert!(rate(&jb) > 0.0 && rate(&j1) > 0.0);
    let refused = ferry(&["generate", "--model", m, "--prompt", "x", "--batch", "2"]);
    assert!(!refused.status.success() && stderr(&refused).contains("--json"), "{}", stderr(&refused));
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    let dir = tempfile::tempdir().expect("tmp");
    write_hf(dir.path(), &TinySpec { ctx: 32, ..TinySpec::default() }).expect("tiny");
    let m = dir.path().to_str().expect("path");
    let long = vec!["5"; 40].join(",");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["generate", "--model", "/nonexistent/model.gguf", "--prompt", "x"], "model not found"),
        (vec!["generate", "--model", m, "--prompt", ""], "empty"),
        (vec!["generate", "--model", m, "--prompt-ids", "5,99999"], "outside the vocabulary"),
        (vec!["generate", "--model", m, "--prompt-ids", &long], "context"),
        (vec!["generate", "--model", m, "--prompt", "x", "--temperature=-2"], "temperature"),
        (vec!["generate", "--model", m, "--prompt", "x", "--top-p", "0"], "top_p"),
        (vec!["model", "fetch", "no-such-model"], "unknown model"),
        (vec!["generate", "--model", m, "--prompt", "x", "--device", "tpu"], "use cpu, cuda or cuda:N"),
        (vec!["generate", "--model", m, "--prompt", "x", "--device", "cuda:x"], "GPU index"),
        // The daemons check every flag before loading anything: a bad flag is named even
        // when the model does not exist (issue 18's check() before run(config)).
        (
            vec!["prefill", "--model", "/nonexistent", "--insecure-internal", "--transfer-timeout", "inf"],
            "--transfer-timeout inf",
        ),
        (
            vec!["decode", "--model", "/nonexistent", "--insecure-internal", "--init-new-token-ratio", "2"],
            "--init-new-token-ratio 2",
        ),
        (
            vec!["router", "--model", "/nonexistent", "--insecure-internal", "--decode", "h:1", "--load-poll", "0"],
            "--load-poll 0",
        ),
        (vec!["prefill", "--model", "/nonexistent"], "--insecure-internal"),
        (vec!["prefill", "--model", "/nonexistent", "--insecure-internal", "--worker-id", ""], "worker id"),
    ];
    for (args, needle) in cases {
        let o = ferry(&args);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(e.contains(needle), "{args:?}: {e}");
        assert!(!e.contains("panicked"), "{args:?} panicked: {e}");
    }
}

/// `--device cuda:4096`, a GPU no machine has, fails at start and says why, for `generate` and
/// for a whole cluster alike, on any machine (without a GPU, the driver or CUDA libraries are
/// missing; in a build without CUDA, the feature; on a GPU machine, the device).
#[test]
fn cuda_on_a_gpu_that_is_not_there_fails_at_start_saying_why() {
    let dir = tempfile::tempdir().expect("tmp");
    write_hf(dir.path(), &TinySpec::default()).expect("tiny");
    let m = dir.path().to_str().expect("path");
    let o = ferry(&["generate", "--model", m, "--prompt-ids", "5,6,7", "--max-tokens", "2", "--device", "cuda:4096"]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("--device cuda") && !e.contains("panicked"), "{e}");
    let o = ferry(&[
        "up",
        "--model",
        m,
        "--device",
        "cuda:4096",
        "--http-addr",
        "127.0.0.1:0",
        "--grpc-addr",
        "127.0.0.1:0",
    ]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("--device cuda") && !e.contains("panicked"), "{e}");
}

#[test]
fn readme_command_prints_english_on_smollm2() {
    let path: PathBuf = match std::env::var("FERRY_SMOLLM2") {
        Ok(p) => p.into(),
        Err(_) => {
            let o = ferry(&["model", "fetch", "smollm2-135m"]);
            assert!(o.status.success(), "fetch: {}", stderr(&o));
            String::from_utf8(o.stdout).expect("utf-8").trim().into()
        }
    };
    let o = ferry(&[
        "generate",
        "--model",
        path.to_str().expect("path"),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "32",
        "--temperature",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).expect("utf-8");
    let words: Vec<&str> = text.split_whitespace().collect();
    let common = ["the", "a", "of", "and", "was", "in", "to", "with"];
    assert!(words.len() >= 20, "{text:?}");
    assert!(
        words
            .iter()
            .filter(|w| common.contains(&w.trim_matches(|c: char| !c.is_alphabetic()).to_lowercase().as_str()))
            .count()
            >= 3,
        "{text:?}"
    );
}

/// `ferry health` asks a daemon speaking mutual TLS what the kubelet's gRPC probe cannot:
/// SERVING exits 0; another role's certificate at the address, an unknown service, a stopped
/// daemon and missing certificates each exit 1 saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_asks_a_daemon_over_mutual_tls() {
    use ferry_tests::pki::{PeerRole, Pki};
    let m = ferry_tests::TinyModel::new();
    let pki = Pki::new("ferry health test CA");
    let names = ["localhost", "127.0.0.1"];
    let (pl, dl) =
        (pki.issue("prefill", Some(PeerRole::Prefill), &names), pki.issue("decode", Some(PeerRole::Decode), &names));
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 64;
    a.worker.internal_tls = pki.args(&pl);
    let p = ferry_prefill::start(a).await.expect("prefill up");
    let addr = p.grpc_addr.to_string();
    // The probe presents the pod's own certificate (here a decode worker's: any member may ask).
    let tls = |leaf: &ferry_tests::pki::Leaf| {
        let path = |p: &std::path::Path| p.to_str().expect("path").to_string();
        vec![
            format!("--internal-tls-cert={}", path(&leaf.cert)),
            format!("--internal-tls-key={}", path(&leaf.key)),
            format!("--internal-tls-ca={}", path(&pki.ca())),
        ]
    };
    let health = |extra: Vec<String>| {
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || {
            let mut args = vec!["health".to_string(), format!("--addr={addr}"), "--timeout=5".into()];
            args.extend(extra);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            ferry(&args)
        })
    };
    let with = |role: &str, more: &[&str]| {
        let mut v = tls(&dl);
        v.push(format!("--role={role}"));
        v.extend(more.iter().map(|s| s.to_string()));
        v
    };
    let o = health(with("prefill", &[])).await.expect("ran");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "SERVING");
    let o = health(with("prefill", &["--service=ferry.v1.Prefill"])).await.expect("ran");
    assert!(o.status.success(), "the Prefill service serves: {}", stderr(&o));
    let o = health(with("decode", &[])).await.expect("ran");
    assert!(!o.status.success(), "a prefill worker answered as a decode worker");
    assert!(stderr(&o).contains("is not a decode worker"), "{}", stderr(&o));
    let o = health(with("prefill", &["--service=ferry.v1.Nothing"])).await.expect("ran");
    assert!(!o.status.success() && stderr(&o).contains("NotFound"), "{}", stderr(&o));
    let o = health(vec!["--role=prefill".into()]).await.expect("ran");
    assert!(!o.status.success(), "no certificates and no --insecure-internal");
    p.stop().await;
    let o = health(with("prefill", &[])).await.expect("ran");
    assert!(!o.status.success(), "a stopped daemon is not healthy");
}
