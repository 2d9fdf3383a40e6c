//! Peer processes that print one JSON object per stdout line.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::Error;
use crate::peers::peer;

/// How many stderr lines a peer keeps for error messages.
const STDERR_KEEP: usize = 200;
/// How many klog error lines (see [`PeerProcess::klog_errors`]) a peer keeps.
const KLOG_ERRORS_KEEP: usize = 1000;
/// Set this environment variable (to anything) to echo every peer's stdout
/// and stderr lines on the test's stderr, prefixed with the peer's label.
pub const PEER_LOG_ENV: &str = "PLUGREG_PEER_LOG";

type Tail = Arc<Mutex<VecDeque<String>>>;

fn echo_enabled() -> bool {
    std::env::var_os(PEER_LOG_ENV).is_some()
}

fn tail_text(tail: &Tail) -> String {
    let t = tail.lock().unwrap_or_else(|e| e.into_inner());
    if t.is_empty() {
        return "(empty)".to_owned();
    }
    t.iter().cloned().collect::<Vec<_>>().join("\n")
}

/// A predicate matching lines whose `"event"` field equals `event`.
pub fn event_is(event: &str) -> impl FnMut(&Value) -> bool + '_ {
    move |v| v.get("event").and_then(Value::as_str) == Some(event)
}

/// A predicate matching lines whose `"event"` field equals `event` and whose
/// `"name"` field equals `name`.
pub fn event_named<'a>(event: &'a str, name: &'a str) -> impl FnMut(&Value) -> bool + 'a {
    move |v| {
        v.get("event").and_then(Value::as_str) == Some(event)
            && v.get("name").and_then(Value::as_str) == Some(name)
    }
}

/// The stdout of a peer, read line by line on a background thread and
/// delivered on a channel; each line is parsed as JSON.
///
/// Waiting always has a deadline, and a failed wait reports every line seen
/// so far (and the peer's stderr tail, if known).
#[derive(Debug)]
pub struct JsonLines {
    label: String,
    rx: mpsc::UnboundedReceiver<String>,
    seen: Vec<String>,
    closed: bool,
    stderr: Option<Tail>,
}

impl JsonLines {
    /// Reads `reader` (e.g. a child's stdout) line by line on a new thread.
    /// `label` names the peer in error messages.
    pub fn from_reader<R: Read + Send + 'static>(label: impl Into<String>, reader: R) -> Self {
        let label = label.into();
        let (tx, rx) = mpsc::unbounded_channel();
        let echo = echo_enabled().then(|| label.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { break };
                if let Some(l) = &echo {
                    eprintln!("[{l} stdout] {line}");
                }
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        JsonLines {
            label,
            rx,
            seen: Vec::new(),
            closed: false,
            stderr: None,
        }
    }

    fn with_stderr(mut self, tail: Tail) -> Self {
        self.stderr = Some(tail);
        self
    }

    /// Every stdout line received so far (matching or not), in order.
    pub fn seen(&self) -> &[String] {
        &self.seen
    }

    /// Waits at most `timeout` for the next JSON line for which `pred` is
    /// true, skipping (but remembering) the lines before it. Lines that are
    /// not JSON are remembered and skipped.
    pub async fn next_matching<F>(&mut self, mut pred: F, timeout: Duration) -> Result<Value, Error>
    where
        F: FnMut(&Value) -> bool,
    {
        self.wait_for("no matching line", &mut pred, timeout).await
    }

    /// Waits at most `timeout` for the next line with `"event": event`.
    pub async fn next_event(&mut self, event: &str, timeout: Duration) -> Result<Value, Error> {
        self.wait_for(
            &format!("no {event:?} event"),
            &mut event_is(event),
            timeout,
        )
        .await
    }

    /// Waits at most `timeout` for the next line with `"event": event` and
    /// `"name": name`.
    pub async fn next_event_named(
        &mut self,
        event: &str,
        name: &str,
        timeout: Duration,
    ) -> Result<Value, Error> {
        self.wait_for(
            &format!("no {event:?} event for name {name:?}"),
            &mut event_named(event, name),
            timeout,
        )
        .await
    }

    /// Waits at most `timeout` (in all) for the first line of each of `events` that `filter`
    /// accepts, in whatever order they arrive: for events a peer emits from concurrent tasks.
    /// Returns them by event name.
    pub async fn next_each(
        &mut self,
        events: &[&str],
        mut filter: impl FnMut(&Value) -> bool,
        timeout: Duration,
    ) -> Result<HashMap<String, Value>, Error> {
        let deadline = Instant::now() + timeout;
        let mut found = HashMap::new();
        while found.len() < events.len() {
            let missing: Vec<&str> = events
                .iter()
                .copied()
                .filter(|e| !found.contains_key(*e))
                .collect();
            let v = self
                .wait_for(
                    &format!("no {missing:?} events"),
                    &mut |v: &Value| {
                        missing.contains(&v["event"].as_str().unwrap_or_default()) && filter(v)
                    },
                    deadline.saturating_duration_since(Instant::now()),
                )
                .await?;
            found.insert(v["event"].as_str().unwrap_or_default().to_owned(), v);
        }
        Ok(found)
    }

    /// Collects the JSON lines that arrive within `window` (useful to assert
    /// that something does *not* happen). Returns early if stdout closes.
    pub async fn collect_for(&mut self, window: Duration) -> Vec<Value> {
        let deadline = Instant::now() + window;
        let mut out = Vec::new();
        while !self.closed {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Err(_) => break,
                Ok(None) => self.closed = true,
                Ok(Some(line)) => {
                    let parsed = serde_json::from_str::<Value>(&line);
                    self.seen.push(line);
                    if let Ok(v) = parsed {
                        out.push(v);
                    }
                }
            }
        }
        out
    }

    async fn wait_for(
        &mut self,
        what: &str,
        pred: &mut dyn FnMut(&Value) -> bool,
        timeout: Duration,
    ) -> Result<Value, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.closed {
                return Err(self.no_match(what, timeout, "stdout closed"));
            }
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Err(_) => return Err(self.no_match(what, timeout, "timed out")),
                Ok(None) => self.closed = true,
                Ok(Some(line)) => {
                    let parsed = serde_json::from_str::<Value>(&line);
                    self.seen.push(line);
                    if let Ok(v) = parsed
                        && pred(&v)
                    {
                        return Ok(v);
                    }
                }
            }
        }
    }

    fn no_match(&self, what: &str, waited: Duration, reason: &str) -> Error {
        let seen = if self.seen.is_empty() {
            "(none)".to_owned()
        } else {
            self.seen.join("\n")
        };
        let stderr = self
            .stderr
            .as_ref()
            .map_or_else(|| "(not captured)".to_owned(), tail_text);
        let reason = match reason {
            "timed out" => format!("timed out after {waited:?}"),
            r => r.to_owned(),
        };
        Error::NoMatch {
            peer: self.label.clone(),
            what: what.to_owned(),
            reason,
            details: format!("stdout lines seen so far:\n{seen}\nstderr tail:\n{stderr}"),
        }
    }
}

/// Which output stream of a process carries its JSON lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinesFrom {
    /// Standard output (the Go peers, the example plugin).
    Stdout,
    /// Standard error (programs that log JSON there, such as `plugreg manager`).
    Stderr,
}

/// A running peer process whose stdout is read as [`JsonLines`] and whose
/// stderr is kept (last lines) for error messages.
///
/// Dropping it kills the process (SIGKILL) and reaps it.
#[derive(Debug)]
pub struct PeerProcess {
    label: String,
    child: Child,
    lines: JsonLines,
    stderr: Tail,
    klog_errors: Tail,
    /// Reads the stream that is not the JSON lines; ends when the process has closed it.
    other_reader: Option<std::thread::JoinHandle<()>>,
}

/// Whether `line` is a klog error line: `E` then the date (`MMDD`) and a space, as
/// `E1125 14:12:10.045010 ...`.
pub fn is_klog_error(line: &str) -> bool {
    let b = line.as_bytes();
    b.len() > 5 && b[0] == b'E' && b[1..5].iter().all(u8::is_ascii_digit) && b[5] == b' '
}

impl PeerProcess {
    /// Spawns the built peer `name` (see [`peer`](crate::peer)) with `args`.
    pub fn spawn<I, S>(name: &str, args: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let path = peer(name)?;
        Self::spawn_program(name, &path, args)
    }

    /// Spawns any program with `args`; `label` names it in error messages.
    pub fn spawn_program<I, S>(label: &str, program: &Path, args: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new(program);
        cmd.args(args);
        Self::spawn_command(label, cmd, LinesFrom::Stdout)
    }

    /// Spawns `cmd`, reading JSON lines from the stream `from` and keeping the last lines of
    /// the other one for error messages.
    pub fn spawn_command(label: &str, mut cmd: Command, from: LinesFrom) -> Result<Self, Error> {
        let program = cmd.get_program().to_owned();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::io(format!("spawning {}", Path::new(&program).display()), e))?;
        let stdout: Box<dyn Read + Send> = Box::new(child.stdout.take().expect("stdout is piped"));
        let stderr: Box<dyn Read + Send> = Box::new(child.stderr.take().expect("stderr is piped"));
        let (lines_src, other) = match from {
            LinesFrom::Stdout => (stdout, stderr),
            LinesFrom::Stderr => (stderr, stdout),
        };
        let tail: Tail = Arc::new(Mutex::new(VecDeque::new()));
        let klog_errors: Tail = Arc::new(Mutex::new(VecDeque::new()));
        let other_reader = {
            let tail = Arc::clone(&tail);
            let errors = Arc::clone(&klog_errors);
            let echo = echo_enabled().then(|| label.to_owned());
            std::thread::spawn(move || {
                for line in BufReader::new(other).lines() {
                    let Ok(line) = line else { break };
                    if let Some(l) = &echo {
                        eprintln!("[{l}] {line}");
                    }
                    if is_klog_error(&line) {
                        let mut e = errors.lock().unwrap_or_else(|e| e.into_inner());
                        if e.len() < KLOG_ERRORS_KEEP {
                            e.push_back(line.clone());
                        }
                    }
                    let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                    if t.len() == STDERR_KEEP {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            })
        };
        let lines = JsonLines::from_reader(label, lines_src).with_stderr(Arc::clone(&tail));
        Ok(PeerProcess {
            label: label.to_owned(),
            child,
            lines,
            stderr: tail,
            klog_errors,
            other_reader: Some(other_reader),
        })
    }

    /// The label used in error messages.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The peer's stdout lines.
    pub fn lines(&mut self) -> &mut JsonLines {
        &mut self.lines
    }

    /// Same as [`JsonLines::next_matching`] on this peer's stdout.
    pub async fn next_matching<F>(&mut self, pred: F, timeout: Duration) -> Result<Value, Error>
    where
        F: FnMut(&Value) -> bool,
    {
        self.lines.next_matching(pred, timeout).await
    }

    /// Same as [`JsonLines::next_event`] on this peer's stdout.
    pub async fn next_event(&mut self, event: &str, timeout: Duration) -> Result<Value, Error> {
        self.lines.next_event(event, timeout).await
    }

    /// Same as [`JsonLines::next_event_named`] on this peer's stdout.
    pub async fn next_event_named(
        &mut self,
        event: &str,
        name: &str,
        timeout: Duration,
    ) -> Result<Value, Error> {
        self.lines.next_event_named(event, name, timeout).await
    }

    /// Same as [`JsonLines::next_each`] on this peer's stdout.
    pub async fn next_each(
        &mut self,
        events: &[&str],
        filter: impl FnMut(&Value) -> bool,
        timeout: Duration,
    ) -> Result<HashMap<String, Value>, Error> {
        self.lines.next_each(events, filter, timeout).await
    }

    /// The last lines the peer wrote to stderr.
    pub fn stderr_tail(&self) -> String {
        tail_text(&self.stderr)
    }

    /// Every klog error line (`E` + date, see [`is_klog_error`]) the peer has written to its
    /// log stream so far (the first 1,000), in order. Lines still in the pipe are not here yet:
    /// [`stop`](Self::stop) first to see them all.
    pub fn klog_errors(&self) -> Vec<String> {
        let e = self.klog_errors.lock().unwrap_or_else(|e| e.into_inner());
        e.iter().cloned().collect()
    }

    /// Sends SIGTERM, waits at most `timeout` for the process to exit, then until everything it
    /// wrote to its log stream has been read (so [`klog_errors`](Self::klog_errors) and
    /// [`stderr_tail`](Self::stderr_tail) are complete).
    pub async fn stop(&mut self, timeout: Duration) -> Result<ExitStatus, Error> {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.terminate()?;
        }
        let status = self.wait_exit(timeout).await?;
        if let Some(reader) = self.other_reader.take() {
            let _ = tokio::task::spawn_blocking(move || reader.join()).await;
        }
        Ok(status)
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> Result<(), Error> {
        self.signal(rustix::process::Signal::TERM)
    }

    /// Sends SIGINT.
    pub fn interrupt(&self) -> Result<(), Error> {
        self.signal(rustix::process::Signal::INT)
    }

    fn signal(&self, sig: rustix::process::Signal) -> Result<(), Error> {
        let pid = rustix::process::Pid::from_child(&self.child);
        rustix::process::kill_process(pid, sig)
            .map_err(|e| Error::io(format!("signalling {}", self.label), e.into()))
    }

    /// Waits at most `timeout` for the process to exit (polling its status).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self
                .child
                .try_wait()
                .map_err(|e| Error::io(format!("waiting for {}", self.label), e))?
            {
                return Ok(st);
            }
            if Instant::now() >= deadline {
                return Err(Error::StillRunning {
                    peer: self.label.clone(),
                    waited: timeout,
                    stderr: self.stderr_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
