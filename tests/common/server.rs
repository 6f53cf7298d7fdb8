//! A real `troupe serve` on a loopback port for the HTTP tests, and a raw HTTP/1.1 client
//! (the tests need to send malformed bytes and to hang up mid-stream, which SDKs avoid).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use troupe::engine::{Engine, EngineConfig, EngineHandle, EngineStatus};

pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: EngineHandle,
    pub runtime: tokio::runtime::Runtime,
}

/// Serves `cfg`'s model as `model_name` on a free port; the server thread lives as long
/// as the test process.
pub fn start(cfg: EngineConfig, model_name: &str) -> TestServer {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let engine = runtime.block_on(Engine::spawn(cfg)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (handle, name) = (engine.clone(), model_name.to_string());
    std::thread::spawn(move || troupe::protocol::server::serve_on(handle, name, listener));
    let server = TestServer {
        addr,
        engine,
        runtime,
    };
    for _ in 0..200 {
        if server.get("/health").0 == 200 {
            return server;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("the server did not come up");
}

pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

impl TestServer {
    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        s
    }

    /// Sends `body` to `path` with `method`, reads the whole reply.
    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> Reply {
        let mut s = self.connect();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        // The server may answer (413) and close before it has read everything.
        let _ = s
            .write_all(head.as_bytes())
            .and_then(|()| s.write_all(body));
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        parse_reply(&raw)
    }

    pub fn get(&self, path: &str) -> (u16, Vec<u8>) {
        let r = self.request("GET", path, b"");
        (r.status, r.body)
    }

    pub fn status(&self) -> EngineStatus {
        self.runtime.block_on(self.engine.status()).unwrap()
    }

    /// Waits until no request runs and every KV block is free; the last status otherwise.
    pub fn wait_idle(&self, timeout: Duration) -> Result<(), Box<EngineStatus>> {
        let start = std::time::Instant::now();
        loop {
            let s = self.status();
            if s.num_running == 0 && s.num_waiting == 0 && s.num_free_blocks == s.num_total_blocks {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(Box::new(s));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn parse_reply(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body_at = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(raw.len(), |p| p + 4);
    Reply {
        status,
        body: raw[body_at..].to_vec(),
    }
}
