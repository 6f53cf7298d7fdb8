//! E/P/D on the CPU (issue 64): a router, an encode engine (`serve --role encode`, the vision
//! encoder alone, served from a directory without the language model) and an
//! engine that answers, as real processes on loopback, on the generated Qwen2.5-VL
//! checkpoint. Chats with images through the router equal one colocated engine's replies;
//! their images are encoded on the encode engine and reach the answering engine as rows
//! (it encodes none itself); with the encode engine killed mid-burst every request is still
//! answered, the same. With prefill and decode engines beside them, a request's images
//! are encoded on the encode engine, its prompt prefilled with them on the prefill engine,
//! and the decode engine answers from the KV handed to it, encoding nothing.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use common::cluster::{self, get, metric, router_up, wait_for};
use common::process::{HOST, ServeProcess, free_port, serve_model};
use common::server::raw_request;
use serde_json::{Value, json};

/// The engines' flags: greedy tokens exact on any machine, blocks small enough to share.
const ENGINE_FLAGS: [&str; 5] = [
    "--kv-cache-mib",
    "16",
    "--block-size",
    "4",
    "--exact-activations",
];

fn router(model: &Path, cluster_port: u16) -> ServeProcess {
    // Every prompt is handed over, however short.
    let router = cluster::router(model, cluster_port, &["--min-hand-off-tokens", "0"]);
    router_up(&router);
    router
}

fn engine(model: &Path, cluster_port: u16, name: &str, role: &str) -> ServeProcess {
    let mut args = vec!["--role", role];
    args.extend_from_slice(&ENGINE_FLAGS);
    cluster::engine(model, cluster_port, name, &args)
}

/// An encode engine: the vision encoder alone (it takes no engine flag).
fn encoder(model: &Path, cluster_port: u16, name: &str) -> ServeProcess {
    cluster::engine(model, cluster_port, name, &["--role", "encode"])
}

/// `model` with the vision tower's weights alone: its config, its image processor's and
/// the `visual.` tensors, no tokenizer and no language model.
fn vision_only(model: &Path) -> std::path::PathBuf {
    let dir = common::scratch_dir("vision-only");
    for file in ["config.json", "preprocessor_config.json"] {
        std::fs::copy(model.join(file), dir.join(file)).unwrap();
    }
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    let all = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let visual: Vec<(String, safetensors::tensor::TensorView<'_>)> = (all.tensors().into_iter())
        .filter(|(name, _)| name.contains("visual."))
        .collect();
    assert!(!visual.is_empty() && visual.len() < all.len());
    safetensors::serialize_to_file(visual, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// Seeded noise of `w × h` as a PNG: images no engine has seen.
fn noise_png(w: u32, h: u32, seed: u64) -> Vec<u8> {
    let mut rng = common::Rng(seed);
    let pixels: Vec<u8> = (0..w * h * 3).map(|_| rng.next() as u8).collect();
    let mut png = Vec::new();
    image::RgbImage::from_raw(w, h, pixels)
        .unwrap()
        .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    png
}

/// A greedy chat of `text` and `images` (PNG files).
fn chat(text: &str, images: &[Vec<u8>]) -> Value {
    let mut content = vec![json!({"type": "text", "text": text})];
    for png in images {
        let url = format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(png)
        );
        content.push(json!({"type": "image_url", "image_url": {"url": url}}));
    }
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": true})
}

/// The reply's text and prompt tokens.
fn answer(addr: SocketAddr, body: &Value) -> (String, u64) {
    let headers = [("host", "127.0.0.1"), ("content-type", "application/json")];
    let r = raw_request(
        addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.payload()));
    let v = r.json();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    (text, v["usage"]["prompt_tokens"].as_u64().unwrap())
}

/// The router lists `n` engines.
fn wait_for_engines(router: SocketAddr, n: usize) {
    let listed = |v: &Value| v["engines"].as_array().is_some_and(|e| e.len() == n);
    wait_for(router, Duration::from_secs(60), listed);
}

#[test]
fn images_encoded_on_an_encode_engine_give_one_engines_replies() {
    let model = common::vision::case_dir("a");
    let solo = serve_model(&model, &ENGINE_FLAGS, &[]);
    let cluster_port = free_port();
    let router = router(&model, cluster_port);
    // The encode engine loads nothing of the language model: it serves from a directory
    // that holds none of it.
    let encoder = encoder(&vision_only(&model), cluster_port, "enc");
    let answering = engine(&model, cluster_port, "main", "both");
    wait_for_engines(router.addr, 2);
    assert_eq!(get(encoder.addr, "/health")["role"], "encode");
    let headers = [("host", "127.0.0.1"), ("content-type", "application/json")];
    let asked = chat("hello", &[]).to_string();
    let r = raw_request(
        encoder.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        asked.as_bytes(),
    );
    assert_eq!(r.status, 421, "a request sent to the encode engine itself");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("send them to the router")
    );

    let sizes = [(40, 30), (64, 64), (90, 28), (33, 70)];
    let images: Vec<Vec<u8>> = (0..8)
        .map(|i| {
            let (w, h) = sizes[i % sizes.len()];
            noise_png(w, h, 100 + i as u64)
        })
        .collect();
    // Phase 1: every image through the encode engine.
    let first: Vec<Value> = (0..4)
        .map(|i| chat(&format!("look {i}"), &images[i..i + 1 + i % 2]))
        .collect();
    for body in &first {
        assert_eq!(
            answer(router.addr, body),
            answer(solo.addr, body),
            "{body:.80}"
        );
    }
    let distinct = 5.0; // images 0..=4
    assert_eq!(metric(encoder.addr, "troupe_encoded_images"), distinct);
    assert_eq!(metric(answering.addr, "troupe_received_images"), distinct);
    assert_eq!(metric(answering.addr, "troupe_encoded_images"), 0.0);
    assert_eq!(metric(router.addr, "troupe_router_encoded_images"), 6.0);
    // The encode engine is never given a request to answer.
    let routed = raw_request(router.addr, "GET", "/metrics", &HOST, b"").payload();
    let routed = String::from_utf8_lossy(&routed);
    assert!(
        routed.contains("troupe_router_routed_total{engine=\"main\"} 4"),
        "{routed}"
    );
    assert!(
        !routed.contains("troupe_router_routed_total{engine=\"enc\"}"),
        "{routed}"
    );

    // Phase 2: the encode engine killed while a burst with new images is in flight, then
    // requests with an image it never saw: the answering engine encodes what it must.
    let burst: Vec<Value> = (0..6)
        .map(|i| chat(&format!("again {i}"), &images[5 + i % 2..6 + i % 2]))
        .collect();
    let mut encoder = encoder;
    let got: Vec<(String, u64)> = std::thread::scope(|s| {
        let runs: Vec<_> = burst
            .iter()
            .map(|b| s.spawn(move || answer(router.addr, b)))
            .collect();
        std::thread::sleep(Duration::from_millis(5));
        encoder.child.kill().unwrap();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for (body, got) in burst.iter().zip(got) {
        assert_eq!(got, answer(solo.addr, body), "{body:.80}");
    }
    encoder.child.wait().unwrap();
    for i in 0..2 {
        let body = chat(&format!("after {i}"), &images[7..8]);
        assert_eq!(answer(router.addr, &body), answer(solo.addr, &body));
    }
    // Every image reached the answering engine once, one way or the other.
    let received = metric(answering.addr, "troupe_received_images");
    let encoded = metric(answering.addr, "troupe_encoded_images");
    assert!(encoded >= 1.0, "image 7 was encoded where it was answered");
    assert_eq!(
        received + encoded,
        8.0,
        "received {received}, encoded {encoded}"
    );
}

/// A user turn of `parts` (text, or an image as a PNG file): greedy, 6 tokens.
fn chat_of(parts: &[Result<&str, &[u8]>]) -> Value {
    let b64 = base64::engine::general_purpose::STANDARD;
    let content: Vec<Value> = (parts.iter())
        .map(|p| match p {
            Ok(text) => json!({"type": "text", "text": text}),
            Err(png) => {
                let url = format!("data:image/png;base64,{}", b64.encode(png));
                json!({"type": "image_url", "image_url": {"url": url}})
            }
        })
        .collect();
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": true})
}

/// An Anthropic message's reply text.
fn message_text(addr: SocketAddr, model: &Path, png: &[u8], text: &str) -> String {
    let data = base64::engine::general_purpose::STANDARD.encode(png);
    let body = json!({"model": model.display().to_string(), "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": text}]}]});
    let headers = [("host", "127.0.0.1"), ("content-type", "application/json")];
    let r = raw_request(
        addr,
        "POST",
        "/v1/messages",
        &headers,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.payload()));
    r.json()["content"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn images_through_encode_prefill_and_decode_engines_give_one_engines_replies() {
    let model = common::vision::case_dir("b");
    let solo = serve_model(&model, &ENGINE_FLAGS, &[]);
    let cluster_port = free_port();
    let router = router(&model, cluster_port);
    let encoder = encoder(&model, cluster_port, "enc");
    let prefill = engine(&model, cluster_port, "p1", "prefill");
    let decode = engine(&model, cluster_port, "d1", "decode");
    wait_for_engines(router.addr, 3);

    // Drawn sizes and places: images first, last (their tokens in the prompt's last
    // partial block), between texts, one to three a turn; text-only turns among them.
    let mut rng = common::Rng(64);
    let images: Vec<Vec<u8>> = (0..6)
        .map(|i| {
            noise_png(
                28 + rng.below(70) as u32,
                28 + rng.below(70) as u32,
                300 + i,
            )
        })
        .collect();
    let bodies: Vec<Value> = (0..8)
        .map(|i| {
            let (a, b, c) = (
                &images[i % 6][..],
                &images[(i + 1) % 6][..],
                &images[(i + 3) % 6][..],
            );
            let says = format!("turn {i} of the test");
            match i % 4 {
                0 => chat_of(&[Ok(&says), Err(a)]),
                1 => chat_of(&[Err(a), Err(b), Ok(&says)]),
                2 => chat_of(&[Ok("first"), Err(a), Ok(&says), Err(b), Err(c)]),
                _ => chat_of(&[Ok(&says)]),
            }
        })
        .collect();
    let got: Vec<(String, u64)> = std::thread::scope(|s| {
        let runs: Vec<_> = (bodies.iter())
            .map(|b| s.spawn(move || answer(router.addr, b)))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for (body, got) in bodies.iter().zip(got) {
        assert_eq!(got, answer(solo.addr, body), "{body:.80}");
    }
    let anthropic = message_text(router.addr, &model, &images[5], "and this one?");
    assert_eq!(
        anthropic,
        message_text(solo.addr, &model, &images[5], "and this one?")
    );

    // Every request was prefilled on p1 and answered by d1; the images were encoded on
    // enc alone, their rows sent to both.
    let view = get(router.addr, "/router/engines");
    assert_eq!(view["hand_offs"], 9, "{view}");
    assert_eq!(view["failed_hand_offs"], 0, "{view}");
    let moved = view["kv_blocks_moved"].as_u64().unwrap();
    assert!(moved > 0, "{view}");
    // d1 computed none of the blocks moved: each was found in its store, or (a prefix
    // the turns share) in its device cache. A block staged from the store while another
    // turn put it in the device cache counts in both tiers.
    let hits = metric(decode.addr, "troupe_prefix_hit_blocks");
    assert!(cluster::host_hit_blocks(decode.addr) > 0);
    assert!(hits >= moved as f64, "{hits} hits: {view}");
    assert_eq!(metric(encoder.addr, "troupe_encoded_images"), 6.0);
    assert_eq!(metric(prefill.addr, "troupe_encoded_images"), 0.0);
    assert_eq!(metric(decode.addr, "troupe_encoded_images"), 0.0);
    assert_eq!(metric(prefill.addr, "troupe_received_images"), 6.0);

    // With the encode engine gone, the prefill engine encodes a new image itself; the
    // decode engine still computes none of it.
    drop(encoder);
    wait_for_engines(router.addr, 2);
    let fresh = noise_png(61, 45, 999);
    let body = chat_of(&[Err(&fresh), Ok("what now?")]);
    assert_eq!(answer(router.addr, &body), answer(solo.addr, &body));
    assert_eq!(metric(prefill.addr, "troupe_encoded_images"), 1.0);
    assert_eq!(metric(decode.addr, "troupe_encoded_images"), 0.0);
    assert_eq!(get(router.addr, "/router/engines")["hand_offs"], 10);
}

#[test]
fn an_encode_engine_needs_a_vision_language_model_and_refuses_the_language_models_flags() {
    let serve = |model: &Path, extra: &[&str]| {
        let port = free_port().to_string();
        let model = model.display().to_string();
        let mut args = vec!["serve", "--model", &model, "--port", &port];
        args.extend_from_slice(&["--cluster", "127.0.0.1:1", "--role", "encode"]);
        args.extend_from_slice(extra);
        let out = common::cli::troupe(&args);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            !out.status.success() && !stderr.contains("panicked"),
            "{stderr}"
        );
        stderr
    };
    let stderr = serve(&common::smollm2_path(), &[]);
    assert!(
        stderr.contains("--role encode: the model takes no images"),
        "{stderr}"
    );
    let vision = common::vision::case_dir("a");
    let flags = [
        "--kv-cache-mib",
        "16",
        "--spec",
        "ngram",
        "--request-timeout",
        "5s",
    ];
    let stderr = serve(&vision, &flags);
    assert!(stderr.contains("do not apply to it"), "{stderr}");
    for flag in ["--kv-cache-mib", "--spec", "--request-timeout"] {
        assert!(stderr.contains(flag), "{flag}: {stderr}");
    }
}
