//! A minimal HTTP/1.0 GET, enough to read the daemon's `/healthz` and `/metrics` without an
//! HTTP client dependency.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Sends `GET path` to `addr` and returns the status code and the body.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    // HTTP/1.0: the server closes the connection after the response, so no chunked bodies and
    // no keep-alive to handle.
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> io::Result<(u16, String)> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| io::Error::other("incomplete HTTP response"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| io::Error::other("malformed HTTP status line"))?;
    Ok((code, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_status_and_body() {
        let (code, body) =
            parse_response(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok").unwrap();
        assert_eq!((code, body.as_str()), (200, "ok"));
        assert!(parse_response(b"HTTP/1.0 200 OK\r\n").is_err());
    }
}
