//! The actor system. `EngineSupervisor` spawns and links a `SchedulerActor` (a shell around
//! `sched::Scheduler`), a `SamplerActor`, and one `RankWorker` per rank, each rank on its
//! own OS thread. Messages are one typed enum per actor and step-sized: plans and logits
//! travel as `Arc`s, tokens reach callers through per-request channels. A vision-language
//! model's engine also runs an `EncoderActor` that encodes each request's images ahead.

pub mod image_encoder;
pub mod rank_worker;
pub mod sampler;
pub mod scheduler;
pub mod supervisor;
