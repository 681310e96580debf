//! `ferry up --processes` on loopback with the real SmolLM2 model: it prints its endpoints
//! and a ready line, answers a chat completion in the OpenAI JSON shape coherently, stops on
//! SIGINT with a clean exit, and leaves no daemon process behind; a frozen daemon's outage and
//! its end are both in its log. Its daemons talk mutual TLS by default: a caller on the
//! network without the cluster's certificate reads no cached
//! prompt and cannot bypass the router.

mod common;

use std::time::Duration;

use ferry_proto::v1 as pb;
use ferry_tests::http;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferry_up_processes_answers_and_leaves_nothing_behind() {
    let up = common::Up::start(&[]);
    let (http_addr, pids) = (up.http, up.pids.clone());
    assert_eq!(pids.len(), 3, "router, one prefill and one decode process");
    assert!(std::net::TcpStream::connect(up.grpc).is_ok(), "the router's gRPC address answers");

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

    // Issue 16's outsider probe: plaintext calls straight to the workers (a cached prompt's
    // tokens from KvEvents, a generation bypassing the router) get nothing. (With
    // --insecure-internal the KvEvents call returns the chat prompt's token ids.)
    let addr = |name: &str| up.grpc_of.iter().find(|(n, _)| n == name).map(|x| x.1).expect(name);
    let (prefill, decode) = (addr("prefill-0"), addr("decode-0"));
    let plain = |a: std::net::SocketAddr| {
        tonic::transport::Endpoint::from_shared(format!("http://{a}"))
            .expect("uri")
            .connect_timeout(Duration::from_secs(5))
    };
    let probe = async {
        let ch = plain(prefill).connect().await.map_err(|e| e.to_string())?;
        let req = pb::SubscribeRequest { want_snapshot: true, ..Default::default() };
        let mut s =
            pb::kv_events_client::KvEventsClient::new(ch).subscribe(req).await.map_err(|e| e.to_string())?.into_inner();
        s.message().await.map(|m| format!("{m:?}")).map_err(|e| e.to_string())
    };
    let r = tokio::time::timeout(Duration::from_secs(10), probe).await.expect("the probe ends");
    assert!(r.is_err(), "an unauthenticated KvEvents call was answered: {r:?}");
    let probe = async {
        let ch = plain(decode).connect().await.map_err(|e| e.to_string())?;
        let req = pb::DecodeRequest {
            token_ids: vec![1, 2, 3],
            room: Some(ferry_cluster::wire::room_key_to_proto(&ferry_cluster::RoomKey::random())),
            ..Default::default()
        };
        let mut s =
            pb::decode_client::DecodeClient::new(ch).generate(req).await.map_err(|e| e.to_string())?.into_inner();
        s.message().await.map(|m| format!("{m:?}")).map_err(|e| e.to_string())
    };
    let r = tokio::time::timeout(Duration::from_secs(10), probe).await.expect("the probe ends");
    assert!(r.is_err(), "a direct Decode.Generate bypassing the router was answered: {r:?}");

    // A frozen prefill daemon: its outage and its end are both in `ferry up`'s log (the
    // return used to be at a level `ferry up` did not show).
    let prefill_pid = up.pid_of.iter().find(|(n, _)| n == "prefill-0").map(|x| x.1).expect("prefill-0's pid");
    let signal = |sig| {
        // SAFETY: kill(2) on a daemon `ferry up` started and still runs.
        assert_eq!(unsafe { libc::kill(prefill_pid as libc::pid_t, sig) }, 0);
    };
    /// Thaws the daemon however the test ends (a stopped process ignores the SIGTERM its
    /// parent's death sends it, and would linger).
    struct Thaw(u32);
    impl Drop for Thaw {
        fn drop(&mut self) {
            // SAFETY: kill(2) on a daemon `ferry up` started.
            unsafe { libc::kill(self.0 as libc::pid_t, libc::SIGCONT) };
        }
    }
    let from = up.log.lock().expect("log").len();
    signal(libc::SIGSTOP);
    let thaw = Thaw(prefill_pid);
    let out = logged(&up, from, &["prefill-0", "taken out of placement"], 60);
    drop(thaw);
    assert!(out, "no outage logged for a frozen prefill daemon");
    assert!(logged(&up, from, &["prefill-0", "back in placement"], 60), "its return was not logged");

    // SIGINT, as Ctrl-C: a clean exit, and no daemon left.
    assert!(up.interrupt(), "`ferry up` exits cleanly");
    for pid in pids {
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "daemon process {pid} is still there");
    }
}

/// Waits up to `secs` seconds for a line of `up`'s log past the first `from` holding every
/// one of `words`.
fn logged(up: &common::Up, from: usize, words: &[&str], secs: u64) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if up.log.lock().expect("log").iter().skip(from).any(|l| words.iter().all(|w| l.contains(w))) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}
