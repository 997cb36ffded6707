//! The read task's pure parts: which failure a read reports, and in what words.

use super::outcome::{failure_reason, first_failure, Failure};
use super::*;
use std::time::Duration;

fn outcome(result: Result<()>) -> SourceOutcome {
    SourceOutcome {
        conn: None,
        result: Ok(result.map(|()| SourceReport {
            bytes: 1,
            segments: 1,
            blocks: 1,
            work_requests: 1,
            transport: "tcp",
            connected: Instant::now(),
            done: Instant::now(),
            confirmed: None,
            tell_received: false,
        })),
    }
}

fn lost(peer: &str) -> Error {
    Error::ConnectionLost {
        peer: peer.into(),
        reason: "reset".into(),
    }
}

fn job(peers: &[&str]) -> ReadJob {
    ReadJob {
        sources: peers
            .iter()
            .enumerate()
            .map(|(i, p)| Source {
                peer: p.to_string(),
                rank: Some((TpRank::new(i as u32, peers.len() as u32), 0..1)),
            })
            .collect(),
        id: "r".into(),
        remote_id: "r".into(),
        local: vec![],
        remote: vec![],
        remote_tokens: 16,
        first_tokens: vec![],
        hold: None,
        confirm_with_data: true,
        tensors: None,
        started: Instant::now(),
        deadline: tokio::time::Instant::now(),
    }
}

#[test]
fn the_first_failure_is_the_one_that_says_most() {
    assert!(first_failure(&[outcome(Ok(())), outcome(Ok(()))], false).is_none());
    // A source stopped because another failed says only that: the other's error wins.
    let stopped = Error::Cancelled("stopped".into());
    let f = first_failure(
        &[
            outcome(Ok(())),
            outcome(Err(stopped)),
            outcome(Err(lost("b"))),
        ],
        false,
    )
    .unwrap();
    assert_eq!((f.source, f.expired), (Some(2), false));
    assert!(matches!(f.error, Error::ConnectionLost { .. }));
    // A timeout is an expiry only once the read's deadline passed.
    let timeout = || Error::Timeout {
        what: "x".into(),
        after: Duration::from_secs(1),
    };
    assert!(
        !first_failure(&[outcome(Err(timeout()))], false)
            .unwrap()
            .expired
    );
    assert!(
        first_failure(&[outcome(Err(timeout()))], true)
            .unwrap()
            .expired
    );
}

#[test]
fn the_reason_names_the_failed_rank_and_why_it_ended() {
    let f = |source, expired| Failure {
        source,
        expired,
        error: lost("b:1"),
    };
    let two = job(&["a:1", "b:1"]);
    let r = failure_reason(&f(Some(1), false), &two, false, Duration::from_secs(9));
    assert!(
        r.starts_with("prefill rank 1 (b:1): connection to b:1 lost"),
        "{r}"
    );
    let one = job(&["a:1"]);
    let r = failure_reason(&f(Some(0), false), &one, false, Duration::from_secs(9));
    assert!(
        r.starts_with("connection to b:1 lost"),
        "one source is not named: {r}"
    );
    let r = failure_reason(&f(Some(0), true), &one, false, Duration::from_secs(9));
    assert!(
        r.starts_with("not complete within the request timeout of 9s (peer a:1)"),
        "{r}"
    );
    let r = failure_reason(&f(None, true), &one, true, Duration::from_secs(9));
    assert!(
        r.starts_with("engine shutting down ("),
        "closing says so first: {r}"
    );
}
