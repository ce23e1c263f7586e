//! How one proxy socket picks an endpoint, as kube-proxy's userspace `LoadBalancerRR` did:
//! round robin over the usable endpoints; with ClientIP session affinity, the endpoint a client
//! address used last while it used it within the Service's timeout; and when a TCP connect
//! fails, the next endpoint with a longer timeout ([`CONNECT_TIMEOUTS`]), the failed choice
//! forgotten for that client.
//!
//! Differences from kube-proxy: the endpoints are not shuffled when they change (the order is
//! the desired state's, sorted); instead each balancer starts at a random position, so that the
//! nodes do not all send their first connection to the same endpoint. An endpoint change keeps
//! the round-robin position (modulo the new count) rather than restarting at the first.
use std::{
    collections::HashMap,
    future::Future,
    io,
    net::{IpAddr, SocketAddr},
    sync::Mutex,
    time::{Duration, Instant},
};

/// kube-proxy's `endpointDialTimeout`: the timeout of each connect attempt, one attempt per
/// entry, each to the next endpoint.
pub const CONNECT_TIMEOUTS: [Duration; 4] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];

/// The endpoint a client address is held to, and when it last used it.
#[derive(Clone, Copy, Debug)]
struct Sticky {
    endpoint: SocketAddr,
    last_used: Instant,
}

/// The endpoint choice of one proxy socket; the dataplane replaces its endpoints at each sync.
#[derive(Debug, Default)]
pub struct Balancer {
    endpoints: Vec<SocketAddr>,
    /// The round-robin position: the endpoint the next new client gets.
    next: usize,
    /// ClientIP session affinity's timeout; None: no affinity.
    affinity: Option<Duration>,
    sticky: HashMap<IpAddr, Sticky>,
}

impl Balancer {
    /// A balancer without endpoints whose round robin starts at position `start` (modulo the
    /// number of endpoints it will have).
    pub fn new(affinity: Option<Duration>, start: usize) -> Self {
        Self {
            next: start,
            affinity,
            ..Self::default()
        }
    }

    pub fn endpoints(&self) -> &[SocketAddr] {
        &self.endpoints
    }

    /// Replaces the endpoints; returns whether they changed. Affinity to an endpoint that left
    /// is forgotten (its clients get the next endpoint); the rest is kept.
    pub fn set_endpoints(&mut self, endpoints: Vec<SocketAddr>) -> bool {
        if endpoints == self.endpoints {
            return false;
        }
        self.sticky.retain(|_, s| endpoints.contains(&s.endpoint));
        self.endpoints = endpoints;
        true
    }

    /// Sets the affinity timeout (None: no affinity); a change forgets every client.
    pub fn set_affinity(&mut self, affinity: Option<Duration>) {
        if affinity != self.affinity {
            self.affinity = affinity;
            self.sticky.clear();
        }
    }

    /// The endpoint for a new connection (or UDP session) from `client` at `now`: the one it
    /// is held to while affinity holds, else the next in turn (which the client is then held
    /// to). `reset`: the previous choice failed, take the next in turn regardless. None: no
    /// endpoints.
    pub fn next(&mut self, client: IpAddr, reset: bool, now: Instant) -> Option<SocketAddr> {
        if self.endpoints.is_empty() {
            return None;
        }
        if let Some(timeout) = self.affinity
            && !reset
            && let Some(sticky) = self.sticky.get_mut(&client)
            && now.saturating_duration_since(sticky.last_used) < timeout
        {
            sticky.last_used = now;
            return Some(sticky.endpoint);
        }
        let index = self.next % self.endpoints.len();
        let endpoint = self.endpoints[index];
        self.next = (index + 1) % self.endpoints.len();
        if self.affinity.is_some() {
            self.sticky.insert(
                client,
                Sticky {
                    endpoint,
                    last_used: now,
                },
            );
        }
        Some(endpoint)
    }

    /// Forgets the clients whose affinity expired by `now` (kube-proxy's
    /// `CleanupStaleStickySessions`), so that the table does not grow with every client seen.
    pub fn expire(&mut self, now: Instant) {
        if let Some(timeout) = self.affinity {
            self.sticky
                .retain(|_, s| now.saturating_duration_since(s.last_used) < timeout);
        }
    }

    /// How many clients are held to an endpoint.
    pub fn sticky_clients(&self) -> usize {
        self.sticky.len()
    }
}

/// Why no connection to an endpoint was made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConnectError {
    #[error("no endpoints")]
    NoEndpoints,
    #[error("no endpoint answered after {0} attempts")]
    AllFailed(usize),
}

/// Connects a client of `service` to an endpoint the way kube-proxy's `tryConnect` did: one
/// attempt per entry of [`CONNECT_TIMEOUTS`], each to the endpoint `balancer` picks (the
/// client's own first, then the next in turn), `connect` bounded by that attempt's timeout.
/// Failed attempts are logged as warnings. Returns the endpoint and what `connect` made.
pub async fn connect_with_retries<T, F, Fut>(
    balancer: &Mutex<Balancer>,
    service: &str,
    client: IpAddr,
    mut connect: F,
) -> Result<(SocketAddr, T), ConnectError>
where
    F: FnMut(SocketAddr, Duration) -> Fut,
    Fut: Future<Output = io::Result<T>>,
{
    for (attempt, timeout) in CONNECT_TIMEOUTS.into_iter().enumerate() {
        let endpoint = balancer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .next(client, attempt > 0, Instant::now())
            .ok_or(ConnectError::NoEndpoints)?;
        match tokio::time::timeout(timeout, connect(endpoint, timeout)).await {
            Ok(Ok(made)) => return Ok((endpoint, made)),
            Ok(Err(e)) => tracing::warn!(
                service,
                %client,
                %endpoint,
                attempt = attempt + 1,
                "connecting to the endpoint failed: {e}"
            ),
            Err(_) => tracing::warn!(
                service,
                %client,
                %endpoint,
                attempt = attempt + 1,
                ?timeout,
                "connecting to the endpoint timed out"
            ),
        }
    }
    Err(ConnectError::AllFailed(CONNECT_TIMEOUTS.len()))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn ep(last: u8) -> SocketAddr {
        SocketAddr::from(([10, 244, 0, last], 8080))
    }

    fn client(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, last))
    }

    #[test]
    fn round_robin_takes_each_endpoint_in_turn() {
        let now = Instant::now();
        let mut b = Balancer::new(None, 0);
        assert_eq!(b.next(client(1), false, now), None, "no endpoints");
        b.set_endpoints(vec![ep(1), ep(2), ep(3)]);
        let picked: Vec<_> = (0..7)
            .map(|i| b.next(client(i), false, now).unwrap())
            .collect();
        assert_eq!(
            picked,
            [ep(1), ep(2), ep(3), ep(1), ep(2), ep(3), ep(1)],
            "every client, the same client too, gets the next one"
        );
        assert_eq!(b.next(client(1), false, now), Some(ep(2)));
        assert_eq!(b.sticky_clients(), 0, "no affinity: nothing remembered");

        // A start position past the count wraps.
        let mut b = Balancer::new(None, 5);
        b.set_endpoints(vec![ep(1), ep(2)]);
        assert_eq!(b.next(client(1), false, now), Some(ep(2)));
        assert_eq!(b.next(client(1), false, now), Some(ep(1)));
    }

    #[test]
    fn an_endpoint_change_keeps_the_turn_and_the_remaining_affinity() {
        let now = Instant::now();
        let mut b = Balancer::new(Some(Duration::from_secs(60)), 0);
        assert!(b.set_endpoints(vec![ep(1), ep(2), ep(3)]));
        assert!(!b.set_endpoints(vec![ep(1), ep(2), ep(3)]), "unchanged");
        assert_eq!(b.next(client(1), false, now), Some(ep(1)));
        assert_eq!(b.next(client(2), false, now), Some(ep(2)));
        // ep(2) leaves: its client is moved, ep(1)'s keeps it.
        assert!(b.set_endpoints(vec![ep(1), ep(3), ep(4)]));
        assert_eq!(b.next(client(1), false, now), Some(ep(1)));
        assert_eq!(
            b.next(client(2), false, now),
            Some(ep(4)),
            "the next in turn"
        );
        assert_eq!(b.next(client(2), false, now), Some(ep(4)), "and held there");
        b.set_endpoints(Vec::new());
        assert_eq!(b.next(client(1), false, now), None);
        assert_eq!(b.sticky_clients(), 0);
    }

    #[test]
    fn affinity_holds_a_client_until_it_is_idle_for_the_timeout() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        let mut b = Balancer::new(Some(timeout), 0);
        b.set_endpoints(vec![ep(1), ep(2)]);
        assert_eq!(b.next(client(1), false, t0), Some(ep(1)));
        assert_eq!(b.next(client(2), false, t0), Some(ep(2)));
        // Each use renews the hold: 9 s, then 18 s after the first connection.
        let t9 = t0 + Duration::from_secs(9);
        assert_eq!(b.next(client(1), false, t9), Some(ep(1)));
        let t18 = t0 + Duration::from_secs(18);
        assert_eq!(b.next(client(1), false, t18), Some(ep(1)));
        // client(2) has been idle for 18 s: it expired, and gets the next in turn.
        b.expire(t18);
        assert_eq!(b.sticky_clients(), 1, "client(2) forgotten");
        assert_eq!(b.next(client(2), false, t18), Some(ep(1)));
        // Exactly the timeout idle: expired (kube-proxy's `< ttlSeconds`).
        let t28 = t18 + timeout;
        assert_eq!(b.next(client(1), false, t28), Some(ep(2)));
        // Turning affinity off forgets everyone.
        b.set_affinity(None);
        assert_eq!(b.sticky_clients(), 0);
    }

    #[test]
    fn a_reset_moves_the_client_to_the_next_endpoint() {
        let now = Instant::now();
        let mut b = Balancer::new(Some(Duration::from_secs(60)), 0);
        b.set_endpoints(vec![ep(1), ep(2), ep(3)]);
        assert_eq!(b.next(client(1), false, now), Some(ep(1)));
        assert_eq!(b.next(client(1), true, now), Some(ep(2)), "ep(1) failed");
        assert_eq!(
            b.next(client(1), false, now),
            Some(ep(2)),
            "held to ep(2) now"
        );
    }

    /// Connects through `connect_with_retries`, recording each attempt; `answers(endpoint)`:
    /// Some(true) connects, Some(false) is refused, None never answers.
    async fn attempts(
        endpoints: Vec<SocketAddr>,
        answers: impl Fn(SocketAddr) -> Option<bool>,
    ) -> (
        Result<SocketAddr, ConnectError>,
        Vec<(SocketAddr, Duration)>,
    ) {
        let mut balancer = Balancer::new(None, 0);
        balancer.set_endpoints(endpoints);
        let balancer = Mutex::new(balancer);
        let mut tried = Vec::new();
        let result = connect_with_retries(&balancer, "ns/svc:p", client(1), |ep, timeout| {
            tried.push((ep, timeout));
            let answer = answers(ep);
            async move {
                match answer {
                    Some(true) => Ok(()),
                    Some(false) => Err(io::Error::from(io::ErrorKind::ConnectionRefused)),
                    None => std::future::pending().await,
                }
            }
        })
        .await;
        (result.map(|(ep, ())| ep), tried)
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_connect_retries_the_next_endpoint_with_a_longer_timeout() {
        let ms = Duration::from_millis;
        // The first endpoint refuses: the second is tried, with the second timeout.
        let (result, tried) = attempts(vec![ep(1), ep(2), ep(3)], |e| Some(e != ep(1))).await;
        assert_eq!(result, Ok(ep(2)));
        assert_eq!(tried, [(ep(1), ms(250)), (ep(2), ms(500))]);

        // Nobody answers: four attempts in turn (wrapping), 3.75 s in all, then an error.
        let started = tokio::time::Instant::now();
        let (result, tried) = attempts(vec![ep(1), ep(2), ep(3)], |_| None).await;
        assert_eq!(result, Err(ConnectError::AllFailed(4)));
        assert_eq!(
            tried,
            [
                (ep(1), ms(250)),
                (ep(2), ms(500)),
                (ep(3), ms(1000)),
                (ep(1), ms(2000))
            ]
        );
        assert_eq!(started.elapsed(), ms(3750));

        // A hanging endpoint and one that answers.
        let (result, tried) = attempts(vec![ep(1), ep(2)], |e| (e == ep(2)).then_some(true)).await;
        assert_eq!(result, Ok(ep(2)));
        assert_eq!(tried.len(), 2);

        let (result, tried) = attempts(Vec::new(), |_| Some(true)).await;
        assert_eq!(result, Err(ConnectError::NoEndpoints));
        assert!(tried.is_empty());
    }
}
