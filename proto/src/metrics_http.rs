//! A minimal plain-HTTP server for Prometheus scrapes and probes:
//!
//! * `GET /metrics`: the text the caller renders;
//! * `GET /healthz`: `200 ok` for as long as the process serves it (liveness);
//! * `GET /readyz`: `200 ready` when the caller's readiness check passes,
//!   else `503` with its one-line reason (readiness);
//!
//! anything else gets 404. One request per connection, bounded header size
//! and read time, so a bad client cannot hold it up.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Renders the metrics text on each scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// The readiness check: `Err(reason)` while not ready.
pub type Ready = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What the server answers.
#[derive(Clone)]
pub struct Routes {
    /// `GET /metrics`.
    pub metrics: Render,
    /// `GET /readyz`.
    pub ready: Ready,
}

/// Content type of the OpenMetrics text format prometheus-client writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

const MAX_HEAD: usize = 8192;
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves scrapes and probes on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, routes: Routes) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let routes = routes.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, routes).await {
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

async fn handle(mut stream: TcpStream, routes: Routes) -> std::io::Result<()> {
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
    let target = parts.next().unwrap_or_default();
    // Probes may carry a query string (`/readyz?verbose`): ignored.
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    match (method, path) {
        (b"GET", b"/metrics") => {
            let body = (routes.metrics)();
            respond(&mut stream, "200 OK", CONTENT_TYPE, &body).await
        }
        (b"GET", b"/healthz") => respond(&mut stream, "200 OK", "text/plain", "ok\n").await,
        (b"GET", b"/readyz") => match (routes.ready)() {
            Ok(()) => respond(&mut stream, "200 OK", "text/plain", "ready\n").await,
            Err(why) => {
                let body = format!("not ready: {}\n", why.replace(['\r', '\n'], " "));
                respond(&mut stream, "503 Service Unavailable", "text/plain", &body).await
            }
        },
        (b"GET", _) => {
            respond(
                &mut stream,
                "404 Not Found",
                "text/plain",
                "try /metrics, /healthz or /readyz\n",
            )
            .await
        }
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_metrics_liveness_and_readiness() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let ready = Arc::new(AtomicBool::new(false));
        let r = ready.clone();
        let task = tokio::spawn(serve(
            l,
            Routes {
                metrics: Arc::new(|| "m_total 1\n".to_owned()),
                ready: Arc::new(move || {
                    if r.load(Ordering::Relaxed) {
                        Ok(())
                    } else {
                        Err("no map\nyet".to_owned())
                    }
                }),
            },
        ));
        assert!(get(addr, "/metrics").await.ends_with("m_total 1\n"));
        let h = get(addr, "/healthz").await;
        assert!(
            h.starts_with("HTTP/1.1 200 OK") && h.ends_with("ok\n"),
            "{h}"
        );
        let n = get(addr, "/readyz").await;
        assert!(n.starts_with("HTTP/1.1 503"), "{n}");
        assert!(n.ends_with("not ready: no map yet\n"), "{n}");
        ready.store(true, Ordering::Relaxed);
        let y = get(addr, "/readyz?verbose").await;
        assert!(
            y.starts_with("HTTP/1.1 200 OK") && y.ends_with("ready\n"),
            "{y}"
        );
        assert!(get(addr, "/nope").await.starts_with("HTTP/1.1 404"));
        task.abort();
    }
}
