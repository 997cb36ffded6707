//! The index service's HTTP/1.1 connections: each on a thread of its own that reads a request,
//! answers it and writes the answer in one write, so that a query makes no hop to another
//! thread (tiny_http's queue to one answering thread cost about 40 us a request here). Bounded:
//! connections, the request head, the body, idle time. The request parser has no I/O.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Largest request head taken (request line and headers).
const MAX_HEAD: usize = 16 << 10;
/// Connections open at once; more are answered 503 and closed.
const MAX_CONNS: usize = 64;
/// A kept-alive connection with no request for this long is closed.
const IDLE: Duration = Duration::from_secs(30);

/// One request, as the routes see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Request {
    pub(super) method: String,
    /// The path, without its query string.
    pub(super) path: String,
    pub(super) body: Vec<u8>,
}

/// What a request's head says.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Head {
    method: String,
    path: String,
    length: usize,
    /// The client asked for `100 Continue` before it sends the body (curl does past 1 KiB).
    expect_continue: bool,
    /// The connection ends after this answer.
    close: bool,
}

/// Why a request could not be read: the status to answer (then the connection closes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Refused(pub(super) u16, pub(super) String);

/// Parses a request head from the start of `buf`: `None` while it is incomplete, else the head
/// and its length (the body follows it).
fn parse_head(buf: &[u8], max_body: usize) -> Result<Option<(Head, usize)>, Refused> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return match buf.len() > MAX_HEAD {
            true => Err(Refused(
                431,
                format!("a request head over {MAX_HEAD} bytes"),
            )),
            false => Ok(None),
        };
    };
    let text = std::str::from_utf8(&buf[..end]).map_err(|_| bad("a head that is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let (method, target, version) = match (first.next(), first.next(), first.next()) {
        (Some(m), Some(t), Some(v)) if !m.is_empty() && t.starts_with('/') => (m, t, v),
        _ => return Err(bad("a malformed request line")),
    };
    let mut head = Head {
        method: method.to_string(),
        path: target.split('?').next().unwrap_or("").to_string(),
        length: 0,
        expect_continue: false,
        close: version != "HTTP/1.1",
    };
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| bad("a malformed header"))?;
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                head.length = value
                    .parse()
                    .map_err(|_| bad("a malformed Content-Length"))?;
                if head.length > max_body {
                    return Err(Refused(413, format!("a body over {max_body} bytes")));
                }
            }
            "transfer-encoding" => {
                return Err(Refused(411, "chunked bodies: send a Content-Length".into()))
            }
            "expect" => head.expect_continue = value.eq_ignore_ascii_case("100-continue"),
            "connection" if value.eq_ignore_ascii_case("close") => head.close = true,
            "connection" if value.eq_ignore_ascii_case("keep-alive") => head.close = false,
            _ => {}
        }
    }
    Ok(Some((head, end + 4)))
}

fn bad(why: &str) -> Refused {
    Refused(400, why.to_string())
}

/// An answer's bytes: status line, content type and length, the body.
fn answer_bytes(status: u16, body: &str, kind: &str, close: bool) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let conn = if close { "Connection: close\r\n" } else { "" };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n{conn}\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

/// Takes connections until `stop` is set (and a connection wakes the accept: see [`wake`]),
/// each answered by `handle` on a thread of its own.
pub(super) fn serve<H>(listener: &TcpListener, stop: &Arc<AtomicBool>, max_body: usize, handle: H)
where
    H: Fn(&Request) -> (u16, String, &'static str) + Send + Sync + 'static,
{
    let handle = Arc::new(handle);
    let open = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("HTTP: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if open.fetch_add(1, Ordering::AcqRel) >= MAX_CONNS {
            open.fetch_sub(1, Ordering::AcqRel);
            let busy = format!("{{\"error\": \"over {MAX_CONNS} connections\"}}");
            let _ = stream.write_all(&answer_bytes(503, &busy, "application/json", true));
            continue;
        }
        let (handle, count, stop) = (handle.clone(), open.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("kvlink-http".into())
            .spawn(move || {
                if let Err(e) = connection(stream, &stop, max_body, &*handle) {
                    tracing::debug!("HTTP connection ended: {e}");
                }
                count.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            // The closure never ran: its connection is not counted.
            open.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("HTTP: no thread for a connection: {e}");
        }
    }
}

/// Wakes a [`serve`] blocked in accept (after `stop` was set) by connecting to it.
pub(super) fn wake(addr: std::net::SocketAddr) {
    let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
}

/// Answers one connection's requests in turn until it closes, idles past [`IDLE`], sends
/// something unreadable, or the service stops.
fn connection<H>(
    mut s: TcpStream,
    stop: &AtomicBool,
    max_body: usize,
    handle: &H,
) -> std::io::Result<()>
where
    H: Fn(&Request) -> (u16, String, &'static str),
{
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(IDLE))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut buf: Vec<u8> = Vec::with_capacity(8 << 10);
    let mut chunk = vec![0u8; 64 << 10];
    while !stop.load(Ordering::Acquire) {
        let (head, at) = loop {
            match parse_head(&buf, max_body) {
                Ok(Some(h)) => break h,
                Ok(None) => {}
                Err(Refused(status, why)) => {
                    let body = serde_json::json!({ "error": why }).to_string();
                    return s.write_all(&answer_bytes(status, &body, "application/json", true));
                }
            }
            let n = s.read(&mut chunk)?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        if head.expect_continue && buf.len() < at + head.length {
            s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        // Only bytes that arrived are held: the buffer grows as the body comes in.
        while buf.len() < at + head.length {
            let n = s.read(&mut chunk)?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let rest = buf.split_off(at + head.length);
        let body = buf.split_off(at);
        buf = rest;
        let req = Request {
            method: head.method,
            path: head.path,
            body,
        };
        let (status, text, kind) = handle(&req);
        s.write_all(&answer_bytes(status, &text, kind, head.close))?;
        if head.close {
            return Ok(());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Option<(Head, usize)>, Refused> {
        parse_head(text.as_bytes(), 1000)
    }

    #[test]
    fn a_request_head_is_read_once_whole() {
        assert_eq!(head("POST /query HTTP/1.1\r\nContent-Len"), Ok(None));
        let text =
            "POST /query?x=1 HTTP/1.1\r\nHost: a\r\ncontent-length: 12\r\n\r\n{\"token_ids\"";
        let (h, at) = head(text).unwrap().unwrap();
        assert_eq!(
            (h.method.as_str(), h.path.as_str(), h.length),
            ("POST", "/query", 12)
        );
        assert!(!h.close && !h.expect_continue);
        assert_eq!(&text[at..], "{\"token_ids\"");
    }

    #[test]
    fn keep_alive_close_and_continue_follow_the_headers() {
        let h = |t: &str| head(t).unwrap().unwrap().0;
        assert!(h("GET /health HTTP/1.0\r\n\r\n").close);
        assert!(!h("GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").close);
        assert!(h("GET /health HTTP/1.1\r\nConnection: close\r\n\r\n").close);
        assert!(
            h("POST /q HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
                .expect_continue
        );
    }

    #[test]
    fn hostile_heads_are_refused_with_a_status() {
        let status = |t: &str| head(t).unwrap_err().0;
        assert_eq!(
            status("POST /q HTTP/1.1\r\nContent-Length: 1001\r\n\r\n"),
            413
        );
        assert_eq!(
            status("POST /q HTTP/1.1\r\nContent-Length: -1\r\n\r\n"),
            400
        );
        assert_eq!(
            status("POST /q HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n"),
            400
        );
        assert_eq!(
            status("POST /q HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            411
        );
        assert_eq!(status("GARBAGE\r\n\r\n"), 400);
        assert_eq!(status("GET /x HTTP/1.1\r\nno colon\r\n\r\n"), 400);
        let not_utf8 = parse_head(b"GET /x HTTP/1.1\r\nA: \xff\r\n\r\n", 1000);
        assert_eq!(not_utf8.unwrap_err().0, 400);
        let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(status(&long), 431);
    }

    #[test]
    fn an_answer_is_one_buffer_with_its_length() {
        let a = String::from_utf8(answer_bytes(404, "{}", "application/json", true)).unwrap();
        assert_eq!(
            a,
            "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\
             Connection: close\r\n\r\n{}"
        );
    }
}
