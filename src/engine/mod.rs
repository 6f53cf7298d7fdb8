//! The library API: `Engine::spawn` starts the actor system and returns an `EngineHandle`
//! to submit requests to, stream their outputs, abort them and shut down.

mod build;
mod config;
pub mod flags;
mod grammar;
mod image_engine;
mod kv_store;
mod pools;
mod request_stream;
mod speculation;

use crate::sync::OnceLock;
use crate::sync::Shared;

use ractor::{Actor, ActorRef};
use tokio::sync::{Semaphore, mpsc};

pub use crate::api::{
    EngineError, EngineRequest, EngineStatus, FinishReason, IncrementalDecoder, MAX_CHOICES,
    RequestError, RequestLimits, RequestOutput, TextStream,
};
pub use crate::kernels::Device;
pub use config::{
    DEFAULT_BLOCK_SIZE, EngineConfig, SpecAcceptance, SpecConfig, SpecMethod, SpecVerify,
};
pub use image_engine::ImageEngine;
pub use request_stream::RequestStream;

pub use crate::actors::scheduler::Detached;
use crate::actors::scheduler::{SchedulerArgs, SchedulerMsg};
use crate::actors::supervisor::{Children, EngineSupervisor, SupervisorArgs, SupervisorMsg};
use crate::api::{ChoiceText, PromptImage, RequestIds};
use crate::model::{self, ModelText};
use crate::runner::fault::FaultPlan;
use crate::runner::image_encoder::ImageEncoder;
use crate::runner::sampled_tokens::SampledTokens;
use crate::sampling::splitmix64;
use crate::step::with_virtual_ids;
use crate::store::KvStore;
use crate::structured::GrammarCompiler;
use speculation::{draft_model, mtp_drafts};

pub struct Engine;

/// How long a caller waits for an actor's answer (the scheduler answers a submit or a
/// status query between steps: milliseconds when healthy).
const CALL_TIMEOUT_MS: u64 = 30_000;

/// A failed call to `actor`, typed: a timeout names the actor that hung.
fn call_error<M>(actor: &'static str, e: ractor::RactorErr<M>) -> EngineError {
    match e {
        ractor::RactorErr::Timeout => EngineError::Unresponsive {
            actor,
            waited_ms: CALL_TIMEOUT_MS,
        },
        other => EngineError::Unavailable(format!("the {actor}: {other}")),
    }
}

#[derive(Clone)]
pub struct EngineHandle {
    supervisor: ActorRef<SupervisorMsg>,
    scheduler: ActorRef<SchedulerMsg>,
    permits: Shared<Semaphore>,
    request_ids: RequestIds,
    text: Shared<ModelText>,
    faults: FaultPlan,
    sampled: SampledTokens,
    /// Mixed into drawn seeds so two engine runs draw different ones.
    seed_entropy: u64,
    /// Built on the first structured-output request (the vocabulary trie takes a moment).
    grammars: Shared<OnceLock<Result<Shared<GrammarCompiler>, String>>>,
    /// The prefix store, where one is open: a cluster's engines move KV blocks through it.
    kv_store: Option<Shared<KvStore>>,
    /// A vision-language model's encoder and the actor that encodes requests' images ahead.
    images: Option<ImageEngine>,
}

impl Engine {
    pub async fn spawn(cfg: EngineConfig) -> Result<EngineHandle, EngineError> {
        Self::spawn_with_faults(cfg, FaultPlan::default()).await
    }

    /// As `spawn`, with a fault plan the tests drive.
    #[doc(hidden)]
    pub async fn spawn_with_faults(
        cfg: EngineConfig,
        faults: FaultPlan,
    ) -> Result<EngineHandle, EngineError> {
        build::check_config(&cfg)?;
        let mut text = model::load_text(&cfg.model_path)?;
        if cfg.dummy_weights {
            // No encoder weights to run (timing runs): the model takes no images.
            text.vision = None;
        }
        if let Some(tokens) = cfg.max_model_len {
            text.cap_context(tokens)?;
        }
        if let Some(source) = &cfg.chat_template {
            text.set_chat_template(source)
                .map_err(|e| EngineError::Spawn(format!("--chat-template: {e}")))?;
        }
        build::check_model(&cfg, &text)?;
        let draft = draft_model(&cfg, &text)?;
        let mtp = mtp_drafts(&cfg, &text)?;
        let pools = pools::size_pools(&cfg, &text, build::kv_budget(&cfg, &text, draft.as_ref())?)?;
        let kv_store = kv_store::open_kv_store(
            &cfg,
            &text.config,
            &pools,
            text.deepseek_v4.is_some(),
            draft.is_some(),
        )?;
        // Loaded once for all ranks (they share its rows); no weights to load under dummy ones.
        let image_encoder = match (&text.vision, cfg.dummy_weights) {
            (Some(_), false) => ImageEncoder::load(&cfg.model_path, cfg.device)?.map(Shared::new),
            _ => None,
        };
        let sampled = SampledTokens::new();
        let scheduler = build::scheduler_config(&cfg, &text, &pools, draft.as_ref(), mtp)?;
        let num_speculative_tokens = scheduler.num_speculative_tokens;
        let args = SupervisorArgs {
            scheduler: SchedulerArgs {
                config: scheduler,
                zero_overhead_scheduling: cfg.zero_overhead_scheduling,
                rejection_acceptance: cfg
                    .speculative
                    .is_some_and(|s| s.acceptance == SpecAcceptance::Rejection),
                samples_on_device: matches!(cfg.device, Device::Cuda(_)),
                sampled: sampled.clone(),
                stop_ids: text.stop_ids.clone(),
                kv_store: kv_store.clone(),
                queue_timeout: cfg.queue_timeout,
            },
            rank: build::rank_settings(
                &cfg,
                &text,
                &pools,
                (faults.clone(), kv_store.clone(), image_encoder.clone()),
                (draft.is_some(), mtp, num_speculative_tokens),
            ),
            max_rank_restarts: cfg.max_rank_restarts,
            rank_restart_window: cfg.rank_restart_window,
        };
        let (supervisor, _) = Actor::spawn(None, EngineSupervisor, args)
            .await
            .map_err(|e| EngineError::Spawn(e.to_string()))?;
        let children = ractor::call_t!(supervisor, SupervisorMsg::Children, CALL_TIMEOUT_MS)
            .map_err(|e| EngineError::Spawn(call_error("supervisor", e).to_string()))?;
        let images = match (image_encoder, &text.vision) {
            (Some(encoder), Some(vision)) => {
                Some(ImageEngine::start(vision.clone(), encoder).await?)
            }
            _ => None,
        };
        Ok(EngineHandle {
            supervisor,
            scheduler: children.scheduler,
            permits: Shared::new(Semaphore::new(cfg.max_pending_requests.max(1))),
            request_ids: RequestIds::default(),
            text: Shared::new(text),
            faults,
            sampled,
            seed_entropy: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            grammars: Shared::new(OnceLock::new()),
            kv_store,
            images,
        })
    }
}

/// The KV cache's budget: as configured, or on a GPU with `kv_cache_bytes == 0`, what is
/// left of `gpu_memory_utilization` of the free memory after the bf16 weights and a margin
/// for activations and cuBLAS.
fn kv_cache_bytes(
    cfg: &EngineConfig,
    m: &model::config::ModelConfig,
) -> Result<usize, EngineError> {
    match cfg.device {
        Device::Cpu if cfg.kv_cache_bytes == 0 => Err(EngineError::Spawn(
            "kv_cache_bytes must be positive on the CPU".into(),
        )),
        Device::Cpu => Ok(cfg.kv_cache_bytes),
        Device::Cuda(_) if cfg.kv_cache_bytes > 0 => Ok(cfg.kv_cache_bytes),
        Device::Cuda(ordinal) => {
            let free = gpu_free_bytes(ordinal)?;
            let (h, l) = (m.hidden_size, m.num_layers);
            let per_layer = h * m.q_dim() * 2 + 2 * h * m.kv_dim() + 3 * h * m.intermediate_size;
            let embeddings = m.vocab_size * h * if m.tie_word_embeddings { 1 } else { 2 };
            let weight_bytes = 2 * (l * per_layer + embeddings);
            let budget = (free as f64 * cfg.gpu_memory_utilization) as usize;
            budget
                .checked_sub(weight_bytes + (2 << 30))
                .filter(|&b| b > 0)
                .ok_or_else(|| {
                    EngineError::Spawn(format!(
                        "GPU {ordinal}: {free} bytes free, {weight_bytes} bytes of weights: no room for a KV cache"
                    ))
                })
        }
    }
}

fn gpu_free_bytes(ordinal: usize) -> Result<usize, EngineError> {
    crate::kernels::cuda::gpu_free_bytes(ordinal).map_err(EngineError::Spawn)
}

impl EngineHandle {
    pub fn text(&self) -> &ModelText {
        &self.text
    }

    pub fn kv_store(&self) -> Option<&KvStore> {
        self.kv_store.as_deref()
    }

    pub fn text_shared(&self) -> Shared<ModelText> {
        self.text.clone()
    }

    /// What requests to this engine are checked against.
    pub fn limits(&self) -> RequestLimits {
        RequestLimits {
            vocab_size: self.text.config.vocab_size,
            max_context_tokens: self.text.config.max_context_tokens,
            scores_prompts: self.text.scores_prompts(),
            images: crate::api::ImageLimits::of(&self.text),
        }
    }

    pub async fn generate(&self, mut request: EngineRequest) -> Result<RequestStream, EngineError> {
        request.validate(self.limits())?;
        // Compiling takes milliseconds to seconds of CPU: not on the caller's async worker.
        let grammar = match request.grammar.clone() {
            None => None,
            Some(spec) => {
                let this = self.clone();
                let compiled = tokio::task::spawn_blocking(move || this.compile_grammar(&spec))
                    .await
                    .map_err(|e| EngineError::Unavailable(format!("grammar compilation: {e}")))?;
                Some(compiled?)
            }
        };
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| EngineError::Unavailable("the engine is shut down".into()))?;
        if let Some(images) = &self.images {
            // Encoded while the request waits and prefills what comes before its images.
            images.encode_ahead(self.images_to_encode(&request));
        }
        let request_id = self.request_ids.next();
        // Unseeded requests get a seed now, reported back, so any run can be replayed.
        let seed = *request
            .seed
            .get_or_insert_with(|| splitmix64(self.seed_entropy ^ splitmix64(request_id)));
        let choices = self.choice_texts(&request);
        let (tx, rx) = mpsc::unbounded_channel();
        let submit = |reply| SchedulerMsg::Submit {
            request_id,
            request: Box::new(request),
            grammar,
            stream: tx,
            reply,
            span: tracing::Span::current(),
        };
        let submitted = ractor::call_t!(self.scheduler, submit, CALL_TIMEOUT_MS)
            .map_err(|e| call_error("scheduler", e))?;
        submitted?;
        Ok(RequestStream::new(
            request_id,
            seed,
            rx,
            self.scheduler.clone(),
            self.text.tokenizer.clone(),
            choices,
            permit,
        ))
    }

    /// Each completion's text stream: the request's stop strings, and the ids that end it
    /// (the model's unless `ignore_eos`, plus the request's own).
    fn choice_texts(&self, request: &EngineRequest) -> Vec<ChoiceText> {
        let model_stop_ids: &[u32] = if request.ignore_eos {
            &[]
        } else {
            &self.text.stop_ids
        };
        let stop_ids: Vec<u32> = model_stop_ids
            .iter()
            .chain(&request.stop_token_ids)
            .copied()
            .collect();
        // DeepSeek-V4 writes its tool calls and reasoning with special tokens: kept as text.
        let keep_special_tokens = request
            .skip_special_tokens
            .map_or(self.text.deepseek_v4.is_some(), |skip| !skip);
        (0..request.n.max(1))
            .map(|_| ChoiceText::new(request.stop.clone(), stop_ids.clone(), keep_special_tokens))
            .collect()
    }

    /// Ends every request in flight with `reason` as its error, and refuses new ones with
    /// it: for a shutdown that cannot wait any longer.
    pub async fn cancel_all(&self, reason: String) {
        let _ = self.scheduler.cast(SchedulerMsg::CancelAll { reason });
    }

    pub fn abort(&self, request_id: u64) {
        let _ = self.scheduler.cast(SchedulerMsg::Abort { request_id });
    }

    /// Runs all requests concurrently; results come back in request order. A progress bar
    /// shows on stderr when it is a terminal.
    pub async fn generate_batch(
        &self,
        requests: Vec<EngineRequest>,
    ) -> Vec<Result<RequestOutput, EngineError>> {
        let bar = indicatif::ProgressBar::new(requests.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {pos}/{len} requests [{elapsed_precise}]",
            )
            .expect("static template"),
        );
        let mut tasks = Vec::with_capacity(requests.len());
        for r in requests {
            let this = self.clone();
            let bar = bar.clone();
            tasks.push(tokio::spawn(async move {
                let out = match this.generate(r).await {
                    Ok(stream) => Ok(stream.collect().await),
                    Err(e) => Err(e),
                };
                bar.inc(1);
                out
            }));
        }
        let mut results = Vec::with_capacity(tasks.len());
        for t in tasks {
            results.push(
                t.await
                    .unwrap_or_else(|e| Err(EngineError::Unavailable(e.to_string()))),
            );
        }
        bar.finish_and_clear();
        results
    }

    pub async fn status(&self) -> Result<EngineStatus, EngineError> {
        let mut status = ractor::call_t!(self.scheduler, SchedulerMsg::Status, CALL_TIMEOUT_MS)
            .map_err(|e| call_error("scheduler", e))?;
        if let Some(images) = &self.images {
            let stats = images.stats();
            status.num_encoded_images = stats.num_encoded;
            status.num_image_cache_hits = stats.num_hits;
            status.num_received_images = stats.num_received;
        }
        Ok(status)
    }

    /// The request's images but those whose last token's block the prefix store holds (a
    /// prefill engine handed it over): the ranks read rows only for tokens they compute.
    fn images_to_encode(&self, request: &EngineRequest) -> Vec<PromptImage> {
        let (images, store) = (&request.images, self.kv_store.as_deref());
        let tokens = store.map(|_| with_virtual_ids(&request.prompt_ids, images));
        (images.iter())
            .filter(|i| match (store, &tokens) {
                (Some(store), Some(tokens)) => !store.may_have_token(tokens, 0, i.end_token() - 1),
                _ => true,
            })
            .cloned()
            .collect()
    }

    /// The engine's vision side; `None` for a model that takes no images.
    pub fn images(&self) -> Option<&ImageEngine> {
        self.images.as_ref()
    }

    /// The chain hashes of the blocks its prefix cache holds (`sched::block_hash`).
    pub async fn cached_block_hashes(&self) -> Result<Vec<u64>, EngineError> {
        ractor::call_t!(self.scheduler, SchedulerMsg::CachedBlocks, CALL_TIMEOUT_MS)
            .map_err(|e| call_error("scheduler", e))
    }

    /// Returns once the prefix store holds every block the engine has registered so far
    /// (those it still has room for).
    pub async fn flush_kv_saves(&self) -> Result<(), EngineError> {
        ractor::call_t!(self.scheduler, SchedulerMsg::FlushKvSaves, CALL_TIMEOUT_MS)
            .map_err(|e| call_error("scheduler", e))
    }

    /// Takes every request a peer can continue exactly out of the engine (`serve
    /// --drain-to`): each with its generated tokens and its caller's channel.
    pub async fn detach_movable(&self) -> Result<Vec<Detached>, EngineError> {
        ractor::call_t!(self.scheduler, SchedulerMsg::Detach, CALL_TIMEOUT_MS)
            .map_err(|e| call_error("scheduler", e))
    }

    /// Stops the engine: with `drain`, after every request in flight has finished;
    /// without, at once (requests end with an error).
    pub async fn shutdown(self, drain: bool) {
        if drain {
            // No timeout: draining waits for the requests in flight, each bounded by its
            // own max_tokens.
            let _ = ractor::call!(self.scheduler, SchedulerMsg::Drain);
        }
        self.permits.close();
        // Wake a rank worker waiting on tokens of a step that will never be sampled, so
        // its thread (and its weights and KV cache) can go.
        self.sampled.invalidate();
        if let Some(images) = &self.images {
            images.stop().await;
        }
        let _ = self.supervisor.stop_and_wait(None, None).await;
        // The ranks' communicators are aborted on threads that finish once the ranks'
        // decode graphs are gone; a process exiting under them crashes.
        if !tokio::task::spawn_blocking(|| {
            crate::kernels::cuda::nccl::wait_for_aborts(std::time::Duration::from_secs(10))
        })
        .await
        .unwrap_or(false)
        {
            tracing::warn!("an NCCL communicator abort did not finish within 10 s");
        }
    }

    #[doc(hidden)]
    pub fn faults(&self) -> &FaultPlan {
        &self.faults
    }

    #[doc(hidden)]
    pub async fn children(&self) -> Result<Children, EngineError> {
        ractor::call_t!(self.supervisor, SupervisorMsg::Children, CALL_TIMEOUT_MS)
            .map_err(|e| call_error("supervisor", e))
    }
}
