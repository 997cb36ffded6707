//! Control plane: the handshake service (descriptor exchange and compatibility check) and the
//! per-peer control connection that carries done/abort notices and keep-alives.
//!
//! Wire format: see [`frame`] and `docs/protocol.md`.

mod client;
pub mod frame;
mod handler;
mod handshake;
pub mod messages;
mod server;

use std::time::Duration;

pub(crate) use client::{Confirmation, ControlClient, Handshake, Sent};
pub(crate) use handler::ControlHandler;
pub(crate) use server::serve;

/// Deadlines of the control plane.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ControlTimeouts {
    /// TCP connect.
    pub connect: Duration,
    /// From sending `Hello` to receiving the descriptor (and, server side, from accept to
    /// receiving `Hello`).
    pub handshake: Duration,
    /// Interval of keep-alive pings; a connection silent for three intervals is dead.
    pub keepalive: Duration,
}
