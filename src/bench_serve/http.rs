//! A minimal HTTP/1.1 client for the benchmark: one request per connection
//! (`Connection: close`), the response body decoded incrementally (chunked or not) and
//! split into SSE events as bytes arrive, so each event gets the time it reached us.
//! No HTTP client dependency: the benchmark should measure the server, and a raw socket
//! keeps the client's own buffering out of the timestamps.

use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Where the server listens, from `--url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    /// Sent as `Authorization: Bearer` (`--api-key`).
    pub api_key: Option<String>,
}

impl Endpoint {
    fn auth_line(&self) -> String {
        self.api_key
            .as_ref()
            .map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"))
    }
}

/// `http://host[:port][/]`; https is refused (the benchmark speaks plain HTTP).
pub fn parse_url(url: &str) -> Result<Endpoint, String> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        format!("--url must start with http:// (got `{url}`; TLS is not supported)")
    })?;
    let authority = rest.trim_end_matches('/');
    if authority.contains('/') {
        return Err(format!(
            "--url takes the server root, without a path (got `{url}`)"
        ));
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => {
            let port = p
                .parse()
                .map_err(|_| format!("--url has a bad port `{p}`"))?;
            (h, port)
        }
        None => (authority, 80),
    };
    if host.is_empty() {
        return Err(format!("--url has no host (got `{url}`)"));
    }
    Ok(Endpoint {
        host: host.to_string(),
        port,
        api_key: None,
    })
}

/// The status line and the headers that decide how the body is framed.
#[derive(Debug, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub chunked: bool,
    pub content_length: Option<usize>,
}

/// Where the head ends: the index just past `\r\n\r\n`, once it has arrived.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

pub fn parse_head(head: &[u8]) -> Result<ResponseHead, String> {
    let text = std::str::from_utf8(head).map_err(|_| "response head is not UTF-8".to_string())?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.")
        .and_then(|s| s.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line `{status_line}`"))?;
    let mut head = ResponseHead {
        status,
        chunked: false,
        content_length: None,
    };
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            head.chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            head.content_length = Some(
                value
                    .parse()
                    .map_err(|_| format!("bad Content-Length `{value}`"))?,
            );
        }
    }
    Ok(head)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Reading a `size[;ext]\r\n` line.
    Size,
    Data {
        remaining: usize,
    },
    /// The `\r\n` after a chunk's data.
    DataEnd,
    /// After the last (empty) chunk: trailers are ignored.
    Done,
}

/// `Transfer-Encoding: chunked`, undone incrementally: bytes in any split, payload out.
pub struct ChunkedDecoder {
    state: ChunkState,
    pending: Vec<u8>,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        ChunkedDecoder {
            state: ChunkState::Size,
            pending: Vec::new(),
        }
    }
}

impl ChunkedDecoder {
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Appends the payload carried by `input` to `out`.
    pub fn push(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        self.pending.extend_from_slice(input);
        let mut at = 0;
        loop {
            let rest = &self.pending[at..];
            match self.state {
                ChunkState::Done => break,
                ChunkState::Size => {
                    let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
                        break;
                    };
                    let line = String::from_utf8_lossy(&rest[..eol]);
                    let hex = line.split(';').next().unwrap_or_default().trim();
                    let size = usize::from_str_radix(hex, 16)
                        .map_err(|_| format!("bad chunk size line `{line}`"))?;
                    at += eol + 2;
                    self.state = if size == 0 {
                        ChunkState::Done
                    } else {
                        ChunkState::Data { remaining: size }
                    };
                }
                ChunkState::Data { remaining } => {
                    if rest.is_empty() {
                        break;
                    }
                    let n = remaining.min(rest.len());
                    out.extend_from_slice(&rest[..n]);
                    at += n;
                    self.state = if n == remaining {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data {
                            remaining: remaining - n,
                        }
                    };
                }
                ChunkState::DataEnd => {
                    if rest.len() < 2 {
                        break;
                    }
                    if &rest[..2] != b"\r\n" {
                        return Err("chunk data not followed by CRLF".into());
                    }
                    at += 2;
                    self.state = ChunkState::Size;
                }
            }
        }
        self.pending.drain(..at);
        Ok(())
    }
}

/// Server-sent events, split incrementally: an event is its `data:` lines joined by
/// `\n`, complete at the blank line that ends it.
#[derive(Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// The data of every event that `bytes` completes.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        for &b in bytes {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
            let line = String::from_utf8_lossy(&self.line).into_owned();
            self.line.clear();
            if line.is_empty() {
                events.extend(self.data.take());
            } else if let Some(value) = line.strip_prefix("data:") {
                let value = value.strip_prefix(' ').unwrap_or(value);
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => self.data = Some(value.to_string()),
                }
            }
            // Comments (`:`) and other fields (`event:`, `id:`) carry nothing we time.
        }
        events
    }
}

/// A response as it arrives: `on_event` sees each SSE event of a 200 response with the
/// instant its bytes were read; any other status returns its body as the error.
pub async fn post_sse(
    endpoint: &Endpoint,
    path: &str,
    body: &str,
    mut on_event: impl FnMut(&str, Instant) -> Result<(), String>,
) -> Result<(), String> {
    let mut stream = connect(endpoint).await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {}:{}\r\n{}Content-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        endpoint.host,
        endpoint.port,
        endpoint.auth_line(),
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("sending the request: {e}"))?;
    let mut reader = BodyReader::new(stream).await?;
    if reader.head.status != 200 {
        let body = reader.read_to_end().await?;
        return Err(format!(
            "HTTP {}: {}",
            reader.head.status,
            String::from_utf8_lossy(&body).trim()
        ));
    }
    let mut sse = SseParser::default();
    while let Some((bytes, at)) = reader.next_bytes().await? {
        for event in sse.push(&bytes) {
            on_event(&event, at)?;
        }
    }
    Ok(())
}

/// The JSON body of `GET path`.
pub async fn get_json(endpoint: &Endpoint, path: &str) -> Result<serde_json::Value, String> {
    let mut stream = connect(endpoint).await?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {}:{}\r\n{}Accept: application/json\r\nConnection: close\r\n\r\n",
        endpoint.host,
        endpoint.port,
        endpoint.auth_line()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("sending GET {path}: {e}"))?;
    let mut reader = BodyReader::new(stream).await?;
    let body = reader.read_to_end().await?;
    if reader.head.status != 200 {
        return Err(format!(
            "GET {path}: HTTP {}: {}",
            reader.head.status,
            String::from_utf8_lossy(&body).trim()
        ));
    }
    serde_json::from_slice(&body).map_err(|e| format!("GET {path}: the body is not JSON: {e}"))
}

async fn connect(endpoint: &Endpoint) -> Result<TcpStream, String> {
    let stream = TcpStream::connect((endpoint.host.as_str(), endpoint.port))
        .await
        .map_err(|e| format!("cannot connect to {}:{}: {e}", endpoint.host, endpoint.port))?;
    // Small request writes and streamed reads: Nagle would only add latency.
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// A response body read off the socket, framing undone.
struct BodyReader {
    stream: TcpStream,
    head: ResponseHead,
    /// Body bytes that arrived with the head.
    early: Option<Vec<u8>>,
    chunked: Option<ChunkedDecoder>,
    num_read: usize,
}

impl BodyReader {
    async fn new(mut stream: TcpStream) -> Result<Self, String> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let end = loop {
            if let Some(end) = head_end(&buf) {
                break end;
            }
            let n = stream
                .read(&mut chunk)
                .await
                .map_err(|e| format!("reading the response: {e}"))?;
            if n == 0 {
                return Err("the server closed the connection before answering".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = parse_head(&buf[..end])?;
        let chunked = head.chunked.then(ChunkedDecoder::default);
        Ok(BodyReader {
            stream,
            head,
            early: Some(buf.split_off(end)),
            chunked,
            num_read: 0,
        })
    }

    /// The next payload bytes and when they arrived; `None` at the end of the body.
    async fn next_bytes(&mut self) -> Result<Option<(Vec<u8>, Instant)>, String> {
        loop {
            if self.chunked.as_ref().is_some_and(ChunkedDecoder::is_done)
                || self.head.content_length.is_some_and(|n| self.num_read >= n)
            {
                return Ok(None);
            }
            let raw = match self.early.take() {
                Some(early) if !early.is_empty() => early,
                _ => {
                    let mut chunk = vec![0u8; 16384];
                    let n = self
                        .stream
                        .read(&mut chunk)
                        .await
                        .map_err(|e| format!("reading the response body: {e}"))?;
                    if n == 0 {
                        if self.chunked.is_some() {
                            return Err("the connection closed in the middle of the body".into());
                        }
                        return Ok(None);
                    }
                    chunk.truncate(n);
                    chunk
                }
            };
            let at = Instant::now();
            let bytes = match &mut self.chunked {
                Some(decoder) => {
                    let mut out = Vec::new();
                    decoder.push(&raw, &mut out)?;
                    out
                }
                None => raw,
            };
            self.num_read += bytes.len();
            if !bytes.is_empty() {
                return Ok(Some((bytes, at)));
            }
        }
    }

    async fn read_to_end(&mut self) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        while let Some((bytes, _)) = self.next_bytes().await? {
            body.extend_from_slice(&bytes);
        }
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let ep = |host: &str, port| Endpoint {
            api_key: None,
            host: host.into(),
            port,
        };
        assert_eq!(
            parse_url("http://127.0.0.1:8000"),
            Ok(ep("127.0.0.1", 8000))
        );
        assert_eq!(parse_url("http://localhost:9/"), Ok(ep("localhost", 9)));
        assert_eq!(parse_url("http://example.com"), Ok(ep("example.com", 80)));
        assert!(parse_url("https://example.com").is_err());
        assert!(parse_url("http://h:99999").is_err());
        assert!(parse_url("http://h:80/v1").is_err());
        assert!(parse_url("http://:80").is_err());
    }

    #[test]
    fn response_heads() {
        let raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\ndata";
        let end = head_end(raw).unwrap();
        assert_eq!(&raw[end..], b"data");
        let head = parse_head(&raw[..end]).unwrap();
        assert_eq!(
            head,
            ResponseHead {
                status: 200,
                chunked: true,
                content_length: None
            }
        );
        let head = parse_head(b"HTTP/1.1 404 Not Found\r\nContent-Length: 12\r\n\r\n").unwrap();
        assert_eq!((head.status, head.content_length), (404, Some(12)));
        assert!(parse_head(b"SSH-2.0\r\n\r\n").is_err());
        assert_eq!(head_end(b"HTTP/1.1 200 OK\r\n"), None);
    }

    #[test]
    fn chunked_bodies_decode_in_any_split() {
        let raw = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        for split in 0..raw.len() {
            let mut d = ChunkedDecoder::default();
            let mut out = Vec::new();
            d.push(&raw[..split], &mut out).unwrap();
            // Done at the last chunk's size line; the trailer section is never waited for.
            assert_eq!(d.is_done(), split >= raw.len() - 2, "split at {split}");
            d.push(&raw[split..], &mut out).unwrap();
            assert_eq!(out, b"hello, world", "split at {split}");
            assert!(d.is_done());
        }
        let mut d = ChunkedDecoder::default();
        assert!(d.push(b"zz\r\n", &mut Vec::new()).is_err());
        let mut d = ChunkedDecoder::default();
        assert!(d.push(b"2\r\nabXY", &mut Vec::new()).is_err());
    }

    #[test]
    fn sse_events_split_across_reads() {
        let raw = b"data: {\"a\":1}\n\n: comment\r\ndata: x\r\ndata:y\r\n\r\ndata: [DONE]\n\n";
        for split in 0..raw.len() {
            let mut p = SseParser::default();
            let mut events = p.push(&raw[..split]);
            events.extend(p.push(&raw[split..]));
            assert_eq!(events, ["{\"a\":1}", "x\ny", "[DONE]"], "split at {split}");
        }
        // No event without its blank line.
        assert!(SseParser::default().push(b"data: half\n").is_empty());
    }
}
