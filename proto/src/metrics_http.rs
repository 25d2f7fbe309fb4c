//! A minimal plain-HTTP server for Prometheus scrapes: `GET /metrics` returns
//! the text the caller renders; anything else gets 404. One request per
//! connection, bounded header size and read time, so a bad client cannot hold
//! it up.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Renders the metrics text on each scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Content type of the OpenMetrics text format prometheus-client writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

const MAX_HEAD: usize = 8192;
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves scrapes on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, render: Render) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let render = render.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, render).await {
                        tracing::debug!(%peer, error = %e, "metrics connection failed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics listener accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn handle(mut stream: TcpStream, render: Render) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let complete = tokio::time::timeout(READ_TIMEOUT, async {
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Ok::<bool, std::io::Error>(false);
            }
            head.extend_from_slice(&buf[..n]);
            if head.windows(4).any(|w| w == b"\r\n\r\n") {
                return Ok(true);
            }
            if head.len() > MAX_HEAD {
                return Ok(false);
            }
        }
    })
    .await
    .unwrap_or(Ok(false))?;
    if !complete {
        return respond(
            &mut stream,
            "400 Bad Request",
            "text/plain",
            "bad request\n",
        )
        .await;
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let method = parts.next().unwrap_or_default();
    let path = parts.next().unwrap_or_default();
    match (method, path) {
        (b"GET", b"/metrics") => {
            let body = render();
            respond(&mut stream, "200 OK", CONTENT_TYPE, &body).await
        }
        (b"GET", _) => respond(&mut stream, "404 Not Found", "text/plain", "try /metrics\n").await,
        _ => {
            respond(
                &mut stream,
                "405 Method Not Allowed",
                "text/plain",
                "only GET\n",
            )
            .await
        }
    }
}

async fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
