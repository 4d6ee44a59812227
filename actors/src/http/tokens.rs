//! `POST /tokenize` and `POST /detokenize` (as vLLM, TGI and llama.cpp's server offer them): the
//! tokens a prompt, or a chat's messages, come to exactly as `/v1/completions` and
//! `/v1/chat/completions` would compute them, and the text of a list of token ids. A client
//! budgets its context with them without a tokenizer of its own.

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::api::{ChatRequest, Message, Prompt, ToolDef, check_model, check_vocabulary};
use super::error::ApiError;
use super::{ApiState, Model, body, off_the_worker};

/// A prompt (text or token ids, as completions take it) or a chat (`messages`, with the
/// `tools`, `tool_choice`, `add_generation_prompt` and `continue_final_message` a chat request
/// would give), one of them.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<Prompt>,
    messages: Option<Vec<Message>>,
    tools: Option<Vec<ToolDef>>,
    tool_choice: Option<Value>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    /// Each token's text too (`token_strs`).
    return_token_strs: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

impl TokenizeRequest {
    fn answer(self, model: &Model) -> Result<Value, ApiError> {
        check_model(self.model.as_deref(), model)?;
        let tokens = match (self.prompt, self.messages) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(ApiError::invalid(
                    "give what to tokenize as `prompt` or as `messages`, one of them",
                ));
            }
            (Some(prompt), None) => prompt.single(model, "prompt")?,
            (None, Some(messages)) => {
                let chat = ChatRequest {
                    messages,
                    tools: self.tools,
                    tool_choice: self.tool_choice,
                    add_generation_prompt: self.add_generation_prompt,
                    continue_final_message: self.continue_final_message,
                    ..ChatRequest::default()
                };
                chat.render(model)?.prompt
            }
        };
        check_vocabulary(&tokens, model, "prompt")?;
        let token_strs = self.return_token_strs.unwrap_or(false).then(|| {
            tokens
                .iter()
                .map(|&id| model.tokenizer.id_to_token(id))
                .collect::<Vec<_>>()
        });
        Ok(json!({
            "count": tokens.len(),
            "max_model_len": model.limit.tokens,
            "tokens": tokens,
            "token_strs": token_strs,
        }))
    }
}

impl DetokenizeRequest {
    fn answer(self, model: &Model) -> Result<Value, ApiError> {
        check_model(self.model.as_deref(), model)?;
        check_vocabulary(&self.tokens, model, "tokens")?;
        let text = model
            .tokenizer
            .decode(&self.tokens, false)
            .map_err(|e| ApiError::invalid_param("tokens", e.to_string()))?;
        Ok(json!({ "prompt": text }))
    }
}

pub async fn tokenize(
    state: web::Data<ApiState>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    answered(state, request, payload, TokenizeRequest::answer).await
}

pub async fn detokenize(
    state: web::Data<ApiState>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    answered(state, request, payload, DetokenizeRequest::answer).await
}

/// Reads the body as an `R` and answers what `answer` makes of it, computed off the worker.
async fn answered<R: DeserializeOwned + Send + 'static>(
    state: web::Data<ApiState>,
    request: HttpRequest,
    payload: web::Payload,
    answer: fn(R, &Model) -> Result<Value, ApiError>,
) -> Result<HttpResponse, ApiError> {
    let body: R = body::read_json(&request, payload, state.body).await?;
    let model = state.model.clone();
    let answer = off_the_worker(move || answer(body, &model)).await?;
    Ok(HttpResponse::Ok().json(answer))
}
