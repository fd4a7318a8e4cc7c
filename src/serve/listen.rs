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

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
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

use super::shutdown::Shutdown;

/// How long a client may stall (see the module's comment).
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub header: Duration,
    pub body: Duration,
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
            return Some(super::error::ApiError::new(axum::http::StatusCode::REQUEST_TIMEOUT, "invalid_request_error", s.to_string()).with_code("request_timeout"));
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
pub async fn serve(listener: TcpListener, app: Router, timeouts: Timeouts, shutdown: Arc<Shutdown>) -> Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.begun_wait() => break,
        };
        let Ok((stream, _)) = accepted else { continue }; // e.g. out of fds: the next accept may work
        let app = app.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let req = req.map(|inner| Body::new(TimedBody { inner, limit: timeouts.body, wait: None }));
            app.clone().oneshot(req)
        });
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new()).header_read_timeout(timeouts.header);
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
