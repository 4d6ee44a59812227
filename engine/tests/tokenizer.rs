//! The converted SmolLM2 tokenizer and chat template against Hugging Face's tokenizer: texts
//! with digits, whitespace runs, code, CJK, emoji and special tokens, ids recorded by
//! `fixtures/make_smollm2_fixture.py` (which also checked them against transformers' own GGUF
//! tokenizer conversion).

mod common;

use common::{Fixture, fixture_path, smollm2};
use engine::DType;
use engine::chat::ChatMessage;
use engine::model::ModelFiles;
use engine::tokenizer::TextStream;

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture_path("smollm2_tokenizer.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn encoding_matches_hugging_face_and_round_trips() {
    let model = ModelFiles::open(&smollm2(DType::BF16)).unwrap();
    let cases = cases();
    assert!(cases.len() >= 10);
    for case in &cases {
        let ids = model.tokenizer.encode_rendered(&case.text).unwrap();
        assert_eq!(ids, case.ids, "ids of {:?}", case.text);
        // SmolLM2 adds no BOS: a raw prompt encodes the same way.
        assert_eq!(
            model.tokenizer.encode_prompt(&case.text).unwrap(),
            case.ids,
            "prompt ids of {:?}",
            case.text
        );
        let decoded = model.tokenizer.decode(&ids, false).unwrap();
        assert_eq!(
            decoded, case.decoded,
            "HF decodes {:?} the same way",
            case.text
        );
        assert_eq!(
            decoded, case.text,
            "decode(encode(x)) == x for {:?}",
            case.text
        );
    }
}

#[test]
fn digits_are_split_one_by_one() {
    let model = ModelFiles::open(&smollm2(DType::BF16)).unwrap();
    let ids = model.tokenizer.encode_rendered("2024").unwrap();
    let pieces: Vec<String> = ids
        .iter()
        .map(|&id| model.tokenizer.id_to_token(id).unwrap())
        .collect();
    assert_eq!(pieces, ["2", "0", "2", "4"]);
}

#[test]
fn special_tokens_and_eos_are_known() {
    let model = ModelFiles::open(&smollm2(DType::BF16)).unwrap();
    assert_eq!(model.tokenizer.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(model.tokenizer.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(model.eos_token_ids, vec![2]);
    assert_eq!(model.tokenizer.vocab_size(), 49152);
}

#[test]
fn chat_template_renders_what_hugging_face_tokenized() {
    let model = ModelFiles::open(&smollm2(DType::BF16)).unwrap();
    let template = model
        .chat_template
        .as_ref()
        .expect("SmolLM2 has a chat template");
    let text = template
        .render(
            &[ChatMessage::new(
                "user",
                "What is the tallest mountain in the world?",
            )],
            true,
        )
        .unwrap();
    assert!(text.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    assert!(text.ends_with("<|im_start|>assistant\n"));
    let ids = model.tokenizer.encode_rendered(&text).unwrap();
    assert_eq!(ids, Fixture::load().prompt("chat").ids);
}

#[test]
fn streaming_decode_never_splits_a_character() {
    let model = ModelFiles::open(&smollm2(DType::BF16)).unwrap();
    for case in cases() {
        let mut stream = TextStream::new(false);
        let mut text = String::new();
        for &id in &case.ids {
            text.push_str(&stream.push(&model.tokenizer, id).unwrap());
        }
        text.push_str(&stream.finish(&model.tokenizer).unwrap());
        assert_eq!(text, case.text);
    }
}
