//! A tiny blocking HTTP/1.1 client over `std::net::TcpStream`, enough to drive the demo:
//! one request per connection (`Connection: close`), JSON bodies, Content-Length or
//! chunked responses.

use anyhow::{Context, Result, anyhow, bail};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const IO_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_RESPONSE: u64 = 64 * 1024 * 1024;

pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("response is not JSON: {:?}", truncate(&self.text(), 200)))
    }
}

/// Speaks to one `host:port`.
pub struct Client {
    addr: String,
    token: Option<String>,
}

impl Client {
    pub fn new(addr: &str) -> Self {
        Self {
            addr: addr.to_string(),
            token: None,
        }
    }

    pub fn set_token(&mut self, token: &str) {
        self.token = Some(token.to_string());
    }

    pub fn get(&self, path: &str) -> Result<Response> {
        self.request("GET", path, None)
    }

    pub fn post(&self, path: &str, body: Option<&serde_json::Value>) -> Result<Response> {
        self.request("POST", path, body)
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<Response> {
        let body = match body {
            Some(v) => serde_json::to_vec(v)?,
            None => Vec::new(),
        };
        self.send(method, path, &body, "application/json")
    }

    /// `PUT` of raw bytes (an image file).
    pub fn put_bytes(&self, path: &str, body: &[u8]) -> Result<Response> {
        self.send("PUT", path, body, "application/octet-stream")
    }

    fn send(&self, method: &str, path: &str, body: &[u8], content_type: &str) -> Result<Response> {
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
             Accept: application/json\r\nUser-Agent: passage-xtask\r\n\
             Content-Length: {}\r\n",
            self.addr,
            body.len()
        );
        if !body.is_empty() {
            head.push_str(&format!("Content-Type: {content_type}\r\n"));
        }
        if let Some(t) = &self.token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        head.push_str("\r\n");

        let what = || format!("{method} http://{}{path}", self.addr);
        let mut stream = self.connect().with_context(what)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        stream.write_all(head.as_bytes()).with_context(what)?;
        stream.write_all(body).with_context(what)?;
        stream.flush().with_context(what)?;
        let mut raw = Vec::new();
        stream
            .take(MAX_RESPONSE)
            .read_to_end(&mut raw)
            .with_context(what)?;
        parse_response(&raw).with_context(what)
    }

    fn connect(&self) -> Result<TcpStream> {
        let mut last = None;
        for a in self.addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(match last {
            Some(e) => anyhow!(e),
            None => anyhow!("{} resolves to no address", self.addr),
        })
    }
}

fn parse_response(raw: &[u8]) -> Result<Response> {
    let end = find(raw, b"\r\n\r\n").ok_or_else(|| anyhow!("no complete response header"))?;
    let head = std::str::from_utf8(&raw[..end]).context("response header is not UTF-8")?;
    let rest = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        bail!("not an HTTP/1 response: {:?}", truncate(status_line, 80));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {:?}", truncate(status_line, 80)))?;
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(
                value
                    .parse::<usize>()
                    .with_context(|| format!("bad Content-Length {value:?}"))?,
            );
        }
    }
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        if rest.len() < n {
            bail!("body cut short: {} of {n} bytes", rest.len());
        }
        rest[..n].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut data: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = find(data, b"\r\n").ok_or_else(|| anyhow!("chunk size line cut short"))?;
        let line = std::str::from_utf8(&data[..eol]).context("chunk size is not UTF-8")?;
        let hex = line.split(';').next().unwrap_or("").trim();
        let size =
            usize::from_str_radix(hex, 16).with_context(|| format!("bad chunk size {hex:?}"))?;
        data = &data[eol + 2..];
        if size == 0 {
            return Ok(out); // trailers, if any, are ignored
        }
        if data.len() < size + 2 {
            bail!("chunk cut short");
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_response;

    #[test]
    fn content_length() {
        let r = parse_response(
            b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}",
        )
        .unwrap();
        assert_eq!(r.status, 201);
        assert_eq!(r.body, b"{}");
    }

    #[test]
    fn chunked() {
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4;x=y\r\n\":1}\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.json().unwrap()["a"], 1);
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(parse_response(b"hello").is_err());
        assert!(parse_response(b"SSH-2.0\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}").is_err());
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n").is_err()
        );
    }
}
