//! The router's side of E/P/D: a request's images sent to an encode engine, which sends
//! their rows to the engines that read them; its prompt (and images) prefilled on a prefill
//! engine, which hands the KV to the decode engine that answers. Either failing only moves
//! the work back: the answering engine encodes and prefills what it did not get.

use actix_web::web;

use super::agent::{AgentMsg, EngineReport, agent_group};
use super::image_transfer::{EncodeAsk, EncodeDone};
use super::in_flight::InFlightCounts;
use super::kv_transfer::{HandOff, MAX_BLOCK_BYTES, PrefillAsk};
use super::request_view::RequestView;
use super::router_state::RouterState;
use crate::route::{EngineLoad, pick_encoder};

/// How long a prefill engine may take to prefill a prompt and hand its KV over.
const HAND_OFF_TIMEOUT_MS: u64 = 600_000;
/// How long an encode engine may take to encode a request's images and send the rows.
const ENCODE_TIMEOUT_MS: u64 = 120_000;

/// `view`'s images encoded on the encode engine with the fewest patches in flight (if the
/// cluster has one) and their rows sent to each engine of `deliver_to`, which would
/// otherwise encode them itself — as they do when this fails.
pub(super) async fn encode_remote(
    st: &web::Data<RouterState>,
    reports: &[EngineReport],
    loads: &[EngineLoad],
    view: &RequestView,
    deliver_to: Vec<String>,
) {
    let in_flight: Vec<usize> = reports
        .iter()
        .map(|r| st.patches_in_flight.get(&r.node_name))
        .collect();
    let Some(pick) = pick_encoder(loads, &in_flight) else {
        return;
    };
    let encoder = &reports[pick];
    let _counted = InFlightCounts::enter_weighted(
        &st.patches_in_flight,
        &encoder.node_name,
        view.num_patches(),
    );
    let ask = EncodeAsk {
        images: view.image_files(),
        deliver_to,
    };
    let ask = serde_json::to_string(&ask).unwrap_or_default();
    let done = match ractor::pg::get_members(&agent_group(&encoder.node_name)).pop() {
        // Past a frame of the transport: the engines encode them.
        _ if ask.len() > MAX_BLOCK_BYTES => Err("the images are past a frame".to_string()),
        None => Err("its agent left the cluster".to_string()),
        Some(cell) => {
            let agent: ractor::ActorRef<AgentMsg> = cell.into();
            match ractor::call_t!(agent, AgentMsg::EncodeImages, ENCODE_TIMEOUT_MS, ask) {
                Ok(answer) => serde_json::from_str::<EncodeDone>(&answer)
                    .map_err(|_| answer)
                    .and_then(|d| d.error.clone().map_or(Ok(d), Err)),
                Err(e) => {
                    st.registry.forget(&encoder.node_name);
                    Err(e.to_string())
                }
            }
        }
    };
    match done {
        Ok(d) => st.count(|c| {
            *c.encoded_images
                .entry(encoder.node_name.clone())
                .or_default() += d.num_images as u64;
        }),
        Err(e) => {
            tracing::warn!(
                "router: encode engine {} did not encode a request's images ({e}); the engines that read them encode them",
                encoder.node_name
            );
            st.count(|c| c.failed_encodes += 1);
        }
    }
}

/// The prompt (and its images) prefilled on `prefill` and its KV handed to `decode`; on
/// failure the decode engine prefills it itself (counted).
pub(super) async fn hand_off(
    st: &web::Data<RouterState>,
    prefill: &EngineReport,
    decode: &EngineReport,
    prompt: &[u32],
    view: &RequestView,
) {
    let _counted = InFlightCounts::enter(&st.in_flight, &prefill.node_name);
    let ask = PrefillAsk {
        prompt_ids: prompt.to_vec(),
        decode_node: decode.node_name.clone(),
        images: view.image_files(),
    };
    let ask = serde_json::to_string(&ask).unwrap_or_default();
    let done = match ractor::pg::get_members(&agent_group(&prefill.node_name)).pop() {
        _ if ask.len() > MAX_BLOCK_BYTES => Err("the ask is past a frame".to_string()),
        None => Err("its agent left the cluster".to_string()),
        Some(cell) => {
            let agent: ractor::ActorRef<AgentMsg> = cell.into();
            match ractor::call_t!(agent, AgentMsg::Prefill, HAND_OFF_TIMEOUT_MS, ask) {
                Ok(answer) => serde_json::from_str::<HandOff>(&answer).map_err(|_| answer),
                Err(e) => Err(e.to_string()),
            }
        }
    };
    match done {
        Ok(h) => st.count(|c| {
            *c.hand_offs.entry(prefill.node_name.clone()).or_default() += 1;
            *c.hand_offs_by_transport
                .entry(h.transport.clone())
                .or_default() += 1;
            c.kv_blocks_moved += h.num_blocks as u64;
            c.kv_bytes_moved += h.bytes;
            c.kv_transfer_secs += h.transfer_secs;
        }),
        Err(e) => {
            tracing::warn!(
                "router: hand-off from {} to {}: {e}",
                prefill.node_name,
                decode.node_name
            );
            st.count(|c| c.failed_hand_offs += 1);
        }
    }
}
