//! A real `troupe serve` process on a free port, killed when dropped, and the waits on it
//! (each with a time bound).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub struct ServeProcess {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub const HOST: [(&str, &str); 1] = [("host", "127.0.0.1")];

/// `troupe serve` on the small test model with `args` and `envs`, once `/health` is 200.
pub fn serve(args: &[&str], envs: &[(&str, &str)]) -> ServeProcess {
    serve_model(&super::smollm2_path(), args, envs)
}

/// `troupe serve` on `model`, once `/health` is 200; a server that exits first fails.
pub fn serve_model(model: &std::path::Path, args: &[&str], envs: &[(&str, &str)]) -> ServeProcess {
    let model = model.display().to_string();
    let mut all = vec!["--model", model.as_str()];
    all.extend_from_slice(args);
    serve_with(&all, envs)
}

/// `troupe serve ARGS` (the model among them, as a user writes it) on a free port, once
/// `/health` is 200.
pub fn serve_with(args: &[&str], envs: &[(&str, &str)]) -> ServeProcess {
    serve_logging_to(args, envs, Stdio::inherit())
}

/// `serve_with`, the server's stderr (its logs) going to `stderr`.
pub fn serve_logging_to(args: &[&str], envs: &[(&str, &str)], stderr: Stdio) -> ServeProcess {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .arg("serve")
        .args(["--port", &port.to_string()])
        .args(args)
        .envs(envs.iter().copied())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("troupe serve starts");
    let server = ServeProcess {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    let started = Instant::now();
    let mut server = server;
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            panic!("the server exited before it came up: {status}");
        }
        let r = super::server::raw_request(server.addr, "GET", "/health", &HOST, b"");
        if r.status == 200 {
            return server;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the server did not come up (last: {})",
            r.status
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl ServeProcess {
    pub fn signal(&self, signal: i32) {
        // SAFETY: sends a signal to our own child process.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
    }

    /// The exit status, which must come within `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < limit,
                "the server did not exit within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
