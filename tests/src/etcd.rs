//! A real etcd server for discovery tests: the Debian `etcd-server` binary (`scripts/test`
//! installs it), on free loopback ports with its own data directory, killed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
pub struct Etcd {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    tls: Option<ServerTls>,
    extra: Vec<String>,
}

/// TLS on a test etcd's client port.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// Its certificate (PEM file).
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// When set, clients must present a certificate this CA signed (`--client-cert-auth`).
    pub client_ca: Option<PathBuf>,
}

/// A loopback port free now, drawn below the kernel's ephemeral range (32768 and up on
/// Linux): no outgoing connection can take it before etcd binds it, nor while a killed etcd
/// is down before its restart on the same port.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    loop {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        let port = 20_000 + (h.finish() % 12_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

fn binary() -> PathBuf {
    let p = std::env::var("FERRY_ETCD_BIN").map_or_else(|_| PathBuf::from("/usr/bin/etcd"), PathBuf::from);
    assert!(p.exists(), "{} is missing: install Debian `etcd-server` (scripts/test does)", p.display());
    p
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub fn start() -> Self {
        Self::start_with(None, &[])
    }

    /// Starts etcd with TLS on its client port (`tls`), or plaintext, and `extra` flags, and
    /// waits until it answers (its health is read on a separate plaintext metrics port).
    pub fn start_with(tls: Option<ServerTls>, extra: &[&str]) -> Self {
        let mut e = Self {
            child: None,
            dir: tempfile::tempdir().expect("temp dir"),
            client_port: free_port(),
            peer_port: free_port(),
            metrics_port: free_port(),
            tls,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        e.spawn();
        e
    }

    fn spawn(&mut self) {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(binary());
        cmd.args(["--name", "ferry-test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--listen-metrics-urls", &format!("http://127.0.0.1:{}", self.metrics_port)])
            .args(["--initial-cluster", &format!("ferry-test={peer}")]);
        cmd.args(&self.extra);
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file").arg(&t.cert).arg("--key-file").arg(&t.key);
            if let Some(ca) = &t.client_ca {
                cmd.arg("--client-cert-auth").arg("--trusted-ca-file").arg(ca);
            }
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(self.dir.path().join("etcd.log")).expect("log file")))
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let health = format!("127.0.0.1:{}", self.metrics_port);
        if crate::blocking(|| healthy_within(&health, Duration::from_secs(20))) {
            return;
        }
        panic!(
            "etcd did not come up; its log: {}",
            std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
        );
    }

    /// Its client endpoint, `127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Kills it (SIGKILL), keeping its data.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

/// Whether etcd at `addr` answers its health check within `within`.
fn healthy_within(addr: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            use std::io::{Read, Write};
            let _ = s.write_all(b"GET /health HTTP/1.0\r\n\r\n");
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            if out.contains("\"health\":\"true\"") {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
