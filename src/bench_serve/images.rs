//! Image prompts for `bench-serve --images-per-request`: seeded noise images as PNG `data:`
//! URLs (as vLLM's random multimodal dataset draws them), each request's different, so an
//! encoder cache or prefix cache carries no hit from one request to the next.

use base64::Engine as _;
use serde_json::{Value, json};

use crate::sampling::{splitmix64, uniform};

/// Draw stream of the pixels, apart from the arrivals' and the prompts'.
const STREAM_PIXELS: u64 = 0x7069_7865_6c73_0000;

/// `WxH` (`--image-size`), each side 1..=4096 pixels.
pub fn parse_size(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("`{s}` is not an image size (WIDTHxHEIGHT, such as 448x448)");
    let (w, h) = s.trim().split_once(['x', 'X']).ok_or_else(bad)?;
    let (w, h): (u32, u32) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
    if !(1..=4096).contains(&w) || !(1..=4096).contains(&h) {
        return Err(format!(
            "image size `{s}`: each side must be 1 to 4096 pixels"
        ));
    }
    Ok((w, h))
}

/// Image `k` of request `index`: uniform RGB noise of `(width, height)`, as a PNG file.
pub fn noise_png((width, height): (u32, u32), seed: u64, index: u64, k: u64) -> Vec<u8> {
    let image_seed = splitmix64(seed ^ splitmix64(index) ^ splitmix64(k.wrapping_add(1) << 32));
    let pixels: Vec<u8> = (0..u64::from(width) * u64::from(height) * 3)
        .map(|j| (uniform(image_seed, j, STREAM_PIXELS) * 256.0) as u8)
        .collect();
    let image = image::RgbImage::from_raw(width, height, pixels).expect("width × height × 3 bytes");
    let mut png = Vec::new();
    image
        .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .expect("PNG encodes into memory");
    png
}

/// A streaming chat request: `text` then `images` noise images of request `index`.
pub fn chat_body(
    model: &str,
    text: &str,
    (images, size): (usize, (u32, u32)),
    seed: u64,
    index: u64,
    output_len: usize,
    logit_bias: &serde_json::Map<String, Value>,
) -> Value {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut content = vec![json!({"type": "text", "text": text})];
    for k in 0..images as u64 {
        let url = format!(
            "data:image/png;base64,{}",
            b64.encode(noise_png(size, seed, index, k))
        );
        content.push(json!({"type": "image_url", "image_url": {"url": url}}));
    }
    json!({
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": output_len, "ignore_eos": true, "stream": true, "temperature": 0,
        "logit_bias": logit_bias, "stream_options": {"include_usage": true},
    })
}
