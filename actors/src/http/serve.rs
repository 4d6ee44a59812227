//! Running the HTTP server, and stopping it without cutting anyone short who could finish.
//!
//! Connections: a client has `server.header_timeout_s` for its headers and
//! `server.body_timeout_s` for its body ([`super::body`]); an idle keep-alive connection closes
//! after `server.keep_alive_s`; a half-closed connection (the client shut its sending side) is
//! a client that went away, so its request is dropped and cancelled rather than run to the end
//! for nobody.
//!
//! Shutdown, on SIGINT or SIGTERM: the server stops accepting connections and the scheduler
//! stops taking requests (503 `shutting_down` on connections still open); requests in flight
//! run to their end for up to the grace. Those still running then are cut: each ends with an
//! OpenAI-shaped error (a streamed one with an `error` event and `[DONE]`), is logged, and
//! [`serve`] reports how many, so the process can exit non-zero. A second signal cuts at once.

use std::time::Duration;

use actix_web::http::KeepAlive;
use actix_web::middleware::from_fn;
use actix_web::{App, HttpServer, web};

use super::ApiState;
use crate::start::Handles;

/// How the server listens and stops.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub address: String,
    /// Threads answering HTTP.
    pub workers: usize,
    pub header_timeout: Duration,
    /// Zero closes each connection after one response.
    pub keep_alive: Duration,
    pub max_connections: usize,
    /// How long requests in flight may run on after a stop signal.
    pub shutdown_grace: Duration,
}

/// How serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Requests still in flight when the shutdown grace ran out, ended with an error.
    pub cut: usize,
}

/// After a cut, how long the cut requests' answers have to go out before the workers drop
/// their connections.
const AFTER_CUT: Duration = Duration::from_secs(10);

/// How often histogram samples are folded in, so that they do not pile up between scrapes.
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

/// Serves the API until a stop signal, then shuts down as the module says.
pub async fn serve(state: ApiState, options: &ServeOptions) -> std::io::Result<Served> {
    let handles = state.handles.clone();
    if let Some(prometheus) = state.prometheus.clone() {
        actix_rt::spawn(async move {
            let mut ticks = actix_rt::time::interval(METRICS_UPKEEP);
            loop {
                ticks.tick().await;
                prometheus.run_upkeep();
            }
        });
    }
    let keep_alive = if options.keep_alive.is_zero() {
        KeepAlive::Disabled
    } else {
        KeepAlive::Timeout(options.keep_alive)
    };
    let server = HttpServer::new(move || {
        // Runs on each worker's thread: the streams its handlers read get their tokens
        // through one inbox a worker, woken once a step.
        crate::install_stream_inbox();
        App::new()
            .app_data(web::Data::new(state.clone()))
            .wrap(from_fn(super::auth::require_key))
            .configure(super::routes)
    })
    .workers(options.workers.max(1))
    // A streamed chunk goes out at once: with Nagle's algorithm it waited for the client's
    // delayed acknowledgement of the one before, 40 ms on Linux, which was every streamed
    // answer's time to first token on a kept-alive connection.
    .tcp_nodelay(true)
    .keep_alive(keep_alive)
    .client_request_timeout(options.header_timeout)
    .h1_allow_half_closed(false)
    .max_connections(options.max_connections)
    .disable_signals()
    .shutdown_timeout((options.shutdown_grace + AFTER_CUT).as_secs())
    .bind(&options.address)?
    .run();
    let stopper = actix_rt::spawn(stop_on_signal(
        handles,
        server.handle(),
        options.shutdown_grace,
    ));
    server.await?;
    let cut = stopper.await.unwrap_or(0);
    Ok(Served { cut })
}

/// Waits for a stop signal, then drains; returns how many requests the grace had to cut.
async fn stop_on_signal(
    handles: Handles,
    server: actix_web::dev::ServerHandle,
    grace: Duration,
) -> usize {
    let Ok(mut signals) = Signals::new() else {
        tracing::error!("cannot listen for stop signals; stop the server with SIGKILL");
        return 0;
    };
    let signal = signals.next().await;
    let stats = handles.stats().await.scheduler;
    tracing::info!(
        "{signal}: no longer accepting; {} running and {} queued requests may finish within {} s",
        stats.running,
        stats.queued,
        grace.as_secs()
    );
    handles.drain().await;
    let stopped = server.stop(true);
    tokio::pin!(stopped);
    tokio::select! {
        () = &mut stopped => return 0,
        () = actix_rt::time::sleep(grace) => {
            tracing::warn!("the shutdown grace of {} s ran out", grace.as_secs());
        }
        signal = signals.next() => tracing::warn!("{signal} again: cutting every request now"),
    }
    let cut = handles.cut_all().await;
    tracing::warn!("cut {cut} requests in flight; they end with a shutting_down error");
    stopped.await;
    cut
}

/// SIGINT and SIGTERM.
struct Signals {
    interrupt: actix_rt::signal::unix::Signal,
    terminate: actix_rt::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        use actix_rt::signal::unix::{SignalKind, signal};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// The name of the next signal.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
        }
    }
}
