//! Graceful shutdown: one signal every part of a daemon can wait on or check.

use tokio::sync::watch;

/// A cloneable shutdown signal.
#[derive(Debug, Clone)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
}

/// Triggers a [`Shutdown`].
#[derive(Debug)]
pub struct ShutdownTrigger {
    tx: watch::Sender<bool>,
}

impl Shutdown {
    /// A signal and its trigger.
    pub fn new() -> (ShutdownTrigger, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (ShutdownTrigger { tx }, Shutdown { rx })
    }

    /// Whether shutdown has begun.
    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once shutdown begins (or the trigger is dropped).
    pub async fn wait(mut self) {
        let _ = self.rx.wait_for(|&v| v).await;
    }
}

impl ShutdownTrigger {
    /// Begins shutdown.
    pub fn trigger(&self) {
        let _ = self.tx.send(true);
    }
}

/// Resolves on SIGINT or SIGTERM (for the daemons' `main`).
pub async fn signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
