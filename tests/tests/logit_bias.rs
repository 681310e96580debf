//! `logit_bias` through the router and a prefill / decode pair (the prefill node samples the
//! first token, the decode node the rest; both must apply it): banned tokens never come,
//! a forced one always does, the tokens are a colocated engine's; over HTTP the field is read
//! as OpenAI writes it and bad values get a 400 naming it.

use ferry_engine::SamplingParams;
use ferry_tests::{TinyModel, colocated, greedy, http, one_of_each, routed, settle};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_bans_and_forces_tokens_through_prefill_and_decode() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 512, |_| ()).await;
    let prompt: Vec<u32> = (5..45).collect();
    let plain = greedy(6);
    let (free, _) = routed(r.grpc_addr, &prompt, &plain).await;

    let mut banned_ids = free.clone();
    banned_ids.sort_unstable();
    banned_ids.dedup();
    let banned = SamplingParams { logit_bias: banned_ids.iter().map(|&t| (t, -100.0)).collect(), ..plain.clone() };
    let (other, _) = routed(r.grpc_addr, &prompt, &banned).await;
    assert_eq!(other.len(), 6);
    assert!(other.iter().all(|t| !free.contains(t)), "banned {free:?}, got {other:?}");
    assert_eq!(other, colocated(&m.path(), std::slice::from_ref(&prompt), &banned)[0], "as one engine would");

    let forced = SamplingParams { logit_bias: vec![(7, 100.0)], ..plain.clone() };
    assert_eq!(routed(r.grpc_addr, &prompt, &forced).await.0, vec![7; 6]);

    // Over HTTP, as OpenAI writes it: token ids as the keys of an object.
    let a = r.http_addr;
    let (_, _, models) = http(a, "GET", "/v1/models", b"").await;
    let model = serde_json::from_str::<serde_json::Value>(&models).expect("JSON")["data"][0]["id"].clone();
    let req = |bias: serde_json::Value| serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logit_bias": bias});
    let (s, _, body) =
        http(a, "POST", "/v1/completions", req(serde_json::json!({"7": 100})).to_string().as_bytes()).await;
    assert_eq!(s, 200, "{body}");
    let text = serde_json::from_str::<serde_json::Value>(&body).expect("JSON")["choices"][0]["text"].clone();
    // The text of six 7s: the prompt [7; 6] echoed back with nothing generated.
    let echo = serde_json::json!({"model": model, "prompt": [7, 7, 7, 7, 7, 7], "max_tokens": 0, "echo": true});
    let (s, _, sevens) = http(a, "POST", "/v1/completions", echo.to_string().as_bytes()).await;
    assert_eq!(s, 200, "{sevens}");
    assert_eq!(text, serde_json::from_str::<serde_json::Value>(&sevens).expect("JSON")["choices"][0]["text"]);

    for (bias, code, names) in [
        (serde_json::json!({"seven": 1}), "bad_logit_bias", "`logit_bias` key \"seven\""),
        (serde_json::json!({"7": 1, "07": -1}), "bad_logit_bias", "names token 7 twice"),
        (serde_json::json!({"7": 101}), "bad_sampling", "logit_bias"),
        (serde_json::json!({"100000": 1}), "bad_sampling", "logit_bias"),
        (serde_json::json!({"7": "up"}), "bad_json", "logit_bias"),
    ] {
        let (s, _, body) = http(a, "POST", "/v1/completions", req(bias.clone()).to_string().as_bytes()).await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!((s, v["error"]["code"].as_str()), (400, Some(code)), "{bias}: {body}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(names)), "{bias}: {body}");
    }
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}
