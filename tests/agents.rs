//! The API features agents and applications rely on, end to end: the real `snapserve serve`
//! binary with the real SmolLM2 on the CPU, spoken to over HTTP. Log-probabilities (whole and
//! streamed, chat and completions) and structured outputs (`response_format` json_object and
//! json_schema, vLLM's `guided_regex`), with output validated by an independent JSON Schema
//! validator, and the 400s of requests that get them wrong.

mod common;

use common::*;
use serde_json::{Value, json};

const CONFIG: &str = "[cache]\npool_tokens = 16384\n[admission]\nmax_running = 8\n";

fn chunks(events: &[String]) -> Vec<Value> {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

/// `body` posted to `path` is a 400 naming `param` (null: none); the answer, for more checks.
fn assert_refused(server: &Server, path: &str, body: &Value, param: impl Into<Value>) -> Value {
    let (status, _, answer) = server.post(path, body);
    assert_eq!(status, 400, "{path} {body} -> {answer}");
    assert_eq!(answer["error"]["param"], param.into(), "{answer}");
    answer
}

/// Each chat request (`messages` plus the fields of `extra`) is a 400 naming `param`.
fn assert_chat_refused(server: &Server, messages: &Value, cases: &[(Value, &str)]) {
    for (extra, param) in cases {
        let mut body = json!({"messages": messages, "max_tokens": 4});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        assert_refused(server, "/v1/chat/completions", &body, *param);
    }
}

fn assert_probability(logprob: &Value) -> f64 {
    let lp = logprob
        .as_f64()
        .unwrap_or_else(|| panic!("{logprob} is no number"));
    assert!(lp <= 0.0 && lp.is_finite(), "{lp} is no log-probability");
    lp
}

#[test]
fn logprobs_whole_and_streamed_in_openai_shapes() {
    let server = Server::start(&smollm2(), CONFIG);
    let messages = json!([{"role": "user", "content": "Name a colour."}]);
    let request = json!({
        "messages": messages, "max_tokens": 8, "temperature": 0,
        "logprobs": true, "top_logprobs": 3,
    });
    let (status, _, body) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    let content = choice["logprobs"]["content"]
        .as_array()
        .expect("a content list");
    assert_eq!(
        content.len(),
        body["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    let mut text = String::new();
    for entry in content {
        let lp = assert_probability(&entry["logprob"]);
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        // Greedy: the chosen token is the likeliest, and the list is ordered.
        assert_eq!(top[0]["token"], entry["token"], "{entry}");
        assert!((assert_probability(&top[0]["logprob"]) - lp).abs() < 1e-6);
        let lps: Vec<f64> = top
            .iter()
            .map(|t| assert_probability(&t["logprob"]))
            .collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{lps:?}");
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            entry["token"].as_str().unwrap()
        );
        text += entry["token"].as_str().unwrap();
    }
    assert_eq!(text, choice["message"]["content"].as_str().unwrap());

    // Streamed: the same entries, spread over the chunks.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let streamed_entries: Vec<Value> =
        chunks(&server.post_stream("/v1/chat/completions", &streamed))
            .iter()
            .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
            .flatten()
            .collect();
    assert_eq!(&streamed_entries, content);

    // Completions: the legacy parallel lists.
    let request = json!({
        "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2,
    });
    let (status, _, body) = server.post("/v1/completions", &request);
    assert_eq!(status, 200, "{body}");
    let logprobs = &body["choices"][0]["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 6);
    assert_eq!(logprobs["token_logprobs"].as_array().unwrap().len(), 6);
    let offsets: Vec<u64> = logprobs["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    for (token, top) in tokens
        .iter()
        .zip(logprobs["top_logprobs"].as_array().unwrap())
    {
        let top = top.as_object().unwrap();
        assert!(
            top.len() <= 2 && top.contains_key(token.as_str().unwrap()),
            "{top:?}"
        );
    }
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, body["choices"][0]["text"].as_str().unwrap());

    // Without logprobs, `logprobs` stays null.
    let (_, _, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0}),
    );
    assert!(body["choices"][0]["logprobs"].is_null(), "{body}");

    let refused = [
        (
            json!({"messages": messages, "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            json!({"messages": messages, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"prompt": "Hi", "logprobs": 21}), "logprobs"),
        (
            json!({"prompt": "Hi", "logprobs": 1, "echo": true, "n": 2}),
            "echo",
        ),
    ];
    for (body, param) in refused {
        let path = if body.get("prompt").is_some() {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        assert_refused(&server, path, &body, param);
    }
    assert!(server.is_idle());
}

#[test]
fn structured_outputs_parse_and_validate_whole_and_streamed() {
    let server = Server::start(&smollm2(), CONFIG);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3}
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&schema).unwrap();
    let messages = json!([{"role": "user", "content": "Describe a person with pets."}]);
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}});
    for temperature in [0.0, 0.8] {
        let request = json!({
            "messages": messages, "max_tokens": 120, "temperature": temperature, "seed": 7,
            "response_format": format,
        });
        let (status, _, body) = server.post("/v1/chat/completions", &request);
        assert_eq!(status, 200, "{body}");
        let content = body["choices"][0]["message"]["content"].as_str().unwrap();
        let value: Value = serde_json::from_str(content)
            .unwrap_or_else(|e| panic!("{content:?} is not JSON: {e}"));
        assert!(validator.is_valid(&value), "{value} fails the schema");
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");

        let mut streamed = request.clone();
        streamed["stream"] = json!(true);
        let text: String = chunks(&server.post_stream("/v1/chat/completions", &streamed))
            .iter()
            .filter_map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(text, content, "seeded stream and whole answer differ");
    }

    // Several choices: each holds its own copy of the grammar, so every one validates.
    let request = json!({
        "messages": messages, "max_tokens": 120, "temperature": 1.0, "seed": 3, "n": 3,
        "response_format": format,
    });
    let (status, _, body) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{body}");
    let contents: Vec<&str> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents.len(), 3);
    for content in &contents {
        let value: Value = serde_json::from_str(content)
            .unwrap_or_else(|e| panic!("{content:?} is not JSON: {e}"));
        assert!(validator.is_valid(&value), "{value} fails the schema");
    }

    // Any JSON object.
    let request = json!({
        "messages": [{"role": "user", "content": "Give the name and the age of a cat, in JSON."}],
        "max_tokens": 120, "temperature": 0, "response_format": {"type": "json_object"},
    });
    let (_, _, body) = server.post("/v1/chat/completions", &request);
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let value: Value = serde_json::from_str(content).unwrap();
    assert!(value.is_object(), "{value}");

    // A regular expression on completions (vLLM's extension).
    let request = json!({
        "prompt": "Today's date is", "max_tokens": 20, "temperature": 0,
        "guided_regex": " [0-9]{4}-[0-9]{2}-[0-9]{2}",
    });
    let (status, _, body) = server.post("/v1/completions", &request);
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().unwrap();
    let date = text.strip_prefix(' ').expect("a leading space");
    assert_eq!(date.len(), 10, "{text:?}");
    assert!(
        date.chars().enumerate().all(|(i, c)| if i == 4 || i == 7 {
            c == '-'
        } else {
            c.is_ascii_digit()
        }),
        "{text:?}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");

    let refused = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "guided_regex": "a+"}),
            "guided_regex",
        ),
        (json!({"guided_regex": "(unclosed"}), "guided_regex"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"strict": true, "schema": {"type": "array", "uniqueItems": true}}}}),
            "response_format",
        ),
    ];
    assert_chat_refused(&server, &messages, &refused);
    assert!(server.is_idle());
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city", "unit"],
                "additionalProperties": false
            }
        }},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "The current time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 30}},
                "required": ["zone"],
                "additionalProperties": false
            }
        }}
    ])
}

/// The call's arguments, parsed and checked against the tool's schema.
fn checked_call(tools: &Value, call: &Value) -> (String, Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")),
        "{call}"
    );
    let name = call["function"]["name"].as_str().unwrap().to_string();
    let arguments: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{call}: arguments are not JSON: {e}"));
    let tool = tools
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == name.as_str())
        .unwrap_or_else(|| panic!("{name} is not an offered tool"));
    let validator = jsonschema::validator_for(&tool["function"]["parameters"]).unwrap();
    assert!(
        validator.is_valid(&arguments),
        "{arguments} fails {name}'s schema"
    );
    (name, arguments)
}

#[test]
fn tool_calls_forced_named_streamed_and_answered() {
    let server = Server::start(&smollm2(), CONFIG);
    let tools = weather_tools();
    let messages = json!([{"role": "user", "content": "What is the weather like in Paris?"}]);
    let request = json!({
        "messages": messages, "tools": tools, "tool_choice": "required",
        "max_tokens": 80, "temperature": 0,
    });
    let (status, _, body) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    assert!(choice["message"]["content"].is_null(), "{body}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{body}");
    let (name, arguments) = checked_call(&tools, &calls[0]);

    // Streamed: the deltas assemble (by index, as the SDKs do) into the same call.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let chunks = chunks(&server.post_stream("/v1/chat/completions", &streamed));
    let mut assembled: Vec<Value> = Vec::new();
    for chunk in &chunks {
        for delta in chunk["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let index = delta["index"].as_u64().unwrap() as usize;
            if assembled.len() <= index {
                assembled.push(json!({"id": delta["id"], "type": delta["type"],
                    "function": {"name": "", "arguments": ""}}));
            }
            let function = &mut assembled[index]["function"];
            if let Some(n) = delta["function"]["name"].as_str() {
                function["name"] = json!(format!("{}{n}", function["name"].as_str().unwrap()));
            }
            if let Some(a) = delta["function"]["arguments"].as_str() {
                function["arguments"] =
                    json!(format!("{}{a}", function["arguments"].as_str().unwrap()));
            }
        }
    }
    assert_eq!(assembled.len(), 1, "{chunks:?}");
    assert_eq!(
        checked_call(&tools, &assembled[0]),
        (name.clone(), arguments.clone())
    );
    let finish = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .next_back();
    assert_eq!(finish, Some("tool_calls"));
    let leaked: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(
        !leaked.contains("<tool_call>"),
        "the call leaked as content: {leaked:?}"
    );

    // A named function is the one called.
    let mut named = request.clone();
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    let (_, _, body) = server.post("/v1/chat/completions", &named);
    let calls = body["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(checked_call(&tools, &calls[0]).0, "get_time");

    // The call and its result go back in, and the model answers in text.
    let follow_up = json!({
        "messages": [
            messages[0],
            {"role": "assistant", "content": null, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": name, "arguments": arguments.to_string()}
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"}
        ],
        "tools": tools, "tool_choice": "none", "max_tokens": 30, "temperature": 0,
    });
    let (status, _, body) = server.post("/v1/chat/completions", &follow_up);
    assert_eq!(status, 200, "{body}");
    assert!(
        body["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty()),
        "{body}"
    );
    assert!(
        body["choices"][0]["message"]["tool_calls"].is_null(),
        "{body}"
    );

    // With "auto" the model may answer or call; either way the answer is well formed.
    let mut auto = request.clone();
    auto["tool_choice"] = json!("auto");
    let (status, _, body) = server.post("/v1/chat/completions", &auto);
    assert_eq!(status, 200, "{body}");
    match body["choices"][0]["finish_reason"].as_str() {
        Some("tool_calls") => {
            for call in body["choices"][0]["message"]["tool_calls"]
                .as_array()
                .unwrap()
            {
                checked_call(&tools, call);
            }
        }
        _ => assert!(
            body["choices"][0]["message"]["content"].is_string(),
            "{body}"
        ),
    }

    let refused = [
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ];
    assert_chat_refused(&server, &messages, &refused);
    let bad_history = json!({"messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "get_time", "arguments": "{not json"}}]}
    ]});
    let (status, _, answer) = server.post("/v1/chat/completions", &bad_history);
    assert_eq!(status, 400, "{answer}");
    assert_eq!(
        answer["error"]["param"],
        "messages[0].tool_calls[0].function.arguments"
    );
    assert!(server.is_idle());
}

/// `n` choices of one prompt: the prompt is computed once (the others copy its KV, counted by
/// `snapserve_prefix_forked_tokens_total`), choice `i` is what a lone request seeded `seed + i`
/// answers, usage counts the prompt once and sums the completions, and streamed chunks carry
/// each choice's `index`.
#[test]
fn n_choices_share_the_prompt_whole_and_streamed() {
    let server = Server::start(&smollm2(), CONFIG);
    let messages = json!([
        {"role": "system", "content": "You are a poet who answers in one short line."},
        {"role": "user", "content": "Write a line about the sea at night."},
    ]);
    let ask = |n: usize, seed: u64| {
        json!({
            "messages": messages, "n": n, "seed": seed, "temperature": 1.0,
            "max_tokens": 10, "ignore_eos": true,
        })
    };
    let forked_before = server.metric("snapserve_prefix_forked_tokens_total");
    let (status, _, body) = server.post("/v1/chat/completions", &ask(3, 40));
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().unwrap();
    let indices: Vec<u64> = choices
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1, 2]);
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 30, "{body}");
    assert_eq!(body["usage"]["total_tokens"], prompt_tokens + 30);
    let forked = server.metric("snapserve_prefix_forked_tokens_total") - forked_before;
    assert_eq!(
        forked,
        2.0 * (prompt_tokens - 1) as f64,
        "two choices copied the prompt"
    );
    let texts: Vec<&str> = choices
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    for (i, text) in texts.iter().enumerate() {
        let (_, _, lone) = server.post("/v1/chat/completions", &ask(1, 40 + i as u64));
        assert_eq!(lone["usage"]["prompt_tokens"], prompt_tokens);
        assert_eq!(
            lone["choices"][0]["message"]["content"],
            *text,
            "choice {i} against a lone request seeded {}",
            40 + i
        );
    }

    // Streamed: each choice's chunks under its index, one finish each, then one usage.
    let mut streamed = ask(2, 40);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = chunks(&server.post_stream("/v1/chat/completions", &streamed));
    let mut text = [String::new(), String::new()];
    let mut finishes = [0, 0];
    for chunk in &chunks[..chunks.len() - 1] {
        assert!(
            chunk["id"] == chunks[0]["id"],
            "one id for the whole response"
        );
        let choice = &chunk["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        text[i] += choice["delta"]["content"].as_str().unwrap_or("");
        finishes[i] += choice["finish_reason"].is_string() as usize;
    }
    assert_eq!(finishes, [1, 1]);
    assert_eq!(text[0], texts[0]);
    assert_eq!(text[1], texts[1]);
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(usage["completion_tokens"], 20, "{usage}");

    // Completions too, and the limits.
    let (status, _, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "n": 2, "max_tokens": 3, "seed": 1}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    assert_eq!(body["choices"][1]["index"], 1);
    assert_chat_refused(
        &server,
        &messages,
        &[(json!({"n": 0}), "n"), (json!({"n": 65}), "n")],
    );
    assert!(server.is_idle());
}

/// `best_of`: the candidates are the choices a lone request seeded `seed + i` draws, and the
/// answer is the one with the highest log-probability per token; every candidate's tokens are
/// counted.
#[test]
fn best_of_answers_the_likeliest_candidate() {
    let server = Server::start(&smollm2(), CONFIG);
    let ask = |seed: u64| {
        json!({
            "prompt": "The old lighthouse keeper said", "seed": seed, "temperature": 1.2,
            "max_tokens": 8, "ignore_eos": true,
        })
    };
    let mut lone = Vec::new();
    for i in 0..3 {
        let mut body = ask(80 + i);
        body["logprobs"] = json!(0);
        let (status, _, answer) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{answer}");
        let choice = &answer["choices"][0];
        let lps: Vec<f64> = choice["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_f64().unwrap())
            .collect();
        let mean = lps.iter().sum::<f64>() / lps.len() as f64;
        lone.push((mean, choice["text"].as_str().unwrap().to_string()));
    }
    let best = lone
        .iter()
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap()
        .1
        .clone();
    // Seed 80's third candidate is the likeliest: not simply the first.
    let mut body = ask(80);
    body["best_of"] = json!(3);
    let (status, _, answer) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{answer}");
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1);
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[0]["text"], best.as_str(), "{lone:?}");
    assert_ne!(
        best, lone[0].1,
        "the test needs a best candidate other than the first"
    );
    assert!(choices[0]["logprobs"].is_null(), "not asked for");
    assert_eq!(answer["usage"]["completion_tokens"], 24);

    for (extra, param) in [
        (json!({"best_of": 1, "n": 2}), "best_of"),
        (json!({"best_of": 3, "stream": true}), "best_of"),
        (json!({"best_of": 65}), "best_of"),
    ] {
        let mut body = ask(1);
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        assert_refused(&server, "/v1/completions", &body, param);
    }
    assert!(server.is_idle());
}

/// A completion's list of prompts (texts, or lists of token ids) is one request: each prompt's
/// `n` choices in turn, numbered across the prompts, each what a lone request for that prompt
/// seeded `seed + i` answers; the usage counts each prompt once and every completion. Streamed
/// the same; `echo` and `best_of` work per prompt; a bad prompt refuses the whole request,
/// named by its place in the list, and nothing is left running.
#[test]
fn a_list_of_prompts_is_answered_prompt_by_prompt() {
    let server = Server::start(&smollm2(), CONFIG);
    let prompts = [
        "The old lighthouse keeper said",
        "In the garden behind the house",
        "Once upon a time",
    ];
    let ask = |prompt: Value, n: usize, seed: u64| {
        json!({
            "prompt": prompt, "n": n, "seed": seed, "temperature": 1.0, "max_tokens": 6,
            "ignore_eos": true,
        })
    };
    let (status, _, body) = server.post("/v1/completions", &ask(json!(prompts), 2, 7));
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6, "{body}");
    let mut prompt_tokens = 0;
    let mut lone_texts = Vec::new();
    for (p, prompt) in prompts.iter().enumerate() {
        for j in 0..2 {
            let (_, _, lone) = server.post("/v1/completions", &ask(json!(prompt), 1, 7 + j));
            let at = 2 * p + j as usize;
            assert_eq!(choices[at]["index"], at);
            assert_eq!(
                choices[at]["text"],
                lone["choices"][0]["text"],
                "prompt {p}, choice {j} against a lone request seeded {}",
                7 + j
            );
            lone_texts.push(lone["choices"][0]["text"].as_str().unwrap().to_string());
            if j == 0 {
                prompt_tokens += lone["usage"]["prompt_tokens"].as_u64().unwrap();
            }
        }
    }
    assert_eq!(body["usage"]["prompt_tokens"], prompt_tokens, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 36);
    assert_eq!(body["usage"]["total_tokens"], prompt_tokens + 36);

    // Streamed: every choice under its own index, one finish each, then one usage.
    let mut streamed = ask(json!(prompts), 2, 7);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = chunks(&server.post_stream("/v1/completions", &streamed));
    let mut texts = vec![String::new(); 6];
    let mut finishes = [0; 6];
    for chunk in &chunks[..chunks.len() - 1] {
        assert!(
            chunk["id"] == chunks[0]["id"],
            "one id for the whole response"
        );
        let choice = &chunk["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        texts[i] += choice["text"].as_str().unwrap_or("");
        finishes[i] += choice["finish_reason"].is_string() as usize;
    }
    assert_eq!(finishes, [1; 6]);
    assert_eq!(texts, lone_texts);
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens, "{usage}");
    assert_eq!(usage["completion_tokens"], 36, "{usage}");

    // Lists of token ids, greedy, each as its lone request answers it.
    let ids = [vec![504, 3218, 314, 1345], vec![12, 13, 14]];
    let greedy = |prompt: Value| json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
    let (status, _, body) = server.post("/v1/completions", &greedy(json!(ids)));
    assert_eq!(status, 200, "{body}");
    for (p, prompt) in ids.iter().enumerate() {
        let (_, _, lone) = server.post("/v1/completions", &greedy(json!(prompt)));
        assert_eq!(
            body["choices"][p]["text"], lone["choices"][0]["text"],
            "{p}"
        );
    }
    assert_eq!(body["usage"]["prompt_tokens"], 7);

    // `echo`: each choice opens with its own prompt.
    let (status, _, body) = server.post(
        "/v1/completions",
        &json!({"prompt": prompts, "echo": true, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    for (p, prompt) in prompts.iter().enumerate() {
        let text = body["choices"][p]["text"].as_str().unwrap();
        assert!(
            text.starts_with(prompt),
            "{text:?} does not echo {prompt:?}"
        );
    }

    // `best_of`: the best of each prompt's candidates, one answer a prompt.
    let mut best = ask(json!(prompts[..2]), 1, 7);
    best["best_of"] = json!(2);
    let (status, _, body) = server.post("/v1/completions", &best);
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{body}");
    for (p, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], p);
        let text = choice["text"].as_str().unwrap();
        assert!(
            lone_texts[2 * p..2 * p + 2].iter().any(|t| t == text),
            "prompt {p}'s answer {text:?} is none of its candidates {:?}",
            &lone_texts[2 * p..2 * p + 2]
        );
    }
    assert_eq!(body["usage"]["completion_tokens"], 24);

    // One bad prompt refuses them all, named by its place.
    let too_many: Vec<&str> = vec!["a"; 1025];
    for (body, param, says) in [
        (
            json!({"prompt": ["fine", ""]}),
            "prompt",
            "prompt 1 is empty",
        ),
        (
            json!({"prompt": [[1, 2], []]}),
            "prompt",
            "prompt 1 is empty",
        ),
        (
            json!({"prompt": ["fine", "also fine"], "max_tokens": 100_000}),
            "max_tokens",
            "prompt 0: the prompt",
        ),
        (
            json!({"prompt": too_many}),
            "prompt",
            "at most 1024 prompts",
        ),
        (
            json!({"prompt": [[1, 2], "x"]}),
            "prompt[1]",
            "expected a sequence",
        ),
    ] {
        let answer = assert_refused(&server, "/v1/completions", &body, param);
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message:?} does not say {says:?}");
    }
    let (status, _, answer) = server.post(
        "/v1/completions",
        &json!({"prompt": [[1, 2], [99_999_999]]}),
    );
    assert_eq!(status, 400, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("prompt 1: token id 99999999"), "{message}");
    assert!(server.is_idle());
}

/// `/tokenize` counts what a request computes: a prompt's tokens are a completion's
/// `prompt_tokens`, a chat's (with the tools it offers) a chat completion's; `/detokenize`
/// gives the text back; a request that names neither, both, or a token outside the
/// vocabulary is a 400 that says so.
#[test]
fn tokenize_counts_what_a_request_computes() {
    let server = Server::start(&smollm2(), CONFIG);
    let prompt = "The capital of France is";
    let (status, _, tokenized) = server.post(
        "/tokenize",
        &json!({"prompt": prompt, "return_token_strs": true}),
    );
    assert_eq!(status, 200, "{tokenized}");
    let (_, _, completion) = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    );
    assert_eq!(tokenized["count"], completion["usage"]["prompt_tokens"]);
    let tokens = tokenized["tokens"].as_array().unwrap();
    assert_eq!(tokens.len() as u64, tokenized["count"].as_u64().unwrap());
    assert_eq!(
        tokenized["token_strs"].as_array().unwrap().len(),
        tokens.len()
    );
    assert!(tokenized["max_model_len"].as_u64().unwrap() > 0);
    let (status, _, text) = server.post("/detokenize", &json!({"tokens": tokens}));
    assert_eq!(status, 200, "{text}");
    assert_eq!(text["prompt"], prompt);

    let messages = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }}]);
    for chat in [
        json!({"messages": messages}),
        json!({"messages": messages, "tools": tools}),
    ] {
        let (status, _, tokenized) = server.post("/tokenize", &chat);
        assert_eq!(status, 200, "{tokenized}");
        let mut ask = chat.clone();
        ask["max_tokens"] = json!(1);
        let (_, _, reply) = server.post("/v1/chat/completions", &ask);
        assert_eq!(
            tokenized["count"], reply["usage"]["prompt_tokens"],
            "{chat} -> {reply}"
        );
    }

    for (path, body, param) in [
        ("/tokenize", json!({}), Value::Null),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": messages}),
            Value::Null,
        ),
        (
            "/tokenize",
            json!({"prompt": [1, 99_999_999]}),
            json!("prompt"),
        ),
        ("/tokenize", json!({"prompt": ["a", "b"]}), json!("prompt")),
        (
            "/detokenize",
            json!({"tokens": [99_999_999]}),
            json!("tokens"),
        ),
        ("/detokenize", json!({"tokens": "abc"}), json!("tokens")),
    ] {
        assert_refused(&server, path, &body, param);
    }
    assert!(server.is_idle());
}

/// vLLM's `continue_final_message`: the reply continues the assistant's final message (a reply
/// the caller prefilled), its prompt the template's rendering of the messages cut right after
/// that message's text, which `/tokenize` shows and a completion of those tokens answers the
/// same; `add_generation_prompt: false` renders the turn closed without opening another.
#[test]
fn a_prefilled_reply_is_continued() {
    let server = Server::start(&smollm2(), CONFIG);
    let messages = json!([
        {"role": "user", "content": "List three fruits as JSON."},
        {"role": "assistant", "content": "{\"fruits\": [\""},
    ]);
    let (status, _, continued) = server.post(
        "/tokenize",
        &json!({"messages": messages, "continue_final_message": true}),
    );
    assert_eq!(status, 200, "{continued}");
    let (_, _, closed) = server.post(
        "/tokenize",
        &json!({"messages": messages, "add_generation_prompt": false}),
    );
    let continued = continued["tokens"].as_array().unwrap();
    let closed = closed["tokens"].as_array().unwrap();
    assert!(
        continued.len() < closed.len() && closed.starts_with(continued),
        "the continued prompt is the closed turn without its end: {continued:?} / {closed:?}"
    );

    let (status, _, reply) = server.post(
        "/v1/chat/completions",
        &json!({
            "messages": messages, "continue_final_message": true, "max_tokens": 10,
            "temperature": 0,
        }),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["usage"]["prompt_tokens"], continued.len());
    let (_, _, completion) = server.post(
        "/v1/completions",
        &json!({"prompt": continued, "max_tokens": 10, "temperature": 0}),
    );
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        completion["choices"][0]["text"]
    );

    let user_last = json!([{"role": "user", "content": "Hi"}]);
    for body in [
        json!({"messages": user_last, "continue_final_message": true}),
        json!({"messages": messages, "continue_final_message": true, "add_generation_prompt": true}),
    ] {
        let (status, _, answer) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body} -> {answer}");
        assert_eq!(
            answer["error"]["param"], "continue_final_message",
            "{answer}"
        );
    }
    assert!(server.is_idle());
}

#[test]
fn an_echoed_prompt_comes_with_its_tokens_logprobs() {
    // `echo` with `logprobs` scores the prompt (as lm-evaluation-harness and other harnesses
    // score text): each prompt token after the first gets its log-probability given the ones
    // before it. Checked against the ordinary path: the likeliest token after each prefix,
    // with its logprob, is what a greedy completion of that prefix picks. Steps of at most 16
    // tokens: the prompt is scored over several chunks.
    let server = Server::start(
        &smollm2(),
        "[cache]\npool_tokens = 16384\n[admission]\nmax_running = 8\nstep_token_budget = 16\n",
    );
    let prompt: Vec<u64> = {
        let text = "The capital of France is Paris, and the capital of Italy is Rome. \
                    The capital of Spain is Madrid, and the capital of Germany is Berlin.";
        let (_, _, body) = server.post("/tokenize", &json!({ "prompt": text }));
        body["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let scored = |body: &Value| -> Value {
        let (status, _, answer) = server.post("/v1/completions", body);
        assert_eq!(status, 200, "{body} -> {answer}");
        answer
    };
    let request = json!({
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": true, "logprobs": 1,
    });
    let answer = scored(&request);
    let logprobs = &answer["choices"][0]["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    let lps = logprobs["token_logprobs"].as_array().unwrap();
    let tops = logprobs["top_logprobs"].as_array().unwrap();
    let offsets = logprobs["text_offset"].as_array().unwrap();
    assert!(prompt.len() > 16, "{} tokens: one chunk", prompt.len());
    assert_eq!(
        tokens.len(),
        prompt.len() + 1,
        "the prompt's tokens and the one generated"
    );
    assert_eq!(
        (lps.len(), tops.len(), offsets.len()),
        (tokens.len(), tokens.len(), tokens.len())
    );
    assert!(
        lps[0].is_null() && tops[0].is_null(),
        "the first token has none: {logprobs}"
    );
    let text: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(answer["choices"][0]["text"].as_str().unwrap(), text);
    assert_eq!(answer["usage"]["prompt_tokens"], prompt.len());
    for k in 1..prompt.len() {
        let lp = assert_probability(&lps[k]);
        let top = tops[k].as_object().unwrap();
        assert_eq!(top.len(), 1, "{top:?}");
        let (top_text, top_lp) = top.iter().next().unwrap();
        let top_lp = assert_probability(top_lp);
        assert!(
            lp <= top_lp + 1e-5,
            "token {k}: {lp} above the likeliest {top_lp}"
        );
        // The ordinary path: the prefix's greedy next token and its logprob.
        let greedy = scored(&json!({
            "prompt": &prompt[..k], "max_tokens": 1, "temperature": 0, "logprobs": 0,
        }));
        let g = &greedy["choices"][0]["logprobs"];
        assert_eq!(
            g["tokens"][0].as_str().unwrap(),
            top_text,
            "after {k} tokens"
        );
        let g_lp = assert_probability(&g["token_logprobs"][0]);
        assert!(
            (g_lp - top_lp).abs() < 2e-3,
            "after {k} tokens: greedy {g_lp}, scored {top_lp}"
        );
    }

    // The same request again (its prompt now in the snapshot store) and streamed: the same
    // scores, every prompt token computed.
    let again = scored(&request);
    assert_eq!(again["choices"][0]["logprobs"], *logprobs);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let chunks = chunks(&server.post_stream("/v1/completions", &streamed));
    let first = &chunks[0]["choices"][0];
    let echoed = first["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(
        echoed.len(),
        prompt.len(),
        "the echo chunk scores the prompt: {first}"
    );
    for k in 1..prompt.len() {
        let (a, b) = (echoed[k].as_f64().unwrap(), lps[k].as_f64().unwrap());
        assert!((a - b).abs() < 1e-6, "token {k}: streamed {a}, whole {b}");
    }

    // `max_tokens: 0` with `echo` answers the prompt alone, scored; without `echo` it is a 400.
    let mut alone = request.clone();
    alone["max_tokens"] = json!(0);
    let answer = scored(&alone);
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(answer["usage"]["completion_tokens"], 0);
    let alone_lps = choice["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(
        alone_lps[..],
        lps[..prompt.len()],
        "the same scores, nothing generated"
    );
    assert_eq!(
        choice["text"].as_str().unwrap(),
        text.strip_suffix(tokens.last().unwrap().as_str().unwrap())
            .unwrap()
    );
    alone["echo"] = json!(false);
    let (status, _, refusal) = server.post("/v1/completions", &alone);
    assert_eq!(
        (status, &refusal["error"]["param"]),
        (400, &json!("max_tokens")),
        "{refusal}"
    );
    assert!(server.is_idle());
}
