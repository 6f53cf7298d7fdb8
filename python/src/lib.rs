//! `troupe._troupe`: the engine behind the Python package. Requests and outputs cross as
//! JSON text (`troupe/__init__.py` builds vLLM-shaped objects from it), so the boundary
//! is a handful of string-taking methods; every blocking wait lets go of the GIL.

use base64::Engine as _;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use serde_json::{Value, json};
use troupe::engine::{
    Engine as TroupeEngine, EngineError, EngineHandle, EngineRequest, RequestOutput,
};
use troupe::model::ModelText;
use troupe::protocol::openai::{ChatRequest, chat_conversation};
use troupe::sync::Mutex;
use troupe::sync::atomic::{AtomicBool, Ordering};

mod request;

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A refused request is the caller's mistake (`ValueError`); an engine that is gone or
/// failed is not (`RuntimeError`).
fn engine_error(e: EngineError) -> PyErr {
    match e {
        EngineError::Rejected(_) => value_error(e),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// How long dropping an engine waits for it to stop.
const DROP_SHUTDOWN_SECS: u64 = 30;

/// One engine: its actors on a runtime of their own.
#[pyclass(frozen)]
struct Engine {
    runtime: tokio::runtime::Runtime,
    handle: EngineHandle,
    /// `shutdown` ran: dropping the engine has nothing left to stop.
    stopped: AtomicBool,
}

impl Drop for Engine {
    /// An `LLM` garbage-collected (or left at exit) stops its engine as `shutdown` does,
    /// without draining: its ranks release their memory and communicators before the
    /// runtime under them goes.
    fn drop(&mut self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let handle = self.handle.clone();
        let limit = std::time::Duration::from_secs(DROP_SHUTDOWN_SECS);
        let _ = self
            .runtime
            .block_on(async move { tokio::time::timeout(limit, handle.shutdown(false)).await });
    }
}

#[pymethods]
impl Engine {
    /// `model` as `--model` takes it; `flags` the engine's command-line flags.
    #[new]
    fn new(py: Python<'_>, model: String, flags: Vec<String>) -> PyResult<Self> {
        py.detach(move || {
            let cfg = troupe::engine::flags::engine_config(&model, &flags).map_err(value_error)?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| PyRuntimeError::new_err(format!("cannot start a runtime: {e}")))?;
            let handle = runtime
                .block_on(TroupeEngine::spawn(cfg))
                .map_err(engine_error)?;
            Ok(Engine {
                runtime,
                handle,
                stopped: AtomicBool::new(false),
            })
        })
    }

    /// The model's context, in tokens.
    #[getter]
    fn max_model_len(&self) -> usize {
        self.handle.text().config.max_context_tokens
    }

    /// Requests admitted and not finished, running or waiting (vLLM's
    /// `get_num_unfinished_requests`).
    fn num_unfinished_requests(&self, py: Python<'_>) -> PyResult<usize> {
        let status = py
            .detach(|| self.runtime.block_on(self.handle.status()))
            .map_err(engine_error)?;
        Ok(status.num_running + status.num_waiting)
    }

    /// Token ids of `text` as a completion prompt (the model's BOS where it adds one).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        tokenizer(self.handle.text())?
            .encode_prompt(text)
            .map_err(value_error)
    }

    fn decode(&self, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        tokenizer(self.handle.text())?
            .decode(&ids, skip_special_tokens)
            .map_err(value_error)
    }

    /// A chat (`{"messages": [...], "tools": ...}`, as Chat Completions takes it) rendered
    /// exactly as the server renders it: `{"prompt_token_ids", "images"}`, one placeholder
    /// per image, each image's bytes as base64 (its `data:` URL's).
    fn chat_prompt(&self, chat_json: &str) -> PyResult<String> {
        let req: ChatRequest = serde_json::from_str(chat_json).map_err(value_error)?;
        let conv = chat_conversation(&req).map_err(|e| value_error(e.message))?;
        if let Some(remote) = conv.images.iter().find(|i| i.url.is_some()) {
            return Err(value_error(format!(
                "{}: the offline API fetches no image URLs; give a base64 `data:` URL",
                remote.field
            )));
        }
        let ids = conv
            .to_prompt_ids(self.handle.text())
            .map_err(value_error)?;
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
        let images: Vec<String> = conv.images.iter().map(|i| b64(&i.bytes)).collect();
        Ok(json!({"prompt_token_ids": ids, "images": images}).to_string())
    }

    /// Runs `requests_json` (a list of `{"prompt_token_ids", "params", "images"}`)
    /// together, and returns each one's prompt (widened over its images) and completions.
    fn generate(&self, py: Python<'_>, requests_json: &str) -> PyResult<String> {
        let requests: Vec<Value> = serde_json::from_str(requests_json).map_err(value_error)?;
        let text = self.handle.text();
        let requests = requests
            .iter()
            .map(|r| request::engine_request(r, text))
            .collect::<PyResult<Vec<EngineRequest>>>()?;
        let prompts: Vec<Vec<u32>> = requests.iter().map(|r| r.prompt_ids.clone()).collect();
        let handle = self.handle.clone();
        let outputs = py.detach(|| {
            self.runtime.block_on(async move {
                // Each request waits for its own admission: a batch larger than the
                // engine's queue runs as room frees up.
                let runs = requests.into_iter().map(|r| {
                    let handle = handle.clone();
                    async move {
                        let stream = handle.generate(r).await.map_err(engine_error)?;
                        Ok::<_, PyErr>(stream.collect_choices().await)
                    }
                });
                futures_util::future::join_all(runs)
                    .await
                    .into_iter()
                    .collect::<PyResult<Vec<_>>>()
            })
        })?;
        let out: Vec<Value> = outputs
            .iter()
            .zip(prompts)
            .map(|(choices, prompt)| {
                let choices: Vec<Value> = choices.iter().map(|c| output_json(c, text)).collect();
                json!({"prompt_token_ids": prompt, "choices": choices})
            })
            .collect();
        Ok(Value::Array(out).to_string())
    }

    /// One request (`{"prompt_token_ids", "params", "images"}`) whose outputs arrive as
    /// they are generated.
    fn stream(&self, py: Python<'_>, request_json: &str) -> PyResult<Stream> {
        let request: Value = serde_json::from_str(request_json).map_err(value_error)?;
        let request = request::engine_request(&request, self.handle.text())?;
        let prompt_token_ids = request.prompt_ids.clone();
        let handle = self.handle.clone();
        let stream = py.detach(|| {
            self.runtime
                .block_on(async move { handle.generate(request).await })
                .map_err(engine_error)
        })?;
        Ok(Stream {
            prompt_token_ids,
            runtime: self.runtime.handle().clone(),
            stream: Mutex::new(Some(stream)),
            text: self.handle.text_shared(),
        })
    }

    /// Stops the engine after what is in flight.
    fn shutdown(&self, py: Python<'_>) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let handle = self.handle.clone();
        py.detach(|| self.runtime.block_on(handle.shutdown(true)));
    }
}

/// A streaming request's outputs, one increment at a time (`None` after the last).
#[pyclass(frozen)]
struct Stream {
    /// The prompt as the engine runs it (widened over its images).
    #[pyo3(get)]
    prompt_token_ids: Vec<u32>,
    runtime: tokio::runtime::Handle,
    stream: Mutex<Option<troupe::engine::RequestStream>>,
    text: troupe::sync::Shared<ModelText>,
}

#[pymethods]
impl Stream {
    fn next(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let mut guard = self
            .stream
            .lock()
            .map_err(|_| PyRuntimeError::new_err("a stream's reader panicked"))?;
        let Some(stream) = guard.as_mut() else {
            return Ok(None);
        };
        let out = py.detach(|| self.runtime.block_on(stream.next()));
        match out {
            Some(o) => Ok(Some(output_json(&o, &self.text).to_string())),
            None => {
                // Dropping the stream of a finished request aborts nothing.
                *guard = None;
                Ok(None)
            }
        }
    }

    /// Ends the request early (the engine aborts it and frees its blocks).
    fn close(&self) {
        if let Ok(mut guard) = self.stream.lock() {
            guard.take();
        }
    }
}

fn tokenizer(text: &ModelText) -> PyResult<&troupe::model::tokenizer::Tokenizer> {
    text.tokenizer
        .as_deref()
        .ok_or_else(|| value_error("this model has no tokenizer: give prompt_token_ids"))
}

/// An output (one completion's, or one increment of it) with each id's text beside it.
fn output_json(o: &RequestOutput, text: &ModelText) -> Value {
    let piece = |id: u32| {
        text.tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .unwrap_or_default()
    };
    let pairs = |top: &[(u32, f32)]| -> Vec<Value> {
        top.iter()
            .map(|&(id, lp)| json!([id, lp, piece(id)]))
            .collect()
    };
    let finish_reason = o.finish_reason.map(|r| match r {
        troupe::engine::FinishReason::Stop => "stop",
        troupe::engine::FinishReason::Length | troupe::engine::FinishReason::Preempted => "length",
        troupe::engine::FinishReason::Abort => "abort",
    });
    json!({
        "index": o.index,
        "text": o.text,
        "token_ids": o.token_ids,
        "token_pieces": o.token_ids.iter().map(|&id| piece(id)).collect::<Vec<_>>(),
        "token_logprobs": o.token_logprobs,
        "top_logprobs": o.top_logprobs.iter().map(|t| pairs(t)).collect::<Vec<_>>(),
        "prompt_logprobs": o.prompt_logprobs.as_ref().map(|scores| {
            scores.iter().map(|s| s.as_ref().map(|s| json!({
                "logprob": s.logprob, "rank": s.rank, "top": pairs(&s.top),
            }))).collect::<Vec<_>>()
        }),
        "finish_reason": finish_reason,
        "stop_reason": o.stop_string,
        "seed": o.seed,
        "error": o.error,
    })
}

/// The long names of the engine's flags: what `troupe.LLM` takes as keywords.
#[pyfunction]
fn engine_flag_names() -> Vec<String> {
    troupe::engine::flags::engine_flag_names()
}

/// `troupe` on the command line: `argv` as `sys.argv` has it.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| troupe::cli::main_from(argv.into_iter().map(Into::into)))
}

#[pymodule]
fn _troupe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<Stream>()?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(engine_flag_names, m)?)?;
    m.add("MAX_TOP_LOGPROBS", troupe::sampling::MAX_TOP_LOGPROBS)?;
    Ok(())
}
