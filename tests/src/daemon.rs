//! One Ferry daemon as a real process (`ferry prefill|decode|router …`), restartable with the
//! same flags, signalled and killable with SIGKILL: the chaos suite's cluster and the
//! migration test (`cli/tests`, which pass the `ferry` binary Cargo built for them).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// One daemon process, restartable with the same flags.
pub struct Daemon {
    /// Its name (`p0`, `d1`, `router`).
    pub name: String,
    /// The `ferry` binary.
    bin: String,
    args: Vec<String>,
    child: Option<Child>,
    /// Its gRPC address.
    pub grpc: String,
}

impl Daemon {
    /// A daemon run as `<bin> <args>` (`bin`: the `ferry` binary; started by
    /// [`start`](Self::start)) serving gRPC at `grpc`.
    pub fn new(bin: &str, name: &str, args: Vec<String>, grpc: String) -> Self {
        Self { name: name.into(), bin: bin.into(), args, child: None, grpc }
    }

    /// Starts it and waits for its ready line.
    pub fn start(&mut self) {
        let mut child = Command::new(&self.bin)
            .args(&self.args)
            .arg("--ready-line")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start a daemon");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, rx) = std::sync::mpsc::channel();
        let name = self.name.clone();
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                if l.starts_with("FERRY_READY") {
                    let _ = tx.send(());
                } else {
                    println!("[{name}] {l}");
                }
            }
        });
        // Model loading takes seconds: keep this runtime's other tasks (the clients) running.
        crate::blocking(|| rx.recv_timeout(Duration::from_secs(180)))
            .unwrap_or_else(|_| panic!("{} printed no ready line", self.name));
        self.child = Some(child);
    }

    /// Sends `sig` (SIGSTOP, SIGCONT) to the running process.
    pub fn signal(&self, sig: libc::c_int) {
        let pid = self.child.as_ref().expect("running").id();
        // SAFETY: kill(2) on our own child's pid, with a valid signal number.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0, "signal {sig} to {}", self.name);
    }

    /// Sets the running process's soft limit of open files below the descriptors it holds
    /// (8: stdio and its first few sockets), so every new socket or file fails with EMFILE
    /// even when one of its connections closes meanwhile; returns the limit it had. (A limit
    /// of exactly what it had open let the first connection to close make room: one CI run
    /// saw no failed accept.)
    pub fn exhaust_files(&self) -> u64 {
        self.set_file_limit(8)
    }

    /// Sets the running process's soft limit of open files; returns the one it had.
    pub fn set_file_limit(&self, soft: u64) -> u64 {
        let pid = self.child.as_ref().expect("running").id() as libc::pid_t;
        let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: prlimit(2) on our own child with valid pointers; a null new limit only reads.
        assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) }, 0);
        let new = libc::rlimit { rlim_cur: soft.min(old.rlim_max), rlim_max: old.rlim_max };
        // SAFETY: as above; the hard limit is unchanged.
        assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) }, 0, "prlimit");
        old.rlim_cur
    }

    /// Waits up to `within` for the process to exit by itself (a stop it was signalled);
    /// whether it did.
    pub fn exits_within(&mut self, within: Duration) -> bool {
        let Some(c) = self.child.as_mut() else { return true };
        let t = std::time::Instant::now();
        while t.elapsed() < within {
            if let Ok(Some(_)) = c.try_wait() {
                self.child = None;
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// SIGKILL.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}
