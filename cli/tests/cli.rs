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

/// `--device cuda` runs where a GPU is, and elsewhere fails at start, saying why (no driver,
/// or a build without CUDA), for `generate` and for a whole cluster alike.
#[test]
fn cuda_runs_where_a_gpu_is_and_says_why_not_elsewhere() {
    let dir = tempfile::tempdir().expect("tmp");
    write_hf(dir.path(), &TinySpec::default()).expect("tiny");
    let m = dir.path().to_str().expect("path");
    let gpu = std::path::Path::new("/dev/nvidiactl").exists();
    let o = ferry(&["generate", "--model", m, "--prompt-ids", "5,6,7", "--max-tokens", "2", "--device", "cuda"]);
    let e = stderr(&o);
    assert!(!e.contains("panicked"), "{e}");
    if gpu {
        assert!(o.status.success(), "{e}");
        return;
    }
    assert!(!o.status.success() && e.contains("--device cuda"), "{e}");
    let o =
        ferry(&["up", "--model", m, "--device", "cuda", "--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0"]);
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
