//! The actor system (supervisor, scheduler, rank workers, sampler) arrives with the
//! engine-core issue; until then `generate` runs the step loop synchronously.
