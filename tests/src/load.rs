//! A load generator: real traffic from a sandbox pod to Service addresses while a test changes
//! things (restarts the agent, rolls endpoints), recording every failure with its time.
//!
//! Three kinds of clients, each on its own thread in the source pod's namespace:
//! - short TCP connections in a loop: connect, send a line, read the backend's name, close;
//! - a few long-lived TCP connections, one line every `long_interval` (plus a little
//!   spread), each recording whether it ever broke or was answered by another backend;
//! - UDP request/response, a fresh socket (a new flow) for each datagram.
//!
//! ```no_run
//! # use proxy_tests::{Sandbox, load::{self, LoadConfig}};
//! # fn f(sandbox: &Sandbox) -> anyhow::Result<()> {
//! let mut config = LoadConfig::new(&sandbox.pod("client").ns);
//! config.tcp = Some("10.96.0.10:80".parse()?);
//! let load = load::start(config)?;
//! // ... change things ...
//! load.stop().assert_no_failures();
//! # Ok(()) }
//! ```
//!
//! The generator only talks to sandbox addresses (Service or pod ranges) from a sandbox
//! namespace, and stops by itself after `max_duration` or `max_attempts` per client.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{NS_PREFIX, Netns, TcpConn, client_timeout};

/// What to run, where, for how long.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// The namespace the clients run in (a sandbox pod's).
    pub from: String,
    /// Target of the short and long-lived TCP connections (none: no TCP load).
    pub tcp: Option<SocketAddr>,
    /// Target of the UDP requests (none: no UDP load).
    pub udp: Option<SocketAddr>,
    /// Threads opening short TCP connections one after the other.
    pub short_workers: usize,
    /// Long-lived TCP connections, opened by [`start`] before it returns.
    pub long_conns: usize,
    /// Threads sending UDP requests one after the other.
    pub udp_workers: usize,
    /// Pause after each short connection or UDP request (keeps a small machine responsive).
    pub pause: Duration,
    /// Time between two lines of a long-lived connection; each connection adds up to as much
    /// again, so their exchanges spread out.
    pub long_interval: Duration,
    /// The generator stops by itself after this long...
    pub max_duration: Duration,
    /// ... or after this many attempts of one client.
    pub max_attempts: usize,
}

impl LoadConfig {
    /// No targets yet; 2 short workers, 4 long-lived connections (a line every 50-100 ms),
    /// 1 UDP worker, 5 ms pauses, at most 60 s.
    pub fn new(from: &Netns) -> Self {
        Self {
            from: from.name.clone(),
            tcp: None,
            udp: None,
            short_workers: 2,
            long_conns: 4,
            udp_workers: 1,
            pause: Duration::from_millis(5),
            long_interval: Duration::from_millis(50),
            max_duration: Duration::from_secs(60),
            max_attempts: 50_000,
        }
    }
}

/// One short connection or UDP request.
#[derive(Clone, Debug)]
pub struct Attempt {
    /// When the client started it (connect or send).
    pub started: Instant,
    /// The backend that answered, or what went wrong.
    pub outcome: Result<String, String>,
}

/// One long-lived connection, from its opening to the end of the load (or its break).
#[derive(Clone, Debug)]
pub struct LongConn {
    pub index: usize,
    /// The backend that answered the first line.
    pub backend: String,
    /// Lines answered, the first included.
    pub exchanges: usize,
    /// When the last line was answered.
    pub last_answer: Instant,
    /// Answers by another backend than the first: (when, who).
    pub moved: Vec<(Instant, String)>,
    /// The error that ended the connection, and when.
    pub broke: Option<(Instant, String)>,
}

/// What happened, for assertions.
#[derive(Debug)]
pub struct Report {
    pub started: Instant,
    pub stopped: Instant,
    pub short: Vec<Attempt>,
    pub udp: Vec<Attempt>,
    pub long: Vec<LongConn>,
}

/// The running load; [`LoadHandle::stop`] ends it (dropping it also stops the threads).
pub struct LoadHandle {
    started: Instant,
    stop: Arc<AtomicBool>,
    short: Vec<JoinHandle<Vec<Attempt>>>,
    udp: Vec<JoinHandle<Vec<Attempt>>>,
    long: Vec<JoinHandle<LongConn>>,
}

/// Starts the load; returns once every long-lived connection is open and answered once.
pub fn start(config: LoadConfig) -> Result<LoadHandle> {
    if !config.from.starts_with(NS_PREFIX) {
        bail!("load only from sandbox namespaces, not {:?}", config.from);
    }
    for addr in config.tcp.iter().chain(&config.udp) {
        if !in_sandbox(addr.ip()) {
            bail!("load only to sandbox addresses (Services, pods), not {addr}");
        }
    }
    let from = Netns::open(&config.from);
    if !from.exists() {
        bail!("no namespace {}", config.from);
    }
    let started = Instant::now();
    let mut handle = LoadHandle {
        started,
        stop: Arc::new(AtomicBool::new(false)),
        short: Vec::new(),
        udp: Vec::new(),
        long: Vec::new(),
    };
    let deadline = started + config.max_duration;
    if let Some(addr) = config.tcp {
        for index in 0..config.long_conns {
            let mut conn = TcpConn::open(&from, addr)?;
            let backend = conn
                .ask(&format!("long {index} line 0"))
                .with_context(|| format!("long-lived connection {index}"))?;
            let interval =
                config.long_interval + config.long_interval * (index as u32 * 7 % 10) / 10;
            let stop = handle.stop.clone();
            let max = config.max_attempts;
            handle.long.push(std::thread::spawn(move || {
                long_conn(conn, index, backend, interval, stop, deadline, max)
            }));
        }
        for _ in 0..config.short_workers {
            let job = Job::new(&config, &handle.stop, deadline);
            handle
                .short
                .push(spawn_in(&config.from, move || job.run(|| short_tcp(addr))));
        }
    }
    if let Some(addr) = config.udp {
        for _ in 0..config.udp_workers {
            let job = Job::new(&config, &handle.stop, deadline);
            handle
                .udp
                .push(spawn_in(&config.from, move || job.run(|| udp_once(addr))));
        }
    }
    Ok(handle)
}

/// 10.96.0.0/16 (Services) or 10.244.0.0/16 (pods).
fn in_sandbox(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => {
            let [a, b, ..] = ip.octets();
            (a, b) == (10, 96) || (a, b) == (10, 244)
        }
        IpAddr::V6(_) => false,
    }
}

/// A client thread's result; its panic goes on in the caller.
fn join<T>(handle: JoinHandle<T>) -> T {
    handle
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

impl LoadHandle {
    /// Stops every client, waits for them, and reports.
    pub fn stop(mut self) -> Report {
        self.stop.store(true, Ordering::Relaxed);
        let mut short: Vec<Attempt> = self.short.drain(..).flat_map(join).collect();
        let mut udp: Vec<Attempt> = self.udp.drain(..).flat_map(join).collect();
        short.sort_by_key(|a| a.started);
        udp.sort_by_key(|a| a.started);
        let long = self.long.drain(..).map(join).collect();
        Report {
            started: self.started,
            stopped: Instant::now(),
            short,
            udp,
            long,
        }
    }

    /// When the load started (long-lived connections were opened just after).
    pub fn started(&self) -> Instant {
        self.started
    }
}

impl Drop for LoadHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.short.drain(..).chain(self.udp.drain(..)) {
            let _ = h.join();
        }
        for h in self.long.drain(..) {
            let _ = h.join();
        }
    }
}

/// A loop of one kind of attempt, bounded in time and count.
struct Job {
    stop: Arc<AtomicBool>,
    deadline: Instant,
    max: usize,
    pause: Duration,
}

impl Job {
    fn new(config: &LoadConfig, stop: &Arc<AtomicBool>, deadline: Instant) -> Self {
        Self {
            stop: stop.clone(),
            deadline,
            max: config.max_attempts,
            pause: config.pause,
        }
    }

    fn run(&self, once: impl Fn() -> Result<String>) -> Vec<Attempt> {
        let mut out = Vec::new();
        while !self.stop.load(Ordering::Relaxed)
            && Instant::now() < self.deadline
            && out.len() < self.max
        {
            let started = Instant::now();
            let outcome = once().map_err(|e| format!("{e:#}"));
            out.push(Attempt { started, outcome });
            std::thread::sleep(self.pause);
        }
        out
    }
}

/// A thread that lives in namespace `ns` (sockets it makes belong there).
fn spawn_in<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> JoinHandle<T> {
    let ns = ns.to_owned();
    std::thread::spawn(move || Netns::open(&ns).run(f))
}

fn short_tcp(addr: SocketAddr) -> Result<String> {
    let stream = TcpStream::connect_timeout(&addr, client_timeout()).context("connect")?;
    stream.set_read_timeout(Some(client_timeout()))?;
    stream.set_write_timeout(Some(client_timeout()))?;
    stream.set_nodelay(true)?;
    (&stream).write_all(b"short\n").context("send")?;
    let mut reply = String::new();
    BufReader::new(&stream)
        .read_line(&mut reply)
        .context("read reply")?;
    if reply.is_empty() {
        bail!("closed without a reply");
    }
    Ok(reply.trim_end().to_owned())
}

fn udp_once(addr: SocketAddr) -> Result<String> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).context("bind")?;
    // Connected: a reply from another source than the service address is dropped.
    socket.connect(addr).context("connect")?;
    socket.set_read_timeout(Some(client_timeout()))?;
    socket.send(b"udp\n").context("send")?;
    let mut buf = [0u8; 512];
    let n = socket
        .recv(&mut buf)
        .with_context(|| format!("no reply within {:?}", client_timeout()))?;
    Ok(String::from_utf8_lossy(&buf[..n]).trim_end().to_owned())
}

fn long_conn(
    mut conn: TcpConn,
    index: usize,
    backend: String,
    interval: Duration,
    stop: Arc<AtomicBool>,
    deadline: Instant,
    max: usize,
) -> LongConn {
    let mut report = LongConn {
        index,
        backend,
        exchanges: 1,
        last_answer: Instant::now(),
        moved: Vec::new(),
        broke: None,
    };
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline && report.exchanges < max {
        std::thread::sleep(interval);
        match conn.ask(&format!("long {index} line {}", report.exchanges)) {
            Ok(who) => {
                report.exchanges += 1;
                report.last_answer = Instant::now();
                if who != report.backend {
                    report.moved.push((report.last_answer, who));
                }
            }
            Err(e) => {
                report.broke = Some((Instant::now(), format!("{e:#}")));
                break;
            }
        }
    }
    report
}

impl Report {
    /// Seconds since the load started, for messages.
    pub fn at(&self, t: Instant) -> String {
        format!(
            "+{:.3}s",
            t.saturating_duration_since(self.started).as_secs_f64()
        )
    }

    /// Every failure: failed short connections and UDP requests, broken long-lived
    /// connections, long-lived connections answered by another backend.
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (kind, attempts) in [("short TCP", &self.short), ("UDP", &self.udp)] {
            for a in attempts {
                if let Err(e) = &a.outcome {
                    out.push(format!("{} {kind}: {e}", self.at(a.started)));
                }
            }
        }
        for c in &self.long {
            if let Some((t, e)) = &c.broke {
                out.push(format!(
                    "{} long-lived connection {} to {} broke after {} answers: {e}",
                    self.at(*t),
                    c.index,
                    c.backend,
                    c.exchanges
                ));
            }
            for (t, who) in &c.moved {
                out.push(format!(
                    "{} long-lived connection {} moved from {} to {who}",
                    self.at(*t),
                    c.index,
                    c.backend
                ));
            }
        }
        out
    }

    /// Answers per backend of the attempts (short TCP or UDP) started in `from..until`.
    pub fn answered_by(
        attempts: &[Attempt],
        from: Instant,
        until: Instant,
    ) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for a in attempts
            .iter()
            .filter(|a| (from..until).contains(&a.started))
        {
            if let Ok(who) = &a.outcome {
                *out.entry(who.clone()).or_default() += 1;
            }
        }
        out
    }

    /// Counts, backends and the long-lived connections, on a few lines.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "load for {:.1}s:\n",
            (self.stopped - self.started).as_secs_f64()
        );
        for (kind, attempts) in [("short TCP", &self.short), ("UDP", &self.udp)] {
            let failed = attempts.iter().filter(|a| a.outcome.is_err()).count();
            let _ = writeln!(
                s,
                "  {kind}: {} attempts, {failed} failed, answered by {:?}",
                attempts.len(),
                Self::answered_by(attempts, self.started, self.stopped)
            );
        }
        for c in &self.long {
            let _ = writeln!(
                s,
                "  long-lived {}: {} answers from {}, last {}{}{}",
                c.index,
                c.exchanges,
                c.backend,
                self.at(c.last_answer),
                if c.moved.is_empty() { "" } else { ", MOVED" },
                if c.broke.is_some() { ", BROKE" } else { "" },
            );
        }
        s
    }

    /// Panics, listing every failure (the first 20) and the summary, if there was any.
    pub fn assert_no_failures(&self) {
        let failures = self.failures();
        if !failures.is_empty() {
            panic!(
                "{} failures under load (first 20):\n  {}\n{}",
                failures.len(),
                failures
                    .iter()
                    .take(20)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n  "),
                self.summary()
            );
        }
    }
}
