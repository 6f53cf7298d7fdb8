//! The router's state: the engines' reports, the served model's text side (prompts hashed
//! as the engines hash them), the counters and what is in flight to each engine; the
//! route of a request over the engines' loads.

use super::agent::EngineReport;
use super::in_flight::InFlightCounts;
use super::registry::{Registry, load_of};
use super::request_view::RequestView;
use super::router_metrics::Counters;
use crate::model::ModelText;
use crate::route::{EngineLoad, Route, RouteConfig, pick_route, prompt_block_hashes};
use crate::sync::{Mutex, Shared};

/// What the router's handlers share.
pub struct RouterState {
    pub registry: Shared<Registry>,
    /// The served model's tokenizer and template: prompts are hashed as the engines do.
    pub text: ModelText,
    pub cfg: RouteConfig,
    pub(super) client: reqwest::Client,
    counters: Mutex<Counters>,
    /// Requests forwarded and not yet answered in full, by node name.
    pub(super) in_flight: Shared<InFlightCounts>,
    /// Image patches sent to each encode engine and not yet encoded, by node name.
    pub(super) patches_in_flight: Shared<InFlightCounts>,
    /// Host header values accepted (`None`: any), as `serve` checks them.
    pub(super) allowed_hosts: Option<Vec<String>>,
    /// Keys a client must send (`--api-key`; none: the door is open).
    pub api_keys: Vec<String>,
}

impl RouterState {
    pub fn new(
        registry: Shared<Registry>,
        text: ModelText,
        allowed_hosts: Option<Vec<String>>,
    ) -> Self {
        RouterState {
            registry,
            text,
            cfg: RouteConfig::default(),
            // Engines are reached directly: no proxy from the environment, no redirects.
            client: reqwest::Client::builder()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(std::time::Duration::from_secs(2))
                .build()
                .expect("a plain HTTP client"),
            counters: Mutex::new(Counters::default()),
            in_flight: Shared::new(InFlightCounts::default()),
            patches_in_flight: Shared::new(InFlightCounts::default()),
            allowed_hosts,
            api_keys: Vec::new(),
        }
    }

    /// The request's route: by prefix and work where its prompt is known, by load
    /// otherwise.
    pub(super) fn route(&self, loads: &[EngineLoad], view: &RequestView) -> Option<Route> {
        match (&view.prompt, view.num_prompt_tokens()) {
            (Some(ids), Some(len)) => {
                let block_size = loads.first()?.block_size;
                // An image's blocks are named by its content: only those before the
                // first image match the engines'.
                let hashes = prompt_block_hashes(ids, block_size);
                pick_route(&self.cfg, loads, Some((&hashes, len)))
            }
            _ => pick_route(&self.cfg, loads, None),
        }
    }

    /// The engines' last reports as the rules read them: requests in flight added to
    /// each engine's load, the engines passed over for this request not alive.
    pub(super) fn loads(
        &self,
        reports: &[EngineReport],
        passed_over: &[String],
    ) -> Vec<EngineLoad> {
        reports
            .iter()
            .map(|r| {
                let mut load = load_of(r);
                load.num_running += self.in_flight.get(&r.node_name);
                load.alive &= !passed_over.contains(&r.node_name);
                load
            })
            .collect()
    }

    pub(super) fn count(&self, f: impl FnOnce(&mut Counters)) {
        f(&mut self.counters.lock().expect("router lock"));
    }

    pub fn counters(&self) -> Counters {
        self.counters.lock().expect("router lock").clone()
    }
}
