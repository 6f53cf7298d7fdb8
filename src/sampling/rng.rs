//! Counter-based randomness: every draw is a hash of (seed, position, stream), never the
//! next value of a shared generator, so a request's draws depend only on its own seed and
//! the positions it samples at — not on the batch it shares, its order, or the thread.

/// The stream of the token draw itself (`Sampler::sample_row`). Stays 0: seeded outputs
/// recorded before the other streams existed were drawn from it.
pub const STREAM_SAMPLE: u64 = 0;
/// Draft-token proposals (speculative decoding).
pub const STREAM_DRAFT: u64 = 1;
/// Acceptance tests of draft tokens (speculative decoding).
pub const STREAM_ACCEPT: u64 = 2;
/// Per-token Gumbel noise of the coupled speculative mode (`spec::gumbel_pick`).
pub const STREAM_GUMBEL: u64 = 3;

/// SplitMix64's finalizer: a strong 64-bit mix, the basis of counter-based draws.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from (seed, position, stream): the same triple always draws the same.
pub fn uniform(seed: u64, position: u64, stream: u64) -> f64 {
    let h = splitmix64(seed ^ splitmix64(position ^ splitmix64(stream)));
    (h >> 11) as f64 / (1u64 << 53) as f64
}
