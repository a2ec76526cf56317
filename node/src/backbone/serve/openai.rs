//! The OpenAI-compatible API under `/v1/`: `POST /v1/completions`,
//! `POST /v1/chat/completions` (with `stream: true` as server-sent events) and
//! `GET /v1/models`, in the shapes of `kvasir_api::openai`. Every request joins the shared
//! decode batch (`batcher`). A chat becomes a prompt through the checkpoint's chat template,
//! or ChatML (`chat`).
//!
//! Defaults and limits: `max_tokens` 16 for completions and 512 for chats, at most 4,096 and
//! within the model's context; `temperature` from 0 (greedy) to 2, the backbone's
//! `--temperature` when absent; `seed` the backbone's `--seed` when absent; up to 4 `stop`
//! strings of at most 256 bytes; one prompt and `n` 1.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use kvasir_api::openai::{
    AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatMessage, ChatRequest, ChunkChoice,
    Completion, CompletionChoice, CompletionRequest, Content, Delta, ErrorDetail, ErrorResponse,
    ModelEntry, ModelList, Settings, Usage,
};
use kvasir_inference::generate::Sampling;
use kvasir_inference::tokenizer::Tokenizer;

use super::batcher::{Event, Generation, Job, Refused};
use super::chat::Turn;
use super::Served;

/// Most tokens one request may generate.
const MAX_TOKENS: usize = 4096;
const MAX_STOPS: usize = 4;
const MAX_STOP_BYTES: usize = 256;

/// An error in the API's own shape, with its HTTP status.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    detail: ErrorDetail,
}

impl ApiError {
    fn invalid(param: Option<&str>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            detail: ErrorDetail {
                message: message.into(),
                kind: "invalid_request_error".into(),
                param: param.map(str::to_string),
                code: None,
            },
        }
    }

    fn with(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            detail: ErrorDetail {
                message: message.into(),
                kind: kind.into(),
                param: None,
                code: Some(code.into()),
            },
        }
    }

    fn body(&self) -> ErrorResponse {
        ErrorResponse {
            error: self.detail.clone(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> ApiError {
        let mut error = ApiError::invalid(None, rejection.body_text());
        error.status = match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::BAD_REQUEST,
        };
        error
    }
}

/// `GET /v1/models`: the one model this backbone serves, by the id the swarm knows it by.
pub(super) async fn models(State(served): State<Arc<Served>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelEntry {
            id: served.model_name.clone(),
            object: "model".into(),
            created: 0,
            owned_by: "kvasir".into(),
        }],
    })
}

/// `POST /v1/completions`.
pub(super) async fn completions(
    State(served): State<Arc<Served>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body?;
    let mut prompts = request.prompt.into_vec();
    if prompts.len() != 1 {
        return Err(ApiError::invalid(Some("prompt"), "one prompt per request"));
    }
    let prompt = prompts.remove(0);
    let asked = Asked::new(&served, &prompt, &request.settings, Kind::Completion)?;
    if request.settings.stream {
        return Ok(asked.stream(served, Kind::Completion)?.into_response());
    }
    let done = asked.collect(&served).await?;
    Ok(Json(Completion {
        id: asked.id.clone(),
        object: "text_completion".into(),
        created: asked.created,
        model: served.model_name.clone(),
        choices: vec![CompletionChoice {
            index: 0,
            text: done.text,
            finish_reason: Some(done.finish_reason.into()),
            logprobs: None,
        }],
        usage: Some(asked.usage(done.tokens)),
    })
    .into_response())
}

/// `POST /v1/chat/completions`.
pub(super) async fn chat_completions(
    State(served): State<Arc<Served>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body?;
    let prompt = served
        .chat
        .prompt(&chat_turns(&request.messages)?)
        .map_err(|message| ApiError::invalid(Some("messages"), message))?;
    let asked = Asked::new(&served, &prompt, &request.settings, Kind::Chat)?;
    if request.settings.stream {
        return Ok(asked.stream(served, Kind::Chat)?.into_response());
    }
    let done = asked.collect(&served).await?;
    Ok(Json(ChatCompletion {
        id: asked.id.clone(),
        object: "chat.completion".into(),
        created: asked.created,
        model: served.model_name.clone(),
        choices: vec![ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant".into(),
                content: done.text,
            },
            finish_reason: Some(done.finish_reason.into()),
        }],
        usage: asked.usage(done.tokens),
    })
    .into_response())
}

/// The chat's messages as the template takes them: known roles, text content.
fn chat_turns(messages: &[ChatMessage]) -> Result<Vec<Turn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            Some("messages"),
            "messages must not be empty",
        ));
    }
    let mut turns = Vec::new();
    for message in messages {
        if !matches!(
            message.role.as_str(),
            "system" | "developer" | "user" | "assistant" | "tool"
        ) {
            return Err(ApiError::invalid(
                Some("messages"),
                format!("unknown role {:?}", message.role),
            ));
        }
        let content = match &message.content {
            None => String::new(),
            Some(Content::Text(text)) => text.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(piece)) => text.push_str(piece),
                        _ => {
                            return Err(ApiError::invalid(
                                Some("messages"),
                                "only text content parts are served",
                            ))
                        }
                    }
                }
                text
            }
        };
        turns.push(Turn {
            role: message.role.clone(),
            content,
        });
    }
    Ok(turns)
}

#[derive(Clone, Copy)]
enum Kind {
    Completion,
    Chat,
}

/// A validated request: its prompt tokens, how to sample, and where to stop.
struct Asked {
    id: String,
    created: u64,
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    stops: Vec<String>,
    include_usage: bool,
}

/// A finished generation's text (stop strings cut off), its reason and token count.
struct Finished {
    text: String,
    finish_reason: &'static str,
    tokens: usize,
}

impl Asked {
    fn new(
        served: &Served,
        prompt: &str,
        settings: &Settings,
        kind: Kind,
    ) -> Result<Asked, ApiError> {
        let (default_tokens, prefix) = match kind {
            Kind::Completion => (16, "cmpl"),
            Kind::Chat => (512, "chatcmpl"),
        };
        if let Some(model) = &settings.model {
            if *model != served.model_name {
                return Err(ApiError::with(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "model_not_found",
                    format!("this backbone serves {}, not {model:?}", served.model_name),
                ));
            }
        }
        if settings.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(Some("n"), "n must be 1"));
        }
        let temperature = settings.temperature.unwrap_or(served.sampling.temperature);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                Some("temperature"),
                "temperature must be from 0 to 2",
            ));
        }
        let max_tokens = settings
            .max_tokens
            .or(settings.max_completion_tokens)
            .unwrap_or(default_tokens);
        if !(1..=MAX_TOKENS).contains(&max_tokens) {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                format!("max_tokens must be from 1 to {MAX_TOKENS}"),
            ));
        }
        let stops = settings
            .stop
            .clone()
            .map(|s| s.into_vec())
            .unwrap_or_default();
        if stops.len() > MAX_STOPS
            || stops
                .iter()
                .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::invalid(
                Some("stop"),
                format!("at most {MAX_STOPS} stop strings of 1 to {MAX_STOP_BYTES} bytes"),
            ));
        }
        if prompt.is_empty() {
            return Err(ApiError::invalid(Some("prompt"), "the prompt is empty"));
        }
        let tokens = served
            .engine
            .tokenizer
            .encode(prompt)
            .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))?;
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Asked {
            id: format!("{prefix}-{}", served.next_id()),
            created,
            prompt: tokens,
            max_tokens,
            sampling: Sampling {
                temperature,
                seed: settings.seed.unwrap_or(served.sampling.seed),
            },
            stops,
            include_usage: settings
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
        })
    }

    fn usage(&self, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens: self.prompt.len(),
            completion_tokens,
            total_tokens: self.prompt.len() + completion_tokens,
        }
    }

    fn submit(&self, served: &Served) -> Result<Generation, ApiError> {
        served
            .batcher
            .submit(Job {
                prompt: self.prompt.clone(),
                max_new: self.max_tokens,
                sampling: self.sampling,
            })
            .map_err(|refused| match refused {
                Refused::Busy => ApiError::with(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "queue_full",
                    "the backbone's queue is full; retry later",
                ),
                Refused::Stopped => ApiError::with(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "stopped",
                    "this backbone no longer generates",
                ),
                Refused::Invalid(unfit) if unfit.is_length() => ApiError::with(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "context_length_exceeded",
                    unfit.to_string(),
                ),
                Refused::Invalid(unfit) => ApiError::invalid(Some("prompt"), unfit.to_string()),
            })
    }

    /// Runs the generation to its end.
    async fn collect(&self, served: &Served) -> Result<Finished, ApiError> {
        let mut events = self.submit(served)?;
        let tokenizer = &served.engine.tokenizer;
        let mut text = Detokenizer::new(self.stops.clone(), served.end_tokens());
        let mut out = String::new();
        let mut tokens = 0;
        while let Some(event) = events.recv().await {
            match event {
                Event::Token(token) => {
                    tokens += 1;
                    let (piece, stopped) = text.push(tokenizer, token);
                    out.push_str(&piece);
                    if stopped {
                        // Done before the batch's end: not a caller who hung up.
                        events.finish();
                        return Ok(Finished {
                            text: out,
                            finish_reason: "stop",
                            tokens,
                        });
                    }
                }
                Event::Done { eos, .. } => {
                    let (piece, stopped) = text.rest(tokenizer);
                    out.push_str(&piece);
                    return Ok(Finished {
                        text: out,
                        finish_reason: if eos || stopped { "stop" } else { "length" },
                        tokens,
                    });
                }
                Event::Failed(message) => return Err(server_error(message)),
            }
        }
        Err(server_error(
            "the generation ended without an answer".into(),
        ))
    }

    /// The generation as server-sent events: chunks of text, the last with its
    /// `finish_reason`, a usage chunk if asked, then `[DONE]`. Queued before the answer
    /// starts, so a full queue is a 429 like any other.
    fn stream(
        self,
        served: Arc<Served>,
        kind: Kind,
    ) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
        let events = Some(self.submit(&served)?);
        let text = Detokenizer::new(self.stops.clone(), served.end_tokens());
        let chunks = stream::unfold(
            Streaming {
                asked: self,
                served,
                kind,
                events,
                text,
                tokens: 0,
                started: false,
                ended: false,
                finished: false,
            },
            |mut state| async move {
                let event = state.next().await?;
                Some((Ok(event), state))
            },
        );
        Ok(Sse::new(chunks))
    }
}

fn server_error(message: String) -> ApiError {
    ApiError::with(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "generation_failed",
        message,
    )
}

/// The state of one event stream.
struct Streaming {
    asked: Asked,
    served: Arc<Served>,
    kind: Kind,
    /// Dropped with the last chunk: the generation stops there even if `[DONE]` is never read.
    events: Option<Generation>,
    text: Detokenizer,
    tokens: usize,
    /// The chat's opening chunk (the role) was sent.
    started: bool,
    /// The last chunk (and the usage) was sent; `[DONE]` is next.
    ended: bool,
    finished: bool,
}

impl Streaming {
    async fn next(&mut self) -> Option<SseEvent> {
        if self.finished {
            return None;
        }
        if self.ended {
            self.finished = true;
            return Some(SseEvent::default().data("[DONE]"));
        }
        if matches!(self.kind, Kind::Chat) && !self.started {
            self.started = true;
            let delta = Delta {
                role: Some("assistant".into()),
                content: Some(String::new()),
            };
            return Some(json_event(&self.chat(delta, None)));
        }
        let Some(receiver) = &mut self.events else {
            self.ended = true;
            let error = server_error("the generation ended without an answer".into());
            return Some(json_event(&error.body()));
        };
        let tokenizer = &self.served.engine.tokenizer;
        loop {
            let Some(event) = receiver.recv().await else {
                self.ended = true;
                let error = server_error("the generation ended without an answer".into());
                return Some(json_event(&error.body()));
            };
            match event {
                Event::Token(token) => {
                    self.tokens += 1;
                    let (piece, stopped) = self.text.push(tokenizer, token);
                    if stopped {
                        return Some(self.last(piece, "stop"));
                    }
                    if !piece.is_empty() {
                        return Some(self.piece(piece));
                    }
                }
                Event::Done { eos, .. } => {
                    let (rest, stopped) = self.text.rest(tokenizer);
                    let reason = if eos || stopped { "stop" } else { "length" };
                    return Some(self.last(rest, reason));
                }
                Event::Failed(message) => {
                    self.ended = true;
                    return Some(json_event(&server_error(message).body()));
                }
            }
        }
    }

    fn piece(&self, text: String) -> SseEvent {
        match self.kind {
            Kind::Completion => json_event(&self.completion(text, None)),
            Kind::Chat => {
                let delta = Delta {
                    role: None,
                    content: Some(text),
                };
                json_event(&self.chat(delta, None))
            }
        }
    }

    /// The chunk with the finish reason (and any text left), with the usage if asked.
    fn last(&mut self, text: String, reason: &str) -> SseEvent {
        self.ended = true;
        // Done, at a stop string perhaps before the batch's end: not a caller who hung up.
        if let Some(events) = self.events.take() {
            events.finish();
        }
        let usage = self
            .asked
            .include_usage
            .then(|| self.asked.usage(self.tokens));
        match self.kind {
            Kind::Completion => json_event(&Completion {
                usage,
                ..self.completion(text, Some(reason))
            }),
            Kind::Chat => {
                let delta = Delta {
                    role: None,
                    content: (!text.is_empty()).then_some(text),
                };
                json_event(&ChatChunk {
                    usage,
                    ..self.chat(delta, Some(reason))
                })
            }
        }
    }

    fn completion(&self, text: String, reason: Option<&str>) -> Completion {
        Completion {
            id: self.asked.id.clone(),
            object: "text_completion".into(),
            created: self.asked.created,
            model: self.served.model_name.clone(),
            choices: vec![CompletionChoice {
                index: 0,
                text,
                finish_reason: reason.map(str::to_string),
                logprobs: None,
            }],
            usage: None,
        }
    }

    fn chat(&self, delta: Delta, reason: Option<&str>) -> ChatChunk {
        ChatChunk {
            id: self.asked.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.asked.created,
            model: self.served.model_name.clone(),
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                finish_reason: reason.map(str::to_string),
            }],
            usage: None,
        }
    }
}

fn json_event(value: &impl serde::Serialize) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(value).unwrap_or_default())
}

/// Generated tokens to text, a piece at a time: text is released only once it cannot change
/// (a character still missing bytes is held back) and cannot be the start of a stop string;
/// at a stop string, the text before it is the last piece. End tokens are not text.
///
/// Each step costs the same however long the generation: a new token is decoded together
/// with the tokens since the last settled point (how a tokenizer spells a token can depend on
/// the one before: a leading space, a character's bytes split over tokens), and only the text
/// it adds is appended; stop strings are looked for in the text not yet released, where any
/// that could begin is held.
struct Detokenizer {
    stops: Vec<String>,
    end_tokens: Vec<u32>,
    ids: Vec<u32>,
    /// `ids[..read]` are in `text`; `ids[context..read]` are decoded again with each new
    /// token, as its context.
    context: usize,
    read: usize,
    text: String,
    /// Bytes of `text` already released.
    released: usize,
}

impl Detokenizer {
    fn new(stops: Vec<String>, end_tokens: Vec<u32>) -> Detokenizer {
        Detokenizer {
            stops,
            end_tokens,
            ids: Vec::new(),
            context: 0,
            read: 0,
            text: String::new(),
            released: 0,
        }
    }

    /// Appends to `text` what the tokens from `read` on add, as far as it cannot change. Text
    /// is settled only where it ends in a whole character, so what follows can never change
    /// it (UTF-8 resynchronizes at each character) and the appended text is exactly the whole
    /// decode's. While more tokens may come (`finished` false) and the decode ends in a
    /// broken character, a byte-level decoder (`Tokenizer::joins_bytes`) can still change only
    /// that last character: what the tokens before the last decode to is then settled if it is
    /// a strictly shorter start of the decode, which means the last token ended or replaced
    /// their final character. So a run of invalid bytes streams on instead of being held and
    /// decoded again each token. (Other decoders wait for a whole character.)
    fn settle(&mut self, tokenizer: &Tokenizer, finished: bool) {
        if self.read == self.ids.len() {
            return;
        }
        let decode = |ids: &[u32]| tokenizer.decode(ids).unwrap_or_default();
        let before = decode(&self.ids[self.context..self.read]);
        let now = decode(&self.ids[self.context..]);
        let (upto, settled) = if finished || !now.ends_with('\u{fffd}') {
            (self.ids.len(), now)
        } else if !tokenizer.joins_bytes() {
            return;
        } else {
            let upto = self.ids.len() - 1;
            if upto == self.read {
                return;
            }
            let head = decode(&self.ids[self.context..upto]);
            if head.len() >= now.len() || !now.starts_with(head.as_str()) {
                return;
            }
            (upto, head)
        };
        match settled.strip_prefix(before.as_str()) {
            Some(added) => self.text.push_str(added),
            // Only a decoder that is not byte-level can do this (a byte-fallback run turned
            // invalid by a later byte): what was released stays as it was, and the new
            // tokens are added as they decode alone, so that none of their text is lost.
            None => {
                tracing::warn!("the tokenizer's decode changed text already settled");
                self.text.push_str(&decode(&self.ids[self.read..upto]));
            }
        }
        self.context = self.read;
        self.read = upto;
    }

    /// Adds `token`: the text it releases, and whether a stop string was reached.
    fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> (String, bool) {
        if self.end_tokens.contains(&token) {
            return (String::new(), false);
        }
        self.ids.push(token);
        self.settle(tokenizer, false);
        self.cut(false)
    }

    /// At the end of the generation: what is still held back (up to a stop string, if the
    /// last text reaches one), and whether a stop string was reached.
    fn rest(&mut self, tokenizer: &Tokenizer) -> (String, bool) {
        self.settle(tokenizer, true);
        self.cut(true)
    }

    /// Releases the settled text up to the first stop string in it, if there is one; else up
    /// to any tail that could begin a stop string (all of it when the generation is
    /// `finished`). Released text never holds the start of a stop string, so the unreleased
    /// text is the only place to look.
    fn cut(&mut self, finished: bool) -> (String, bool) {
        let unreleased = &self.text[self.released..];
        let stop = self
            .stops
            .iter()
            .filter_map(|s| unreleased.find(s.as_str()))
            .min();
        if let Some(at) = stop {
            return (self.release(self.released + at), true);
        }
        let mut safe = self.text.len();
        if !finished {
            for stop in &self.stops {
                let longest = (1..stop.len())
                    .rev()
                    .filter(|k| stop.is_char_boundary(*k))
                    .find(|k| self.text[..safe].ends_with(&stop[..*k]));
                if let Some(k) = longest {
                    safe -= k;
                }
            }
        }
        (self.release(safe), false)
    }

    /// `text[released..upto]`, marking it released.
    fn release(&mut self, upto: usize) -> String {
        match self.text.get(self.released..upto) {
            Some(piece) if upto > self.released => {
                self.released = upto;
                piece.to_string()
            }
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_prompt(messages: &[ChatMessage]) -> Result<String, ApiError> {
        super::super::chat::Chat::ChatMl
            .prompt(&chat_turns(messages)?)
            .map_err(|m| ApiError::invalid(None, m))
    }

    #[test]
    fn a_chat_is_one_chatml_prompt_and_odd_messages_are_refused() {
        let message = |role: &str, text: &str| ChatMessage {
            role: role.into(),
            content: Some(Content::Text(text.into())),
        };
        let prompt = chat_prompt(&[message("system", "Be brief."), message("user", "Hi")]).unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(chat_prompt(&[]).is_err());
        assert!(chat_prompt(&[message("wizard", "x")]).is_err());
        let image = ChatMessage {
            role: "user".into(),
            content: Some(Content::Parts(vec![kvasir_api::openai::ContentPart {
                kind: "image_url".into(),
                text: None,
            }])),
        };
        assert!(chat_prompt(&[image]).is_err());
    }

    /// Text comes out a piece per token, never a piece of a stop string, and a stop string
    /// ends it with the text before it, even when the stop spans tokens.
    #[test]
    fn detokenizing_releases_text_that_cannot_change_and_stops_before_a_stop_string() {
        let tokenizer = Tokenizer::load(&crate::engine::tiny_checkpoint()).unwrap();
        let text = "The capital of France is Paris, the city of light.";
        let ids = tokenizer.encode(text).unwrap();
        assert!(ids.len() > 4);
        let run = |stops: Vec<String>| detokenize(&tokenizer, stops, &ids);
        assert_eq!(run(Vec::new()), (text.to_string(), false));
        // Characters whose bytes are split over tokens come out whole, never half.
        let text = "Zürich → 東京, naïve café";
        let ids = tokenizer.encode(text).unwrap();
        assert!(
            ids.len() > text.chars().count(),
            "split characters: {ids:?}"
        );
        let mut detokenizer = Detokenizer::new(vec!["京,".into()], vec![0]);
        let mut pieces = Vec::new();
        for id in &ids {
            let (piece, stopped) = detokenizer.push(&tokenizer, *id);
            pieces.push(piece);
            if stopped {
                break;
            }
        }
        assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{pieces:?}");
        assert_eq!(pieces.concat(), "Zürich → 東");
        assert_eq!(
            run(vec!["city".into()]),
            ("The capital of France is Paris, the ".into(), true)
        );
        assert_eq!(
            run(vec!["nowhere".into(), "Paris".into()]),
            ("The capital of France is ".into(), true)
        );
        // End tokens are not text, every one of a list.
        let mut detokenizer = Detokenizer::new(Vec::new(), vec![0, 5]);
        assert_eq!(detokenizer.push(&tokenizer, 0), (String::new(), false));
        assert_eq!(detokenizer.push(&tokenizer, 5), (String::new(), false));
    }

    /// All of `ids` through a detokenizer stopping at `stops`: the text and whether it stopped.
    fn detokenize(tokenizer: &Tokenizer, stops: Vec<String>, ids: &[u32]) -> (String, bool) {
        let mut detokenizer = Detokenizer::new(stops, vec![0]);
        let mut out = String::new();
        for id in ids {
            let (piece, stopped) = detokenizer.push(tokenizer, *id);
            out.push_str(&piece);
            if stopped {
                return (out, true);
            }
        }
        let (piece, stopped) = detokenizer.rest(tokenizer);
        out.push_str(&piece);
        (out, stopped)
    }

    /// Invalid bytes stream out as they come, each decoded once, and a stop string reached
    /// only by the last, unfinished character still stops the generation.
    #[test]
    fn invalid_bytes_stream_on_and_the_last_text_is_searched_for_stops() {
        let tokenizer = Tokenizer::load(&crate::engine::tiny_checkpoint()).unwrap();
        let decode = |ids: &[u32]| tokenizer.decode(ids).unwrap();
        // A lone continuation byte: invalid wherever it is.
        let lone = (1..384)
            .find(|&t| decode(&[t]) == "\u{fffd}" && decode(&[t, t]) == "\u{fffd}\u{fffd}")
            .expect("a byte token that is never part of a character");
        let mut detokenizer = Detokenizer::new(Vec::new(), vec![0]);
        let mut out = String::new();
        for n in 1..=50 {
            out.push_str(&detokenizer.push(&tokenizer, lone).0);
            assert_eq!(
                out.chars().count(),
                n - 1,
                "held back more than the last token"
            );
            assert!(
                detokenizer.ids.len() - detokenizer.context <= 2,
                "the window grew"
            );
        }
        // The first byte of a three-byte character, at the end: not a character, but text.
        let lead = tokenizer.encode("京").unwrap()[0];
        assert_eq!(decode(&[lead]), "\u{fffd}");
        assert_eq!(
            detokenize(&tokenizer, vec!["\u{fffd}".into()], &[lead]),
            (String::new(), true)
        );
        let ids = tokenizer.encode("ok").unwrap();
        let ended = [ids.as_slice(), &[lead]].concat();
        assert_eq!(
            detokenize(&tokenizer, vec!["k\u{fffd}".into()], &ended),
            ("o".into(), true)
        );
    }

    /// A byte-fallback decoder reads a run of byte tokens as a whole, so nothing of a
    /// character split over them is released before the run makes it whole.
    #[test]
    fn a_byte_fallback_run_is_released_only_when_whole() {
        let dir = tempfile::tempdir().unwrap();
        let vocab = r#"{"<0xE4>": 0, "<0xB8>": 1, "<0xAD>": 2, "a": 3}"#;
        let json = format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {{"type": "ByteFallback"}},
            "model": {{"type": "BPE", "byte_fallback": true, "vocab": {vocab}, "merges": []}}}}"#
        );
        std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
        let tokenizer = Tokenizer::load(dir.path()).unwrap();
        assert!(!tokenizer.joins_bytes());
        assert!(Tokenizer::load(&crate::engine::tiny_checkpoint())
            .unwrap()
            .joins_bytes());
        let mut detokenizer = Detokenizer::new(Vec::new(), vec![]);
        let pieces: Vec<String> = [3, 0, 1, 2]
            .iter()
            .map(|id| detokenizer.push(&tokenizer, *id).0)
            .collect();
        assert_eq!(pieces, ["a", "", "", "中"]);
        // A stray byte after the run: the run decoded with it no longer starts with the
        // released "中", and the text after the byte is still not lost.
        let mut detokenizer = Detokenizer::new(Vec::new(), vec![]);
        let pieces: String = [3, 0, 1, 2, 0, 3]
            .iter()
            .map(|id| detokenizer.push(&tokenizer, *id).0)
            .collect();
        assert!(
            pieces.starts_with("a中") && pieces.ends_with('a'),
            "{pieces:?}"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Any tokens at all, broken characters and invalid bytes included, come out as the
        /// whole generation's decode, piece by piece; with a stop string, as that decode up
        /// to the stop string's first place in it.
        #[test]
        fn any_tokens_come_out_as_their_whole_decode(
            ids in proptest::collection::vec(1u32..384, 0..300),
            at in 0usize..300,
            len in 1usize..4,
            broken in proptest::bool::ANY,
        ) {
            let tokenizer = Tokenizer::load(&crate::engine::tiny_checkpoint()).unwrap();
            let whole = tokenizer.decode(&ids).unwrap();
            proptest::prop_assert_eq!(detokenize(&tokenizer, Vec::new(), &ids), (whole.clone(), false));
            // A stop string that occurs: the text of a few of the tokens, or a broken character.
            let from = at.min(ids.len());
            let spelled = tokenizer.decode(&ids[from..(from + len).min(ids.len())]).unwrap();
            let stop = if broken || spelled.is_empty() { "\u{fffd}".to_string() } else { spelled };
            let expected = match whole.find(&stop) {
                Some(cut) => (whole[..cut].to_string(), true),
                None => (whole, false),
            };
            proptest::prop_assert_eq!(detokenize(&tokenizer, vec![stop], &ids), expected);
        }
    }
}
