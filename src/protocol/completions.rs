//! The OpenAI codec for (legacy) Completions: one prompt or a batch of them (text or token
//! ids), `echo` with the prompt's own logprobs, and `max_tokens: 0` (the prompt scored,
//! nothing generated) — what lm-evaluation-harness's loglikelihood tasks send.

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::api::{self, ApiError, Flavor, parse_body};
use super::fields::Passes;
use super::http::{
    ServerState, SseEvent, Timed, Timer, check_model, engine_error, json_when_done, now_secs,
    read_body, respond, sse,
};
use super::openai::{SamplingFields, StreamOptions, check_chat_extras, finish_reason, usage};
use crate::engine::{EngineError, FinishReason, RequestOutput};
use crate::model::ModelText;
use futures_util::FutureExt;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptField,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<usize>,
    /// The prompt comes back before the completion, in `text` and (with `logprobs`) with
    /// each prompt token's logprob under the model.
    #[serde(default)]
    pub echo: bool,
    /// vLLM's: `false` sends the prompt without the model's BOS.
    pub add_special_tokens: Option<bool>,
    /// vLLM's: `false` keeps control tokens in the text (not on chat: replies are parsed).
    pub skip_special_tokens: Option<bool>,
    /// Control-token strings in a text prompt read as those tokens (default: as text).
    pub parse_special_tokens: Option<bool>,
    /// vLLM's: each prompt token's logprob and this many most likely ids, as
    /// `prompt_logprobs` in each choice (`{id: {logprob, rank, decoded_token}}` a position).
    pub prompt_logprobs: Option<usize>,
    /// The end user, for the server's log.
    pub user: Option<String>,
    #[serde(skip)]
    pub sampling: SamplingFields,
}

/// Fields of OpenAI's or vLLM's Completions that troupe does not act on: refused by name
/// when set to anything but their default, never ignored.
const NOT_SUPPORTED: &[(&str, &str)] = &[
    ("suffix", "insertion after a suffix is not supported"),
    ("best_of", "best_of is not supported (use n)"),
    ("use_beam_search", "beam search is not supported"),
    (
        "include_stop_str_in_output",
        "the stop string is always left out",
    ),
    (
        "return_tokens_as_token_ids",
        "tokens are returned as text (token_ids has the ids)",
    ),
    ("truncate_prompt_tokens", "prompts are never truncated"),
    ("allowed_token_ids", "use logit_bias"),
    ("bad_words", "use logit_bias"),
];

fn refuse_unsupported(body: &Value) -> Result<(), ApiError> {
    for &(field, why) in NOT_SUPPORTED {
        let at_default = match body.get(field) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => true,
            Some(Value::String(s)) => s.is_empty(),
            Some(Value::Number(n)) => field == "best_of" && n.as_u64() == Some(1),
            Some(_) => false,
        };
        if !at_default {
            return Err(ApiError::bad(field, format!("`{field}`: {why}")));
        }
    }
    Ok(())
}

/// One prompt of the request: its ids, and the text `echo` returns.
struct Prompt {
    ids: Vec<u32>,
    text: String,
}

/// How each choice is written.
#[derive(Clone, Copy)]
struct Shape {
    echo: bool,
    /// `logprobs: N` was given.
    logprobs: bool,
    /// `logprobs`' N: the top ids of each echoed prompt position.
    num_top: usize,
    /// vLLM's `prompt_logprobs: M`.
    prompt_logprobs: Option<usize>,
    /// `max_tokens: 0`: the engine drew one token, which no reply shows.
    no_completion: bool,
}

pub async fn completions(st: web::Data<ServerState>, body: web::Payload) -> HttpResponse {
    let result = completions_inner(&st, body).await;
    respond(&st, "completions", Flavor::OpenAi, result).await
}

async fn prompts(req: &CompletionRequest, text: &ModelText) -> Result<Vec<Prompt>, ApiError> {
    let decode = |ids: &[u32]| {
        text.tokenizer
            .as_ref()
            .and_then(|t| t.decode(ids, false).ok())
            .unwrap_or_default()
    };
    let texts = match &req.prompt {
        // Ids outside the vocabulary are refused by the engine (`EngineRequest::validate`).
        PromptField::Ids(ids) => {
            return Ok(vec![Prompt {
                text: decode(ids),
                ids: ids.clone(),
            }]);
        }
        PromptField::IdLists(lists) => {
            return Ok(lists
                .iter()
                .map(|ids| Prompt {
                    text: decode(ids),
                    ids: ids.clone(),
                })
                .collect());
        }
        PromptField::Text(t) => vec![t.clone()],
        PromptField::Texts(ts) => ts.clone(),
    };
    if texts.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt list is empty"));
    }
    let tok = text
        .tokenizer
        .clone()
        .ok_or_else(|| ApiError::bad("prompt", "this model has no tokenizer: send token ids"))?;
    let (parse, add) = (
        req.parse_special_tokens.unwrap_or(false),
        req.add_special_tokens.unwrap_or(true),
    );
    api::off_worker("prompt", move || {
        texts
            .into_iter()
            .map(|t| {
                let ids = tok
                    .encode_request_prompt(&t, parse, add)
                    .map_err(|e| ApiError::bad("prompt", e.to_string()))?;
                Ok(Prompt { ids, text: t })
            })
            .collect()
    })
    .await
}

async fn completions_inner(st: &ServerState, body: web::Payload) -> Result<HttpResponse, ApiError> {
    let body: Value = parse_body(&read_body(st, body).await?)?;
    refuse_unsupported(&body)?;
    let mut passes = Passes::new(&body);
    let mut req: CompletionRequest = passes.pass()?;
    req.sampling = passes.pass()?;
    // The fields `refuse_unsupported` let pass are at their defaults.
    let defaults: Vec<&str> = NOT_SUPPORTED.iter().map(|(f, _)| *f).collect();
    passes.finish(&defaults)?;
    check_chat_extras(&req.user, None)?;
    check_model(st, &req.model)?;
    let text = st.engine()?.text();
    let prompts = prompts(&req, text).await?;
    if req.stream && prompts.len() > 1 {
        return Err(ApiError::bad(
            "stream",
            "streaming takes one prompt; send a batch of prompts without `stream`",
        ));
    }
    let mut sampling = req.sampling.sampling()?;
    sampling.skip_special_tokens = req.skip_special_tokens;
    sampling.num_top_logprobs = req.logprobs.unwrap_or(0);
    let shape = Shape {
        echo: req.echo,
        logprobs: req.logprobs.is_some(),
        num_top: req.logprobs.unwrap_or(0),
        prompt_logprobs: req.prompt_logprobs,
        no_completion: sampling.max_tokens == Some(0),
    };
    if shape.no_completion {
        // The engine always draws a token; with none asked for, the prompt is the reply.
        sampling.max_tokens = Some(1);
    }
    // Every prompt is checked before any runs: a bad one is a 4xx naming it, nothing started.
    let engine = st.engine()?.clone();
    let mut requests = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let mut engine_req = api::engine_request(&sampling, p.ids.clone(), text)?;
        let echoed = req.logprobs.filter(|_| shape.echo);
        engine_req.prompt_logprobs = echoed.max(req.prompt_logprobs);
        engine_req
            .validate(engine.limits())
            .map_err(|e| in_batch(engine_error(EngineError::Rejected(e)), i, prompts.len()))?;
        requests.push(engine_req);
    }
    let num_prompt_tokens: usize = prompts.iter().map(|p| p.ids.len()).sum();
    // The first prompt is submitted now (its id names the reply); the others each as it
    // is admitted, so a batch larger than the engine's queue waits rather than blocks.
    let mut requests = requests.into_iter();
    let first = engine
        .generate(requests.next().expect("a prompt at least"))
        .await
        .map_err(engine_error)?;
    let id = format!("cmpl-{}", first.request_id);
    let (created, model) = (now_secs(), st.opts.served_model_name.clone());
    let n = sampling.n.unwrap_or(1);
    if req.stream {
        let include_usage = req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let stream = Timed::new(first, st, num_prompt_tokens);
        let prompt = prompts.into_iter().next().expect("one prompt");
        let counter = std::rc::Rc::new(std::cell::Cell::new(0usize));
        let counter_tail = counter.clone();
        let (id2, model2) = (id.clone(), model.clone());
        // Per choice: whether its first chunk (which carries the echoed prompt) went out.
        let mut started = vec![false; n];
        // Per choice: where its next token's text starts (offsets run across chunks).
        let mut text_offsets = vec![0usize; n];
        // Completion 0's first output carries the prompt's scores, ahead of its siblings'.
        let mut scores = None;
        let encode = move |o: &RequestOutput| {
            if let Some(err) = &o.error {
                return vec![SseEvent::data(
                    json!({"error": {"message": err, "type": "server_error"}}),
                )];
            }
            let choice = o.index.min(n - 1);
            let first = !std::mem::replace(&mut started[choice], true);
            if o.prompt_logprobs.is_some() {
                scores.clone_from(&o.prompt_logprobs);
            }
            let mut o = o.clone();
            if first && o.prompt_logprobs.is_none() {
                o.prompt_logprobs.clone_from(&scores);
            }
            let o = &o;
            let (text, logprobs, num_tokens) = choice_body(
                &prompt,
                o,
                shape,
                first,
                &mut text_offsets[choice],
                engine.text(),
            );
            counter.set(counter.get() + num_tokens);
            // A chunk whose tokens have no text yet (a character still open, or a model
            // without a tokenizer) still carries their ids.
            if text.is_empty() && o.token_ids.is_empty() && o.finish_reason.is_none() && !first {
                return Vec::new();
            }
            let mut choice = json!({"index": o.index, "text": text,
                "token_ids": if shape.no_completion { Vec::new() } else { o.token_ids.clone() },
                "logprobs": logprobs, "finish_reason": reason(shape, o)});
            if first && shape.prompt_logprobs.is_some() {
                choice["prompt_logprobs"] = vllm_prompt_logprobs(&prompt, o, shape, engine.text());
            }
            vec![SseEvent::data(
                json!({"id": id, "object": "text_completion", "created": created,
                "model": model, "choices": [choice]}),
            )]
        };
        let tail = move || {
            if !include_usage {
                return Vec::new();
            }
            vec![SseEvent::data(
                json!({"id": id2, "object": "text_completion", "created": created,
                "model": model2, "choices": [], "usage": usage(num_prompt_tokens, counter_tail.get())}),
            )]
        };
        return Ok(sse(stream, encode, tail, true));
    }
    let timer = Timer::of(st);
    let first = timer.time(first, prompts[0].ids.len());
    let later = requests.zip(&prompts[1..]).map(|(r, p)| {
        let (engine, timer, num_prompt_tokens) = (engine.clone(), timer.clone(), p.ids.len());
        async move {
            let stream = engine.generate(r).await.map_err(engine_error)?;
            timer.time(stream, num_prompt_tokens).collect_ok().await
        }
        .boxed_local()
    });
    let all = std::iter::once(first.collect_ok().boxed_local()).chain(later);
    let outs = futures_util::future::join_all(all.collect::<Vec<_>>());
    Ok(json_when_done(
        async move {
            let mut choices = Vec::new();
            let mut num_completion_tokens = 0;
            for (i, (prompt, outs)) in prompts.iter().zip(outs.await).enumerate() {
                let mut outs = outs?;
                // Completion 0 scored the prompt; its siblings echo the same scores.
                let scores = outs.first().and_then(|o| o.prompt_logprobs.clone());
                for c in &mut outs {
                    c.prompt_logprobs.clone_from(&scores);
                    let (text, logprobs, num_tokens) =
                        choice_body(prompt, c, shape, true, &mut 0, engine.text());
                    num_completion_tokens += num_tokens;
                    choices.push(json!({"index": i * n + c.index, "text": text,
                        "token_ids": if shape.no_completion { Vec::new() } else { c.token_ids.clone() },
                        "logprobs": logprobs, "finish_reason": reason(shape, c),
                        "stop_reason": c.stop_string,
                        "prompt_logprobs": vllm_prompt_logprobs(prompt, c, shape, engine.text())}));
                }
            }
            Ok(json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage(num_prompt_tokens, num_completion_tokens),
            }))
        },
        Flavor::OpenAi,
    ))
}

/// A batch's error names the prompt it is about.
fn in_batch(mut e: ApiError, index: usize, num_prompts: usize) -> ApiError {
    if num_prompts > 1 {
        e.message = format!("prompt {index}: {}", e.message);
        e.param = Some("prompt".into());
    }
    e
}

/// A choice's (or chunk's) text, logprobs and number of completion tokens: the echoed
/// prompt first when `first`, then the completion unless `max_tokens` was 0.
fn choice_body(
    prompt: &Prompt,
    o: &RequestOutput,
    shape: Shape,
    first: bool,
    text_offset: &mut usize,
    text: &ModelText,
) -> (String, Value, usize) {
    let echo = shape.echo && first;
    let mut body = if echo {
        prompt.text.clone()
    } else {
        String::new()
    };
    let mut lp = Logprobs::default();
    if echo && shape.logprobs {
        lp.push_prompt(prompt, o, shape.num_top, text);
    }
    let num_tokens = if shape.no_completion {
        0
    } else {
        body.push_str(&o.text);
        if shape.logprobs {
            lp.push_completion(o, text);
        }
        o.token_ids.len()
    };
    let logprobs = if shape.logprobs && text.tokenizer.is_some() {
        lp.into_json(text_offset)
    } else {
        Value::Null
    };
    (body, logprobs, num_tokens)
}

/// vLLM's `prompt_logprobs`: per prompt position `null` (the first) or
/// `{id: {logprob, rank, decoded_token}}` of its top M and the prompt token itself.
fn vllm_prompt_logprobs(
    prompt: &Prompt,
    o: &RequestOutput,
    shape: Shape,
    text: &ModelText,
) -> Value {
    let (Some(m), Some(scores)) = (shape.prompt_logprobs, o.prompt_logprobs.as_ref()) else {
        return Value::Null;
    };
    let entry = |lp: f32, rank: usize, id: u32| json!({"logprob": lp, "rank": rank, "decoded_token": piece(text, id)});
    Value::Array(
        scores
            .iter()
            .zip(&prompt.ids)
            .map(|(s, &id)| match s {
                None => Value::Null,
                Some(s) => {
                    let mut top: serde_json::Map<String, Value> = s
                        .top
                        .iter()
                        .take(m)
                        .enumerate()
                        .map(|(r, &(t, lp))| (t.to_string(), entry(lp, r + 1, t)))
                        .collect();
                    top.entry(id.to_string())
                        .or_insert_with(|| entry(s.logprob, s.rank as usize, id));
                    Value::Object(top)
                }
            })
            .collect(),
    )
}

/// A `max_tokens: 0` request ends by length, whatever its hidden token was.
fn reason(shape: Shape, o: &RequestOutput) -> Value {
    match o.finish_reason {
        Some(_) if shape.no_completion => finish_reason(Some(FinishReason::Length), 0),
        r => finish_reason(r, 0),
    }
}

/// The legacy `logprobs` object, token by token.
#[derive(Default)]
struct Logprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
}

impl Logprobs {
    /// The prompt's tokens: the first has no logprob (nothing precedes it); each top map
    /// holds the token itself beside the most likely ones, as vLLM's does.
    fn push_prompt(
        &mut self,
        prompt: &Prompt,
        o: &RequestOutput,
        num_top: usize,
        text: &ModelText,
    ) {
        let piece = |id: u32| piece(text, id);
        let scores = o.prompt_logprobs.as_deref().unwrap_or_default();
        for (j, &id) in prompt.ids.iter().enumerate() {
            self.tokens.push(piece(id));
            match scores.get(j).and_then(Option::as_ref) {
                Some(s) => {
                    let mut top: serde_json::Map<String, Value> = s
                        .top
                        .iter()
                        .take(num_top)
                        .map(|&(t, lp)| (piece(t), json!(lp)))
                        .collect();
                    top.entry(piece(id)).or_insert(json!(s.logprob));
                    self.token_logprobs.push(json!(s.logprob));
                    self.top_logprobs.push(Value::Object(top));
                }
                None => {
                    self.token_logprobs.push(Value::Null);
                    self.top_logprobs.push(Value::Null);
                }
            }
        }
    }

    fn push_completion(&mut self, o: &RequestOutput, text: &ModelText) {
        for (i, &id) in o.token_ids.iter().enumerate() {
            self.tokens.push(piece(text, id));
            self.token_logprobs
                .push(o.token_logprobs.get(i).map_or(Value::Null, |&lp| json!(lp)));
            let top = o.top_logprobs.get(i).into_iter().flatten();
            self.top_logprobs.push(Value::Object(
                top.map(|&(t, lp)| (piece(text, t), json!(lp))).collect(),
            ));
        }
    }

    /// `text_offset` is where the first token's text starts in the choice's text (in
    /// characters, as OpenAI counts); it is left after the last.
    fn into_json(self, text_offset: &mut usize) -> Value {
        let offsets: Vec<usize> = self
            .tokens
            .iter()
            .map(|t| {
                let at = *text_offset;
                *text_offset += t.chars().count();
                at
            })
            .collect();
        json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "top_logprobs": self.top_logprobs, "text_offset": offsets})
    }
}

fn piece(text: &ModelText, id: u32) -> String {
    text.tokenizer
        .as_ref()
        .and_then(|t| t.decode(&[id], false).ok())
        .unwrap_or_default()
}
