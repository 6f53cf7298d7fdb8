//! A real `troupe serve` on a loopback port for the HTTP tests, and a raw HTTP/1.1 client
//! (the tests need to send malformed bytes and to hang up mid-stream, which SDKs avoid).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use troupe::engine::{Engine, EngineConfig, EngineHandle, EngineStatus};
use troupe::protocol::serve_options::ServeOptions;
use troupe::runner::fault::FaultPlan;

pub struct TestServer {
    pub addr: SocketAddr,
    pub state: actix_web::web::Data<troupe::protocol::http::ServerState>,
    pub engine: EngineHandle,
    pub runtime: tokio::runtime::Runtime,
}

/// Serves `cfg`'s model as `model_name` on a free port; the server thread lives as long
/// as the test process.
pub fn start(cfg: EngineConfig, model_name: &str) -> TestServer {
    start_with(cfg, ServeOptions::new(model_name))
}

/// As `start`, with the server's options.
pub fn start_with(cfg: EngineConfig, opts: ServeOptions) -> TestServer {
    start_with_faults(cfg, opts, FaultPlan::default())
}

/// As `start_with`, the engine driven by a fault plan.
pub fn start_with_faults(
    cfg: EngineConfig,
    mut opts: ServeOptions,
    faults: FaultPlan,
) -> TestServer {
    opts.max_running_requests = cfg.max_num_seqs;
    // The test process's signals are the test runner's.
    opts.drain_on_signal = false;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let engine = runtime
        .block_on(Engine::spawn_with_faults(cfg, faults))
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let state = troupe::protocol::server::state(opts);
    state.set_engine(engine.clone());
    let serving = state.clone();
    std::thread::spawn(move || troupe::protocol::server::serve_on(serving, listener, None));
    let server = TestServer {
        addr,
        state,
        engine,
        runtime,
    };
    for _ in 0..200 {
        // Any answer: keys or a Host list may refuse this one.
        if server.get("/health").0 != 0 {
            return server;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("the server did not come up");
}

pub struct Reply {
    pub status: u16,
    /// Names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body with chunked transfer encoding undone.
    pub fn payload(&self) -> Vec<u8> {
        if self.header("transfer-encoding") != Some("chunked") {
            // What follows the length is the next reply on the connection.
            let len = self
                .header("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(self.body.len());
            return self.body[..len.min(self.body.len())].to_vec();
        }
        let (mut out, mut rest) = (Vec::new(), &self.body[..]);
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = std::str::from_utf8(&rest[..eol])
                .ok()
                .and_then(|h| usize::from_str_radix(h.trim(), 16).ok())
                .unwrap_or(0);
            let start = eol + 2;
            if size == 0 || start + size > rest.len() {
                break;
            }
            out.extend_from_slice(&rest[start..start + size]);
            rest = &rest[(start + size + 2).min(rest.len())..];
        }
        out
    }

    pub fn json(&self) -> serde_json::Value {
        let payload = self.payload();
        serde_json::from_slice(&payload)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&payload)))
    }
}

impl TestServer {
    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        s
    }

    /// Sends `body` to `path` with `method`, reads the whole reply.
    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> Reply {
        self.request_with(method, path, &[("host", "test")], body)
    }

    /// As `request`, with these header lines (`host` among them, or none is sent).
    pub fn request_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Reply {
        raw_request(self.addr, method, path, headers, body)
    }

    pub fn get(&self, path: &str) -> (u16, Vec<u8>) {
        let r = self.request("GET", path, b"");
        (r.status, r.body)
    }

    /// Generation requests the server's gate counts inside.
    pub fn engine_gate_inside(&self) -> usize {
        self.state.gate.num_inside()
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

pub fn parse_reply(raw: &[u8]) -> Reply {
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
    let headers = String::from_utf8_lossy(&raw[..body_at])
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Reply {
        status,
        headers,
        body: raw[body_at..].to_vec(),
    }
}

/// One request on a fresh connection; status 0 when nothing came back (not listening).
pub fn raw_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return Reply {
            status: 0,
            headers: Vec::new(),
            body: Vec::new(),
        };
    };
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let lines: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\n{lines}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
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
