//! `ferry up --processes`: each daemon as its own `ferry prefill|decode|router` process with
//! `--ready-line`. The workers start together; the router starts once they serve, with their
//! addresses. Their logs are forwarded to stderr, prefixed with the daemon's name. Ctrl-C (or
//! SIGTERM) stops the router, then the workers, with SIGTERM (each stops gracefully), and
//! SIGKILLs what is still there 20 s later. A daemon that dies takes the cluster down. On
//! Linux every child also gets SIGTERM if this supervisor dies.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry_cluster::roles::PeerRole;

use crate::daemons::READY;
use crate::up::{Endpoint, UpArgs};

/// The `key=value` pairs of a ready line.
type Ready = Vec<(String, String)>;

/// A daemon process.
struct Proc {
    name: String,
    child: Child,
    /// Its ready line.
    ready: Ready,
}

impl Proc {
    fn addr(&self, key: &str) -> anyhow::Result<SocketAddr> {
        let v = self.ready.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        v.with_context(|| format!("{} did not report {key}", self.name))?.parse().context("a bad address")
    }
}

fn spawn(name: &str, mut cmd: Command) -> anyhow::Result<(Child, mpsc::Receiver<Ready>)> {
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", crate::up::LOG);
    }
    cmd.arg("--ready-line").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let out = child.stdout.take().context("no stdout")?;
    let (tx, rx) = mpsc::channel();
    let prefix = name.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            match line.strip_prefix(READY) {
                Some(rest) => {
                    let kv =
                        rest.split_whitespace().filter_map(|p| p.split_once('=')).map(|(k, v)| (k.into(), v.into()));
                    let _ = tx.send(kv.collect());
                }
                None => eprintln!("[{prefix}] {line}"),
            }
        }
    });
    Ok((child, rx))
}

fn wait_ready(
    name: &str,
    child: &mut Child,
    rx: &mpsc::Receiver<Vec<(String, String)>>,
) -> anyhow::Result<Vec<(String, String)>> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(kv) => return Ok(kv),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.wait()?;
                bail!("{name} exited before it was ready ({status})");
            }
            Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() > deadline => bail!("{name} not ready after 600 s"),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

fn worker_cmd(exe: &Path, role: &str, id: &str, args: &UpArgs, model: &Path) -> Command {
    let mut c = Command::new(exe);
    c.arg(role).arg("--model").arg(model).args(["--worker-id", id]);
    c.args(["--pool-pages", &args.pool_pages.to_string(), "--page-size", &args.page_size.to_string()]);
    c.args(["--chunked-prefill-size", &args.chunked_prefill_size.to_string(), "--transfer", args.transfer.as_str()]);
    c.args(["--device", &args.device.to_string(), "--cpu-math", &args.cpu_math.to_string()]);
    if args.kv_host_mirror {
        c.arg("--kv-host-mirror");
    }
    if let Some(e) = &args.telemetry.otlp_endpoint {
        c.args(["--otlp-endpoint", e]);
    }
    c
}

fn terminate(procs: &mut [Proc], grace: Duration) {
    for p in procs.iter() {
        // SAFETY: kill(2) with a pid we spawned and have not reaped.
        unsafe {
            libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    for p in procs.iter_mut() {
        loop {
            match p.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    eprintln!("ferry up: {} did not stop in time; killing it", p.name);
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// Runs the cluster as processes until a signal or a daemon's death.
pub fn run(args: &UpArgs, model: &Path) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("the path of this binary")?;
    let id = crate::up::Identity::new(args)?;
    let mut workers: Vec<Proc> = Vec::new();
    let started = (|| -> anyhow::Result<Proc> {
        let mut pending = Vec::new();
        for (role, n) in [(PeerRole::Prefill, args.prefill), (PeerRole::Decode, args.decode)] {
            for i in 0..n {
                let name = format!("{role}-{i}");
                let mut cmd = worker_cmd(&exe, role.as_str(), &name, args, model);
                cmd.args(crate::up::tls_flags(&id.tls(&name, role)?));
                let (child, rx) = spawn(&name, cmd)?;
                pending.push((name, child, rx));
            }
        }
        for (name, mut child, rx) in pending {
            match wait_ready(&name, &mut child, &rx) {
                Ok(ready) => workers.push(Proc { name, child, ready }),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(e);
                }
            }
        }
        let addrs = |role: &str| -> anyhow::Result<Vec<SocketAddr>> {
            workers.iter().filter(|p| p.name.starts_with(role)).map(|p| p.addr("grpc")).collect()
        };
        let r = crate::up::router_args(args, model, &addrs("prefill")?, &addrs("decode")?);
        let mut c = Command::new(&exe);
        c.arg("router").arg("--model").arg(model);
        for p in &r.prefill {
            c.args(["--prefill", p]);
        }
        for d in &r.decode {
            c.args(["--decode", d]);
        }
        c.args(["--grpc-addr", &r.grpc_addr.to_string(), "--http-addr", &r.http_addr.to_string()]);
        c.args(["--policy", &crate::flag_name(&r.policy), "--local-prefill-below", &r.local_prefill_below.to_string()]);
        c.args(["--local-prefill-max", &r.local_prefill_max.to_string()]);
        if r.disable_pull {
            c.arg("--disable-pull");
        }
        c.args(["--page-size", &r.page_size.to_string()]);
        if let Some(e) = &args.telemetry.otlp_endpoint {
            c.args(["--otlp-endpoint", e]);
        }
        c.args(crate::up::tls_flags(&id.tls("router", PeerRole::Router)?));
        if let Some(n) = &r.served_model_name {
            c.args(["--served-model-name", n]);
        }
        let (mut child, rx) = spawn("router", c)?;
        let ready = wait_ready("router", &mut child, &rx)?;
        Ok(Proc { name: "router".into(), child, ready })
    })();
    let mut router = match started {
        Ok(r) => r,
        Err(e) => {
            terminate(&mut workers, Duration::from_secs(20));
            return Err(e);
        }
    };
    let mut list = Vec::new();
    for p in workers.iter().chain(std::iter::once(&router)) {
        list.push(Endpoint {
            name: p.name.clone(),
            grpc: p.addr("grpc")?,
            metrics: p.addr("metrics")?,
            pid: Some(p.child.id()),
        });
    }
    crate::up::announce(model, &list, router.addr("http")?, router.addr("grpc")?);

    // Serve until a signal or until a daemon dies.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let died = rt.block_on(async {
        let watch = async {
            loop {
                for p in workers.iter_mut().chain(std::iter::once(&mut router)) {
                    if let Ok(Some(status)) = p.child.try_wait() {
                        return format!("{} exited ({status})", p.name);
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::select! {
            _ = ferry_cluster::shutdown::signal() => None,
            why = watch => Some(why),
        }
    });
    println!("ferry up: stopping");
    terminate(std::slice::from_mut(&mut router), Duration::from_secs(20));
    terminate(&mut workers, Duration::from_secs(20));
    println!("ferry up: stopped");
    match died {
        Some(why) => bail!("{why}; the cluster was stopped"),
        None => Ok(()),
    }
}
