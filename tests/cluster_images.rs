//! E/P/D on the CPU (issue 64): a router, an encode engine (`serve --role encode`) and an
//! engine that answers, as real processes on loopback, on the generated Qwen2.5-VL
//! checkpoint. Chats with images through the router equal one colocated engine's replies;
//! their images are encoded on the encode engine and reach the answering engine as rows
//! (it encodes none itself); with the encode engine killed mid-burst every request is still
//! answered, the same.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
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

fn router(model: &std::path::Path, cluster_port: u16) -> ServeProcess {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["router", "--model"])
        .arg(model)
        .args(["--listen", &format!("127.0.0.1:{cluster_port}")])
        .args(["--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("troupe router starts");
    let router = ServeProcess {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    let started = Instant::now();
    while raw_request(router.addr, "GET", "/health", &HOST, b"").status != 503 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the router did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    router
}

fn engine(model: &std::path::Path, cluster_port: u16, name: &str, role: &str) -> ServeProcess {
    let cluster = format!("127.0.0.1:{cluster_port}");
    let mut args = vec!["--cluster", &cluster, "--node-name", name, "--role", role];
    args.extend_from_slice(&ENGINE_FLAGS);
    serve_model(model, &args, &[])
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

/// A counter of `addr`'s `/metrics` (summed over its labels).
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let r = raw_request(addr, "GET", "/metrics", &HOST, b"");
    assert_eq!(r.status, 200);
    String::from_utf8_lossy(&r.payload())
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(key, _)| {
            let key = key.split('{').next().unwrap();
            key == name || key == format!("{name}_total")
        })
        .map(|(_, v)| v.parse::<f64>().unwrap())
        .sum()
}

/// The router lists `n` engines.
fn wait_for_engines(router: SocketAddr, n: usize) {
    let started = Instant::now();
    loop {
        let r = raw_request(router, "GET", "/router/engines", &HOST, b"");
        if r.status == 200 && r.json()["engines"].as_array().is_some_and(|e| e.len() == n) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the router's view did not settle"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn images_encoded_on_an_encode_engine_give_one_engines_replies() {
    let model = common::vision::case_dir("a");
    let solo = serve_model(&model, &ENGINE_FLAGS, &[]);
    let cluster_port = free_port();
    let router = router(&model, cluster_port);
    let encoder = engine(&model, cluster_port, "enc", "encode");
    let answering = engine(&model, cluster_port, "main", "both");
    wait_for_engines(router.addr, 2);

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

#[test]
fn an_encode_engine_needs_a_vision_language_model() {
    let port = free_port().to_string();
    let out = common::cli::troupe(&[
        "serve",
        "--model",
        &common::smollm2_path().display().to_string(),
        "--port",
        &port,
        "--cluster",
        "127.0.0.1:1",
        "--role",
        "encode",
        "--kv-cache-mib",
        "16",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--role encode: the model takes no images") && !stderr.contains("panicked"),
        "{stderr}"
    );
}
