//! `ferry up --processes` on loopback with the real SmolLM2 model: it prints its endpoints
//! and a ready line, answers a chat completion in the OpenAI JSON shape coherently, stops on
//! SIGINT with a clean exit, and leaves no daemon process behind.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use ferry_tests::{http, smollm2};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferry_up_processes_answers_and_leaves_nothing_behind() {
    let mut up = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["up", "--processes", "--pool-pages", "256", "--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0"])
        .arg("--model")
        .arg(smollm2())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start `ferry up`");
    let out = BufReader::new(up.stdout.take().expect("stdout"));
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in out.lines().map_while(Result::ok) {
            println!("{l}");
            let _ = tx.send(l);
        }
    });
    let mut pids = Vec::new();
    let http_addr = loop {
        let line = rx.recv_timeout(Duration::from_secs(300)).expect("`ferry up` prints a ready line");
        if let Some((_, pid)) = line.rsplit_once("pid ") {
            pids.push(pid.trim().parse::<u32>().expect("a pid"));
        }
        if line.starts_with("ferry up: ready") {
            let at = line.split("http://").nth(1).and_then(|r| r.split("/v1").next()).expect("the HTTP address");
            break at.parse::<std::net::SocketAddr>().expect("an address");
        }
    };
    assert_eq!(pids.len(), 3, "router, one prefill and one decode process");

    let (s, _, body) = http(http_addr, "GET", "/v1/models", b"").await;
    assert_eq!(s, 200, "{body}");
    let model = serde_json::from_str::<serde_json::Value>(&body).expect("json")["data"][0]["id"].clone();
    let req = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24,
        "temperature": 0,
    });
    let (s, _, body) = http(http_addr, "POST", "/v1/chat/completions", req.to_string().as_bytes()).await;
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let answer = v["choices"][0]["message"]["content"].as_str().expect("content");
    assert!(answer.contains("Paris"), "not a coherent answer: {answer:?}");
    assert!(v["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0));

    // SIGINT, as Ctrl-C: a clean exit, and no daemon left.
    // SAFETY: kill(2) on the child we spawned.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGINT);
    }
    let status = up.wait().expect("wait for `ferry up`");
    assert!(status.success(), "`ferry up` exited with {status}");
    for pid in pids {
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "daemon process {pid} is still there");
    }
}
