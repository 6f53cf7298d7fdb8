//! Images through the HTTP APIs (issue 64) on a generated Qwen2.5-VL checkpoint with its
//! chat template (`scripts/make_vision_goldens.py`): OpenAI `image_url` parts and Anthropic
//! `image` blocks as base64, the prompt equal to what transformers' processor makes of the
//! chat (every image's placeholder widened), the reply's tokens transformers' greedy ones;
//! bad images refused with a 400 naming the part, other requests unaffected.

mod common;

use base64::Engine as _;
use common::server::TestServer;
use serde_json::{Value, json};
use troupe::api::{EngineRequest, PromptImage};
use troupe::engine::EngineConfig;
use troupe::sampling::SamplingParams;

fn case_dir() -> std::path::PathBuf {
    common::goldens().join("qwen25vl").join("a")
}

fn cases() -> Value {
    serde_json::from_str(&std::fs::read_to_string(case_dir().join("cases.json")).unwrap()).unwrap()
}

fn server() -> TestServer {
    let mut cfg = EngineConfig::new(case_dir());
    cfg.kv_cache_bytes = 8 << 20;
    cfg.exact_activations = true;
    cfg.block_size = 4;
    common::server::start(cfg, "tiny-vl")
}

fn png(i: u64) -> Vec<u8> {
    std::fs::read(case_dir().join(format!("images/{i}.png"))).unwrap()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A golden chat as OpenAI messages: each image part a data URL.
fn openai_messages(chat: &Value) -> Value {
    let msgs = chat.as_array().unwrap().iter().map(|m| {
        let content = match &m["content"] {
            Value::Array(parts) => Value::Array(
                parts
                    .iter()
                    .map(|p| match p["type"].as_str().unwrap() {
                        "image" => json!({"type": "image_url", "image_url": {
                            "url": format!("data:image/png;base64,{}", b64(&png(p["image"].as_u64().unwrap())))}}),
                        _ => json!({"type": "text", "text": p["text"]}),
                    })
                    .collect(),
            ),
            text => text.clone(),
        };
        json!({"role": m["role"], "content": content})
    });
    Value::Array(msgs.collect())
}

fn post(server: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let r = server.request("POST", path, body.to_string().as_bytes());
    (r.status, r.json())
}

#[test]
fn chats_with_images_are_the_processors_prompts_and_answer_as_transformers() {
    let server = server();
    let cases = cases();
    for (c, chat) in cases["chats"].as_array().unwrap().iter().enumerate() {
        let messages = openai_messages(&chat["messages"]);
        // The prompt: as transformers' processor makes it.
        let (status, reply) = post(&server, "/tokenize", &json!({"messages": messages}));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["tokens"], chat["ids"], "chat {c}");
        let body = json!({"model": "tiny-vl", "messages": messages, "max_tokens": 8,
            "temperature": 0, "ignore_eos": true});
        let (status, reply) = post(&server, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{reply}");
        let num_ids = chat["ids"].as_array().unwrap().len() as u64;
        assert_eq!(reply["usage"]["prompt_tokens"], num_ids, "{reply}");
        assert_eq!(reply["usage"]["completion_tokens"], 8, "{reply}");
        // The reply's tokens: the same prompt and images through the engine (the server
        // made both from the chat above) give transformers' greedy tokens.
        let ids: Vec<u32> = common::ids(&chat["ids"]);
        let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
        let text = troupe::model::load_text(&case_dir()).unwrap();
        let processor = &text.vision.as_ref().unwrap().processor;
        let mut images = Vec::new();
        let mut t = 0;
        for m in chat["messages"].as_array().unwrap() {
            for p in m["content"].as_array().into_iter().flatten() {
                if p["type"] != "image" {
                    continue;
                }
                while ids[t] != image_token {
                    t += 1;
                }
                let bytes = png(p["image"].as_u64().unwrap());
                let decoded =
                    troupe::model::vision::RgbImage::decode(&bytes, None, Default::default())
                        .unwrap();
                let patches = processor.patches(&decoded).unwrap();
                let image = PromptImage::new(t, patches.grid, 2, patches.values);
                t += image.num_tokens();
                images.push(image);
            }
        }
        let mut request = EngineRequest::new(ids, 8, SamplingParams::default());
        request.ignore_eos = true;
        request.images = images;
        let out = server.runtime.block_on(async {
            tokio::time::timeout(
                std::time::Duration::from_secs(60),
                common::engine::ok_outputs(&server.engine, vec![request]),
            )
            .await
            .expect("answered within 60 s")
        });
        assert_eq!(out[0].token_ids, common::ids(&chat["greedy"]), "chat {c}");
    }
}

#[test]
fn anthropic_image_blocks_make_the_same_prompt() {
    let server = server();
    let cases = cases();
    let chat = &cases["chats"][0];
    let blocks: Vec<Value> = chat["messages"][0]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| match p["type"].as_str().unwrap() {
            "image" => json!({"type": "image", "source": {"type": "base64",
                "media_type": "image/png", "data": b64(&png(p["image"].as_u64().unwrap()))}}),
            _ => json!({"type": "text", "text": p["text"]}),
        })
        .collect();
    let body = json!({"model": "tiny-vl", "max_tokens": 4,
        "messages": [{"role": "user", "content": blocks}]});
    let (status, reply) = post(&server, "/v1/messages", &body);
    assert_eq!(status, 200, "{reply}");
    // Anthropic's prompt has no system turn unless given; the template adds its default,
    // as it does for the OpenAI chat: the same ids.
    assert_eq!(
        reply["usage"]["input_tokens"],
        chat["ids"].as_array().unwrap().len() as u64,
        "{reply}"
    );
}

#[test]
fn bad_images_are_refused_by_name_and_the_server_serves_on() {
    let server = server();
    let user = |part: Value| {
        json!({"model": "tiny-vl", "max_tokens": 2,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]})
    };
    let url = |u: String| json!({"type": "image_url", "image_url": {"url": u}});
    let mut bomb = Vec::new();
    image::RgbImage::new(1, 1)
        .write_to(
            &mut std::io::Cursor::new(&mut bomb),
            image::ImageFormat::Png,
        )
        .unwrap();
    bomb[16..20].copy_from_slice(&200_000u32.to_be_bytes());
    bomb[20..24].copy_from_slice(&200_000u32.to_be_bytes());
    let crc = crc32fast::hash(&bomb[12..29]);
    bomb[29..33].copy_from_slice(&crc.to_be_bytes());
    let good = png(0);
    let cases = [
        (
            url("https://example.invalid/cat.png".into()),
            "messages[0].content[0].image_url.url",
            "`example.invalid` is not one",
        ),
        (
            url(format!("data:image/png;base64,{}", b64(&bomb))),
            "messages[0].content[0]",
            "larger than this server decodes",
        ),
        (
            url(format!(
                "data:image/png;base64,{}",
                b64(&good[..good.len() / 2])
            )),
            "messages[0].content[0]",
            "could not be decoded",
        ),
        (
            url(format!("data:image/jpeg;base64,{}", b64(&good))),
            "messages[0].content[0]",
            "declared image/jpeg but its bytes are image/png",
        ),
        (
            url("data:image/png;base64,%%%".into()),
            "messages[0].content[0].image_url.url",
            "base64 data is invalid",
        ),
        (
            json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&good)), "detail": "low"}}),
            "messages[0].content[0].image_url.detail",
            "detail `low` is not supported",
        ),
        (
            json!({"type": "input_audio", "input_audio": {}}),
            "messages[0].content[0]",
            "not supported (text, image_url)",
        ),
    ];
    for (part, param, needle) in cases {
        let (status, reply) = post(&server, "/v1/chat/completions", &user(part.clone()));
        assert_eq!(status, 400, "{part} → {reply}");
        assert_eq!(reply["error"]["param"], param, "{reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message}");
    }
    // Anthropic's URL source from a host not allowed, and a source of no known type.
    for (source, needle) in [
        (
            json!({"type": "url", "url": "https://example.invalid/x.png"}),
            "is not one",
        ),
        (json!({"type": "file", "file_id": "f"}), "image source"),
    ] {
        let body = json!({"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user",
            "content": [{"type": "image", "source": source}]}]});
        let (status, reply) = post(&server, "/v1/messages", &body);
        assert_eq!(status, 400, "{reply}");
        assert!(reply.to_string().contains(needle), "{reply}");
    }
    // A photo-sized image (a body past the 4 MiB text-only limit) is taken.
    let (h, w) = (1500u32, 1300u32);
    let mut noise = image::RgbImage::new(w, h);
    for (i, px) in noise.pixels_mut().enumerate() {
        let v = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
        *px = image::Rgb([v as u8, (v >> 8) as u8, (v >> 16) as u8]);
    }
    let mut big = Vec::new();
    noise
        .write_to(&mut std::io::Cursor::new(&mut big), image::ImageFormat::Png)
        .unwrap();
    assert!(big.len() > 4 << 20, "{} bytes", big.len());
    let (status, reply) = post(
        &server,
        "/v1/chat/completions",
        &user(url(format!("data:image/png;base64,{}", b64(&big)))),
    );
    assert_eq!(status, 200, "{reply}");
    // The server is unharmed: a good image and plain text are both answered.
    let part = url(format!("data:image/png;base64,{}", b64(&good)));
    let (status, reply) = post(&server, "/v1/chat/completions", &user(part));
    assert_eq!(status, 200, "{reply}");
    let body = json!({"model": "tiny-vl", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]});
    assert_eq!(post(&server, "/v1/chat/completions", &body).0, 200);
}

/// A loopback HTTP server standing in for a remote host: `/cat.png` is image 0, `/big`
/// streams past the size limit, anything else is a 404. Returns its port.
fn image_host() -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 4096];
            let n = conn.read(&mut buf).unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]).to_string();
            let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
            let reply = |conn: &mut std::net::TcpStream, status: &str, body: &[u8]| {
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status}\r\nContent-Type: image/png\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(body);
            };
            match path.as_str() {
                "/cat.png" => reply(&mut conn, "200 OK", &png(0)),
                "/big" => reply(&mut conn, "200 OK", &vec![0u8; 21 << 20]),
                _ => reply(&mut conn, "404 Not Found", b""),
            }
        }
    });
    port
}

#[test]
fn images_by_url_are_fetched_from_allowed_hosts_only() {
    let port = image_host();
    let mut cfg = EngineConfig::new(case_dir());
    cfg.kv_cache_bytes = 8 << 20;
    cfg.exact_activations = true;
    let mut opts = troupe::protocol::serve_options::ServeOptions::new("tiny-vl");
    opts.allowed_media_domains = vec!["127.0.0.1".into()];
    let server = common::server::start_with(cfg, opts);
    let chat = &cases()["chats"][0];
    let ask = |u: String| {
        json!({"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": "What is this?"}]}]})
    };
    let (status, reply) = post(
        &server,
        "/v1/chat/completions",
        &ask(format!("http://127.0.0.1:{port}/cat.png")),
    );
    assert_eq!(status, 200, "{reply}");
    // The same prompt as the image sent inline.
    assert_eq!(
        reply["usage"]["prompt_tokens"],
        chat["ids"].as_array().unwrap().len() as u64
    );
    for (path, needle) in [
        ("/missing.png", "fetching the image failed"),
        ("/big", "over 20 MiB"),
    ] {
        let (status, reply) = post(
            &server,
            "/v1/chat/completions",
            &ask(format!("http://127.0.0.1:{port}{path}")),
        );
        assert_eq!(status, 400, "{reply}");
        assert_eq!(
            reply["error"]["param"], "messages[0].content[0].image_url.url",
            "{reply}"
        );
        assert!(
            reply["error"]["message"].as_str().unwrap().contains(needle),
            "{reply}"
        );
    }
    // `localhost` is another name: not on the list.
    let (status, reply) = post(
        &server,
        "/v1/chat/completions",
        &ask(format!("http://localhost:{port}/cat.png")),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply.to_string().contains("`localhost` is not one"),
        "{reply}"
    );
}

/// `bench-serve --images-per-request` against the vision-language server: every request (a
/// chat with noise images) completes with its full output; bad image flags are refused.
#[test]
fn bench_serve_sends_image_prompts() {
    let server = server();
    let json_path = common::scratch_dir("bench-images").join("rows.json");
    let url = format!("http://{}", server.addr);
    let out = common::cli::troupe(&[
        "bench-serve",
        "--url",
        &url,
        "--rates",
        "inf",
        "--num-prompts",
        "4",
        "--input-len",
        "3",
        "--output-len",
        "4",
        "--images-per-request",
        "2",
        "--image-size",
        "60x45",
        "--request-timeout-secs",
        "60",
        "--json",
        json_path.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("2 images of 60x45"), "{stderr}");
    let rows: Value = serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
    assert_eq!(rows[0]["completed"], 4, "{rows}");
    assert_eq!(rows[0]["failed"], 0, "{rows}");
    let status = server.runtime.block_on(server.engine.status()).unwrap();
    // Five requests (the warm-up and four), each of two images' tokens and more.
    assert!(status.num_prefill_tokens >= 5 * 2 * 4, "{status:?}");
    for (flags, says) in [
        (["--image-size", "0x45"], "each side must be 1 to 4096"),
        (["--image-size", "60by45"], "is not an image size"),
        (["--write-prompts", "/dev/null"], "--images-per-request"),
    ] {
        let mut args = vec!["bench-serve", "--url", &url, "--images-per-request", "1"];
        args.extend(flags);
        let out = common::cli::troupe(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(says),
            "{flags:?}: {stderr}"
        );
    }
}
