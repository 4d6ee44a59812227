//! The snapshot admin API against the real `snapserve serve` binary and real SmolLM2 on the
//! CPU: prefixes kept from the start-up file and through `POST /v1/snapshots` survive a flood
//! of other prompts that evicts everything else, later chats restore them, a prefix larger than
//! the budget is refused, `DELETE` drops one, and the routes need the admin key (and do not
//! exist without one).

mod common;

use common::*;
use serde_json::{Value, json};

const ADMIN: &str = "admin-key-for-tests";

fn system_text(topic: &str) -> String {
    format!(
        "You are the guide of a museum of {topic}. {}",
        "Answer visitors briefly and kindly, and point them to the right room. ".repeat(6)
    )
}

fn ids(list: &Value) -> Vec<String> {
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn kept_prefixes_outlive_evictions_and_the_admin_routes_need_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let pins = dir.path().join("pins.jsonl");
    let pinned_at_start =
        json!({"messages": [{"role": "system", "content": system_text("clocks")}]});
    std::fs::write(&pins, format!("{pinned_at_start}\n")).unwrap();
    // Room for the two kept prefixes (96 tokens, 4.4 MB each) and about two more.
    let config = format!(
        "[cache]\npool_tokens = 16384\n[server]\nadmin_api_key = \"{ADMIN}\"\n\
         [snapshots]\ndevice_budget_bytes = 18000000\nsave_after_sightings = 1\n\
         pin_prompts_file = \"{}\"\n",
        pins.display()
    );
    let server = Server::start(&smollm2(), &config);

    // The key: none, or an API key's, is a 401.
    let (status, answer) = server.call("GET", "/v1/snapshots", None, None);
    assert_eq!(status, 401, "{answer}");
    let (status, _) = server.call("GET", "/v1/snapshots", Some("not-the-admin-key"), None);
    assert_eq!(status, 401);

    let (status, list) = server.call("GET", "/v1/snapshots", Some(ADMIN), None);
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["object"], "list");
    let from_file = list["data"][0].clone();
    assert_eq!(from_file["pinned"], true, "{list}");

    let keep = json!({"messages": [{"role": "system", "content": system_text("ships")}]});
    let (status, kept) = server.call("POST", "/v1/snapshots", Some(ADMIN), Some(&keep));
    assert_eq!(status, 200, "{kept}");
    assert_eq!(kept["object"], "snapshot");
    assert_eq!(kept["pinned"], true);
    assert_eq!(kept["tier"], "device");
    assert_eq!(kept["state"], "ready");
    let tokens = kept["tokens"].as_u64().unwrap();
    assert!(tokens >= 64 && tokens % 16 == 0, "{kept}");

    // Other prompts, saved as they come, fill the rest of the budget again and again.
    for i in 0..12 {
        let prompt = format!("Item {i}: {}", "a list of things to remember. ".repeat(12));
        let (status, _, answer) = server.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        );
        assert_eq!(status, 200, "{answer}");
    }
    let (_, after) = server.call("GET", "/v1/snapshots", Some(ADMIN), None);
    let after_ids = ids(&after);
    for id in [&from_file["id"], &kept["id"]] {
        assert!(
            after_ids.contains(&id.as_str().unwrap().to_string()),
            "{id} evicted: {after}"
        );
    }
    let kept_bytes = from_file["bytes"].as_f64().unwrap() + kept["bytes"].as_f64().unwrap();
    assert_eq!(
        server.metric("snapserve_snapshot_kept_bytes{tier=\"device\"}"),
        kept_bytes
    );
    let stats = server.metric("snapserve_snapshot_evictions_total");
    assert!(
        stats > 0.0,
        "the flood evicted nothing, so it proved nothing"
    );

    // A chat over the kept system prompt restores it.
    let mut messages = keep["messages"].as_array().unwrap().clone();
    messages.push(json!({"role": "user", "content": "Where are the steam engines?"}));
    let (status, _, answer) = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{answer}");
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= tokens,
        "{cached} cached of a kept {tokens}: {answer}"
    );
    let path = format!("/v1/snapshots/{}", kept["id"].as_str().unwrap());
    let (status, shown) = server.call("GET", &path, Some(ADMIN), None);
    assert_eq!(status, 200);
    assert!(shown["hits"].as_u64().unwrap() >= 1, "{shown}");

    // A prefix larger than the whole budget is refused, saying why.
    let huge = json!({"prompt": "Long text that will not fit. ".repeat(60)});
    let (status, answer) = server.call("POST", "/v1/snapshots", Some(ADMIN), Some(&huge));
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("budget"),
        "{answer}"
    );
    let (status, answer) = server.call(
        "POST",
        "/v1/snapshots",
        Some(ADMIN),
        Some(&json!({"prompt": "too short"})),
    );
    assert_eq!(status, 400, "{answer}");

    // Dropped, it is gone.
    let (status, answer) = server.call("DELETE", &path, Some(ADMIN), None);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["deleted"], true);
    let (status, _) = server.call("GET", &path, Some(ADMIN), None);
    assert_eq!(status, 404);
    let (status, _) = server.call("DELETE", &path, Some(ADMIN), None);
    assert_eq!(status, 404);
    assert!(server.is_idle());
}

#[test]
fn without_an_admin_key_the_admin_routes_do_not_exist() {
    let server = Server::start(&smollm2(), "[cache]\npool_tokens = 4096\n");
    let (status, answer) = server.call("GET", "/v1/snapshots", None, None);
    assert_eq!(status, 404, "{answer}");
    let body = json!({"prompt": "Hello there, this is a prefix to keep for later use."});
    let (status, _) = server.call("POST", "/v1/snapshots", Some(ADMIN), Some(&body));
    assert_eq!(status, 404);
}
