//! Short TCP connections a second, the way the end-to-end benchmarks measure them: each client
//! thread enters the client's network namespace once, then loops: connect, one request line,
//! its reply line, close; targets taken in turn. Every connection's time is kept, for the
//! latency percentiles.
use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use proxy_tests::Netns;

/// How hard and how long to measure.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    pub seconds: f64,
    pub threads: u32,
}

/// Connections that failed over the measurements of one target, of how many, and the first
/// error.
#[derive(Default)]
pub struct Failures {
    pub count: u64,
    pub of: u64,
    pub first: String,
}

/// One measurement: connections a second, and each successful connection's duration.
pub struct Round {
    pub rate: f64,
    pub latencies: Vec<Duration>,
}

/// A connection's timeout: far above any normal one here, so a stall shows as a long latency
/// (a SYN retransmit takes 1 s) rather than as an error.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Measures short connections from `from` to `targets` for `load.seconds`. Failures are added
/// to `failures`; more than 1% of them fails the benchmark (something is broken).
pub fn measure(
    from: &Netns,
    targets: &[SocketAddr],
    load: Load,
    failures: &mut Failures,
) -> anyhow::Result<Round> {
    let stop = AtomicBool::new(false);
    let results = Mutex::new((Vec::new(), 0u64, None::<String>));
    let started = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let mut threads = Vec::new();
        for t in 0..load.threads {
            let (stop, results) = (&stop, &results);
            threads.push(s.spawn(move || {
                from.try_run(|| {
                    let (mut latencies, mut failed, mut first) = (Vec::new(), 0u64, None);
                    let mut i = t as usize;
                    while !stop.load(Ordering::Relaxed) {
                        let at = Instant::now();
                        match connection(targets[i % targets.len()]) {
                            Ok(()) => latencies.push(at.elapsed()),
                            Err(e) => {
                                failed += 1;
                                first.get_or_insert(format!("{}: {e}", targets[i % targets.len()]));
                            }
                        }
                        i += 1;
                    }
                    let mut all = results.lock().unwrap();
                    all.0.extend(latencies);
                    all.1 += failed;
                    if all.2.is_none() {
                        all.2 = first;
                    }
                })
            }));
        }
        std::thread::sleep(Duration::from_secs_f64(load.seconds));
        stop.store(true, Ordering::Relaxed);
        for thread in threads {
            thread.join().expect("client thread")?;
        }
        Ok(())
    })?;
    let elapsed = started.elapsed().as_secs_f64();
    let (latencies, failed, first) = results.into_inner().unwrap();
    failures.count += failed;
    failures.of += latencies.len() as u64 + failed;
    if failures.first.is_empty()
        && let Some(e) = first
    {
        failures.first = e;
    }
    anyhow::ensure!(
        failures.count * 100 <= failures.of,
        "{} of {} connections to {targets:?} failed, the first: {}",
        failures.count,
        failures.of,
        failures.first
    );
    Ok(Round {
        rate: latencies.len() as f64 / elapsed,
        latencies,
    })
}

/// One connection: connect, a request line, the reply line, close.
fn connection(addr: SocketAddr) -> std::io::Result<()> {
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_nodelay(true)?;
    stream.write_all(b"x\n")?;
    let mut reply = Vec::new();
    BufReader::new(&stream).read_until(b'\n', &mut reply)?;
    if reply.is_empty() {
        return Err(std::io::Error::other("closed without a reply"));
    }
    Ok(())
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The `p`-th percentile (0-100) of `v`, sorted here.
pub fn percentile(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    let rank = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[rank]
}
