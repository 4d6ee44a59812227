//! Grammar-constrained generation on the real SmolLM2 (bf16, CPU): for a corpus of JSON
//! schemas, greedy output held to the schema by llguidance parses, validates against the
//! schema with an independent validator (the `jsonschema` crate), and ends with the model's
//! end-of-sequence token, not at `max_tokens`. Regexes and bad grammars too.

mod common;

use common::smollm2;
use engine::DType;
use engine::backend::Backend;
use engine::chat::ChatMessage;
use engine::cpu::{CpuBackend, CpuOptions};
use engine::generate::{FinishReason, Generation, Vocabulary, generate_with};
use engine::grammar::{GrammarSpec, Grammars};
use engine::model::ModelFiles;
use engine::sampling::{Sampler, SamplingParams};
use serde_json::{Value, json};

struct Setup {
    model: ModelFiles,
    backend: CpuBackend,
    grammars: Grammars,
}

fn setup() -> Setup {
    let model = ModelFiles::open(&smollm2(DType::BF16)).expect("the converted folder opens");
    let backend = CpuBackend::load(&model, &CpuOptions::for_tokens(1024)).expect("loads");
    let vocab = backend.info().vocab_size;
    let grammars = Grammars::new(&model.tokenizer, vocab, &model.eos_token_ids).unwrap();
    Setup {
        model,
        backend,
        grammars,
    }
}

fn run(setup: &mut Setup, ask: &str, spec: &GrammarSpec, max_tokens: usize) -> Generation {
    let template = setup.model.chat_template.as_ref().expect("SmolLM2 has one");
    let rendered = template
        .render(&[ChatMessage::new("user", ask)], true)
        .unwrap();
    let prompt = setup.model.tokenizer.encode_rendered(&rendered).unwrap();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..SamplingParams::default()
    };
    let constraint = setup
        .grammars
        .constraint(spec)
        .expect("the grammar compiles");
    let sampler = Sampler::new(&params, &prompt).constrained(Box::new(constraint));
    let vocab = Vocabulary {
        tokenizer: &setup.model.tokenizer,
        eos_token_ids: &setup.model.eos_token_ids,
    };
    generate_with(&mut setup.backend, &vocab, &prompt, sampler, 64, |_| {})
        .expect("generation runs")
}

fn corpus() -> Vec<(&'static str, Value)> {
    vec![
        (
            "Describe a person as JSON.",
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150}
                },
                "required": ["name", "age"],
                "additionalProperties": false
            }),
        ),
        (
            "List three fruits.",
            json!({
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "minItems": 3,
                "maxItems": 3
            }),
        ),
        (
            "What colour is the sky?",
            json!({"type": "string", "enum": ["red", "green", "blue"]}),
        ),
        (
            "Where is Paris?",
            json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "country": {"type": "string", "maxLength": 30},
                    "location": {
                        "type": "object",
                        "properties": {
                            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                            "lon": {"type": "integer", "minimum": -180, "maximum": 180}
                        },
                        "required": ["lat", "lon"],
                        "additionalProperties": false
                    }
                },
                "required": ["city", "country", "location"],
                "additionalProperties": false
            }),
        ),
        (
            "Is water wet? Answer with a flag and a reason.",
            json!({
                "type": "object",
                "properties": {
                    "answer": {"type": "boolean"},
                    "reason": {"type": "string", "maxLength": 60}
                },
                "required": ["answer", "reason"],
                "additionalProperties": false
            }),
        ),
        (
            "Give me a flight code.",
            json!({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
        ),
        (
            "How many legs does a spider have?",
            json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "null"}]}),
        ),
        (
            "Name two tags for a blog post about cooking.",
            json!({
                "type": "object",
                "properties": {
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["food", "travel", "tech", "home"]},
                        "minItems": 1,
                        "maxItems": 2
                    }
                },
                "required": ["tags"],
                "additionalProperties": false
            }),
        ),
    ]
}

#[test]
fn every_output_parses_validates_and_ends_with_end_of_sequence() {
    let mut setup = setup();
    for (ask, schema) in corpus() {
        let spec = GrammarSpec::JsonSchema {
            schema: schema.clone(),
            strict: true,
        };
        let out = run(&mut setup, ask, &spec, 200);
        let value: Value = serde_json::from_str(&out.text)
            .unwrap_or_else(|e| panic!("{ask}: {:?} is not JSON: {e}", out.text));
        let validator = jsonschema::validator_for(&schema).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "{ask}: {value} fails its schema: {errors:?}"
        );
        assert_eq!(
            out.finish_reason,
            FinishReason::Stop,
            "{ask}: {:?} ended by length",
            out.text
        );
    }
}

#[test]
fn json_object_and_regex_hold_the_output() {
    let mut setup = setup();
    let out = run(
        &mut setup,
        "Give the name and the age of a cat, in JSON.",
        &GrammarSpec::JsonObject,
        200,
    );
    let value: Value = serde_json::from_str(&out.text)
        .unwrap_or_else(|e| panic!("{:?} is not JSON: {e}", out.text));
    assert!(value.is_object(), "{value}");

    let out = run(
        &mut setup,
        "Is the earth round?",
        &GrammarSpec::Regex("(yes|no), because [a-z ]{1,40}\\.".into()),
        100,
    );
    let re = regex_lite(&out.text);
    assert!(re, "{:?} does not match", out.text);
    assert_eq!(out.finish_reason, FinishReason::Stop);
}

/// `(yes|no), because [a-z ]{1,40}\.` checked by hand (no regex crate in the engine's tests).
fn regex_lite(text: &str) -> bool {
    let rest = text
        .strip_prefix("yes, because ")
        .or_else(|| text.strip_prefix("no, because "));
    let Some(rest) = rest.and_then(|r| r.strip_suffix('.')) else {
        return false;
    };
    (1..=40).contains(&rest.len()) && rest.chars().all(|c| c.is_ascii_lowercase() || c == ' ')
}

#[test]
fn bad_grammars_are_refused_with_their_reason() {
    let setup = setup();
    let bad = [
        GrammarSpec::JsonSchema {
            schema: json!({"type": "nonsense"}),
            strict: true,
        },
        GrammarSpec::JsonSchema {
            schema: json!([1, 2]),
            strict: true,
        },
        GrammarSpec::Regex("(unclosed".into()),
        GrammarSpec::Lark("start: undefined_rule".into()),
    ];
    for spec in &bad {
        let error = setup.grammars.constraint(spec).expect_err("refused");
        assert!(!error.is_empty(), "{spec:?} refused without a reason");
    }
    // A keyword the engine cannot enforce is refused when strict, ignored when not.
    let unique = json!({"type": "array", "uniqueItems": true});
    let strict = GrammarSpec::JsonSchema {
        schema: unique.clone(),
        strict: true,
    };
    let error = setup
        .grammars
        .constraint(&strict)
        .expect_err("strict refuses");
    assert!(error.contains("uniqueItems"), "{error}");
    let lenient = GrammarSpec::JsonSchema {
        schema: unique,
        strict: false,
    };
    assert!(setup.grammars.constraint(&lenient).is_ok());
}

#[test]
fn token_bytes_spell_the_vocabulary() {
    let setup = setup();
    let tokenizer = &setup.model.tokenizer;
    let ids = tokenizer.encode_rendered("Hello, wörld! 日本").unwrap();
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&id| setup.grammars.token_bytes(id).to_vec())
        .collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), "Hello, wörld! 日本");
    let im_end = tokenizer.token_to_id("<|im_end|>").unwrap();
    assert_eq!(setup.grammars.token_bytes(im_end), b"<|im_end|>");
}
