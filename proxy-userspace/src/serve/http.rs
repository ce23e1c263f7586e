//! A minimal HTTP/1.1 server for the agent's probe and metrics endpoints: GET a path, get a
//! body. Enough for the kubelet and Prometheus; one request per connection.
use std::{sync::Arc, time::Duration};

use anyhow::Context;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

/// What a path answers.
pub struct Response {
    pub status: &'static str,
    pub content_type: &'static str,
    /// Headers beyond the fixed ones (name, value).
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Response {
    pub fn not_found() -> Self {
        Self {
            status: "404 Not Found",
            content_type: "text/plain",
            headers: Vec::new(),
            body: "404 page not found\n".into(),
        }
    }
}

/// Binds `addr`; `flag` names the address's flag for the error message.
pub async fn bind(addr: &str, flag: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| {
        format!(
            "binding {addr} ({flag}); if the address is in use, is kube-proxy still running on \
             this node? (or pass {flag}=\"\" to disable)"
        )
    })
}

/// Serves `handler(path)` for ever.
pub async fn serve(
    listener: TcpListener,
    handler: Arc<dyn Fn(&str) -> Response + Send + Sync>,
) -> anyhow::Result<()> {
    loop {
        let mut conn = match listener.accept().await {
            Ok((conn, _)) => conn,
            // Out of file descriptors, say: the probes must keep working once it passes.
            Err(e) => {
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await
            else {
                return;
            };
            let request = String::from_utf8_lossy(&buf[..n]);
            let path = request.split_whitespace().nth(1).unwrap_or("");
            let r = handler(path.split('?').next().unwrap_or(""));
            let extra: String = r
                .headers
                .iter()
                .map(|(name, value)| format!("{name}: {value}\r\n"))
                .collect();
            let response = format!(
                "HTTP/1.1 {}\r\nContent-Type: {}\r\nX-Content-Type-Options: nosniff\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{}",
                r.status,
                r.content_type,
                r.body.len(),
                r.body
            );
            let _ = conn.write_all(response.as_bytes()).await;
        });
    }
}
