//! The accept loop: hyper's HTTP/1 connections with timeouts against clients that stall or idle
//! (axum's `serve` arms none, so a connection stalled in its headers or body, or idle between
//! requests, kept its socket for ever: slowloris up to the fd limit), and the graceful drain of
//! `shutdown`.
//!
//! - `header`: the time a request's head may take, counted from when the connection starts waiting
//!   for it. hyper arms it also while a keep-alive connection waits for its next request, so it is
//!   the idle timeout too: one setting, not two.
//! - `body`: the longest wait for the next piece of a request's body. A slow upload that keeps
//!   sending is never cut; one that stops is answered 408 (and its connection closed).
//! - `connections_per_ip` (optional): a client address with that many connections open gets
//!   429 on its next one, written straight to the socket, which is then closed (as nginx's
//!   `limit_conn`): one host cannot take every socket of the server.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Result;
use axum::body::{Body, Bytes};
use axum::http::Request;
use axum::Router;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tower::ServiceExt;

use super::metrics::Metrics;
use super::shutdown::Shutdown;

/// How long a client may stall, and how many connections it may hold (see the module's comment).
#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    pub header: Duration,
    pub body: Duration,
    pub connections_per_ip: Option<usize>,
}

/// Open connections per client address.
#[derive(Default)]
struct OpenPerIp(Mutex<HashMap<IpAddr, usize>>);

/// One open connection of `ip`, counted while it lives.
struct ConnectionSlot {
    table: Arc<OpenPerIp>,
    ip: IpAddr,
}

impl OpenPerIp {
    /// A slot for `ip`, or `None` when it holds `limit` already.
    fn take(self: &Arc<Self>, ip: IpAddr, limit: Option<usize>) -> Option<ConnectionSlot> {
        let mut open = self.0.lock().unwrap();
        let n = open.entry(ip).or_default();
        if limit.is_some_and(|l| *n >= l) {
            return None;
        }
        *n += 1;
        Some(ConnectionSlot { table: self.clone(), ip })
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut open = self.table.0.lock().unwrap();
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// Answers a connection over its address's limit with 429 (OpenAI's error shape) and closes it.
async fn refuse(mut stream: tokio::net::TcpStream, limit: usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = serde_json::json!({"error": {
        "message": format!("This client address has {limit} connections open already (--max-connections-per-ip); close one or reuse it."),
        "type": "rate_limit_error", "param": null, "code": "too_many_connections"}})
    .to_string();
    let head = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    if stream.write_all(format!("{head}{body}").as_bytes()).await.is_ok() {
        let _ = stream.shutdown().await;
        // Read what the client sent before closing, so the answer is not lost to a reset.
        let mut sink = [0u8; 4096];
        let _ =
            tokio::time::timeout(Duration::from_secs(1), async { while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {} }).await;
    }
}

/// The error a stalled body ends with; `request::json_body` and the upload answer 408 for it.
#[derive(Debug)]
pub struct BodyStalled(pub Duration);

impl std::fmt::Display for BodyStalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body stalled: nothing arrived for {:.0} s (--body-timeout)", self.0.as_secs_f64())
    }
}

impl std::error::Error for BodyStalled {}

/// 408 when `e` (or what caused it) is a stalled body.
pub fn stalled(e: &(dyn std::error::Error + 'static)) -> Option<super::error::ApiError> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(s) = c.downcast_ref::<BodyStalled>() {
            return Some(
                super::error::ApiError::new(axum::http::StatusCode::REQUEST_TIMEOUT, "invalid_request_error", s.to_string())
                    .with_code("request_timeout"),
            );
        }
        cause = c.source();
    }
    None
}

/// A request body that fails with [`BodyStalled`] when no frame comes for `limit`.
struct TimedBody {
    inner: Incoming,
    limit: Duration,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                self.wait = None;
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let limit = self.limit;
                let wait = self.wait.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match wait.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyStalled(limit))))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `app` on `listener` until `shutdown` begins, then stops accepting and waits for the
/// open connections to finish (their streams end by the grace period, see `shutdown`).
pub async fn serve(listener: TcpListener, app: Router, limits: ClientLimits, metrics: Arc<Metrics>, shutdown: Arc<Shutdown>) -> Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let open = Arc::new(OpenPerIp::default());
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.begun_wait() => break,
        };
        let Ok((stream, peer)) = accepted else { continue }; // e.g. out of fds: the next accept may work
        let Some(slot) = open.take(peer.ip(), limits.connections_per_ip) else {
            metrics.request(429);
            tokio::spawn(refuse(stream, limits.connections_per_ip.unwrap_or(0)));
            continue;
        };
        let app = app.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let req = req.map(|inner| Body::new(TimedBody { inner, limit: limits.body, wait: None }));
            app.clone().oneshot(req)
        });
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new()).header_read_timeout(limits.header);
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
