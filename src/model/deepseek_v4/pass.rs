//! What every block of one forward pass reads besides its own weights: the backend, the
//! config, the model's constants on the device, the step's plan and the experts kept in
//! host memory. Blocks, attention and the MoE all take it; it imports none of them.

use super::config::DsV4Config;
use super::host_experts::HostExperts;
use super::plan::Plan;
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::kernels::host_calls::HostCalls;

/// What a pass's blocks read besides their weights: the backend, the config, the RoPE
/// frequencies, the step's plan.
pub struct Pass<'a, B: DsV4Kernels> {
    pub b: &'a B,
    pub cfg: &'a DsV4Config,
    pub consts: &'a Consts<B>,
    pub plan: &'a Plan<B>,
    /// The routed experts kept in host memory (`host_experts.rs`), if any.
    pub host: Option<&'a HostExperts<B>>,
    /// In a recorded step, how the host's part runs: as calls on the device's stream.
    pub host_calls: Option<&'a dyn HostCalls<B::Buf, B::Ids>>,
}

/// Per model, on its device: the RoPE frequencies and ones for the norms without weight.
pub struct Consts<B: DsV4Kernels> {
    pub main_freqs: B::Buf,
    pub compress_freqs: B::Buf,
    /// As wide as the flat streams or a head, whichever is wider.
    pub ones: B::Buf,
}

impl<B: DsV4Kernels> Consts<B> {
    pub fn new(b: &B, cfg: &DsV4Config) -> Self {
        let freqs = |spec| b.upload(&super::rope::inv_freqs(spec, cfg.rope_head_dim));
        Consts {
            main_freqs: freqs(&cfg.main_rope),
            compress_freqs: freqs(&cfg.compress_rope),
            ones: b.upload(&vec![
                1.0;
                (cfg.hc_mult * cfg.hidden_size).max(cfg.head_dim)
            ]),
        }
    }
}
