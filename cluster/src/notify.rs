//! systemd readiness (`sd_notify`): with `Type=notify`, a daemon tells systemd it serves
//! (`READY=1`) and that it is stopping (`STOPPING=1`) with one datagram to `$NOTIFY_SOCKET`.
//! Without that variable nothing is sent.

use std::os::unix::net::UnixDatagram;

/// Sends `state` to `socket` (a path, or `@name` for the abstract namespace).
pub fn notify_to(socket: &str, state: &str) -> std::io::Result<()> {
    let s = UnixDatagram::unbound()?;
    match socket.strip_prefix('@') {
        #[cfg(target_os = "linux")]
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            s.send_to_addr(state.as_bytes(), &addr)?;
        }
        _ => {
            s.send_to(state.as_bytes(), socket)?;
        }
    }
    Ok(())
}

/// Sends `state` to `$NOTIFY_SOCKET` when systemd set it; failures are logged, not fatal.
pub fn notify(state: &str) {
    if let Ok(socket) = std::env::var("NOTIFY_SOCKET")
        && let Err(e) = notify_to(&socket, state)
    {
        tracing::warn!(%socket, error = %e, "sd_notify failed");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn notifications_reach_the_socket() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("notify");
        let rx = std::os::unix::net::UnixDatagram::bind(&path).expect("bind");
        super::notify_to(path.to_str().expect("utf-8"), "READY=1").expect("sent");
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).expect("received");
        assert_eq!(&buf[..n], b"READY=1");
        let abs = format!("@ferry-test-{}", std::process::id());
        let addr = {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(&abs.as_bytes()[1..]).expect("name")
        };
        let rx = std::os::unix::net::UnixDatagram::bind_addr(&addr).expect("bind abstract");
        super::notify_to(&abs, "STOPPING=1").expect("sent");
        let n = rx.recv(&mut buf).expect("received");
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
