//! `ferry up --processes` as a test fixture.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `ferry up --processes`; killed (SIGKILL) if dropped without
/// [`interrupt`](Self::interrupt), so a failing test leaves nothing behind.
pub struct Up {
    child: Option<Child>,
    /// The router's OpenAI HTTP address.
    pub http: std::net::SocketAddr,
    /// The router's gRPC address.
    pub grpc: std::net::SocketAddr,
    /// The daemons' process ids.
    pub pids: Vec<u32>,
    /// Each daemon's name and gRPC address (`prefill-0`, `decode-0`, `router`).
    pub grpc_of: Vec<(String, std::net::SocketAddr)>,
    /// Each daemon's name and process id.
    pub pid_of: Vec<(String, u32)>,
    /// Its log lines (its daemons' stderr) so far, with its default `RUST_LOG`.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Up {
    /// Starts it with SmolLM2 on free loopback ports and waits for its ready line.
    pub fn start(extra: &[&str]) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args([
                "up",
                "--processes",
                "--pool-pages",
                "256",
                "--http-addr",
                "127.0.0.1:0",
                "--grpc-addr",
                "127.0.0.1:0",
            ])
            .args(extra)
            .arg("--model")
            .arg(ferry_tests::smollm2())
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start `ferry up`");
        let unspecified = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
        let mut up = Self {
            child: Some(child),
            http: unspecified,
            grpc: unspecified,
            pids: Vec::new(),
            grpc_of: Vec::new(),
            pid_of: Vec::new(),
            log: std::sync::Arc::default(),
        };
        let err = BufReader::new(up.child.as_mut().and_then(|c| c.stderr.take()).expect("stderr"));
        let log = std::sync::Arc::clone(&up.log);
        std::thread::spawn(move || {
            each_line(err, |l| {
                eprintln!("{l}");
                log.lock().expect("log").push(l);
            });
        });
        let out = BufReader::new(up.child.as_mut().and_then(|c| c.stdout.take()).expect("stdout"));
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            each_line(out, |l| {
                println!("{l}");
                let _ = tx.send(l);
            });
        });
        loop {
            let line = rx.recv_timeout(Duration::from_secs(300)).expect("`ferry up` prints a ready line");
            if let Some((_, pid)) = line.rsplit_once("pid ") {
                let pid = pid.trim().parse::<u32>().expect("a pid");
                up.pids.push(pid);
                if let Some(name) = line.split_whitespace().next() {
                    up.pid_of.push((name.to_string(), pid));
                }
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            if let [name, "gRPC", addr, ..] = words[..]
                && let Ok(a) = addr.parse()
            {
                up.grpc_of.push((name.to_string(), a));
            }
            if let Some(rest) = line.strip_prefix("ferry up: ready; OpenAI API at http://") {
                up.http = rest.split("/v1").next().and_then(|a| a.parse().ok()).expect("the HTTP address");
                let grpc = rest.split("gRPC at ").nth(1).and_then(|r| r.split(';').next()).and_then(|a| a.parse().ok());
                up.grpc = grpc.expect("the gRPC address");
                return up;
            }
        }
    }

    /// SIGINT, as Ctrl-C; returns whether it exited cleanly.
    pub fn interrupt(mut self) -> bool {
        let Some(mut child) = self.child.take() else { return false };
        // SAFETY: kill(2) on the child we spawned and have not reaped.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGINT);
        }
        child.wait().expect("wait for `ferry up`").success()
    }
}

/// Gives `f` each line read until the end (lines that are not UTF-8 too, repaired): a reader
/// that stopped early would leave the pipe full and every daemon writing to it blocked.
fn each_line(mut r: impl BufRead, mut f: impl FnMut(String)) {
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) => return,
            Ok(_) => f(String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']).to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
