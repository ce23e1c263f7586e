//! kube-proxy's health endpoints: `/healthz` and `/livez` on `--healthz-bind-address`
//! (default port 10256).
//!
//! As in kube-proxy, the proxy is unhealthy when a change has been waiting for a sync longer
//! than the timeout (twice the sync period): programming is stuck. `/healthz` is also
//! unhealthy while this node is being deleted (kube-proxy's `nodeEligible`), so load balancers
//! drain it; `/livez` ignores that, so the kubelet does not restart a proxy that works.
use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use crate::serve::http::Response;

#[derive(Debug)]
pub struct ProxyHealth {
    timeout: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// When the oldest change not yet synced was queued.
    oldest_pending: Option<Instant>,
    last_updated: Option<SystemTime>,
    node_eligible: bool,
}

/// What a probe gets.
#[derive(Debug, PartialEq, Eq)]
pub struct Status {
    pub healthy: bool,
    pub body: String,
}

impl ProxyHealth {
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            state: Mutex::new(State {
                oldest_pending: None,
                last_updated: None,
                node_eligible: true,
            }),
        }
    }

    /// A change is waiting for a sync.
    pub fn queued(&self) {
        let mut s = self.state.lock().unwrap();
        s.oldest_pending.get_or_insert_with(Instant::now);
    }

    /// A sync succeeded: everything queued before it is programmed.
    pub fn updated(&self) {
        let mut s = self.state.lock().unwrap();
        s.oldest_pending = None;
        s.last_updated = Some(SystemTime::now());
    }

    pub fn set_node_eligible(&self, eligible: bool) {
        self.state.lock().unwrap().node_eligible = eligible;
    }

    /// `livez`: ignore node eligibility.
    pub fn status(&self, livez: bool) -> Status {
        let s = self.state.lock().unwrap();
        let stuck = s.oldest_pending.is_some_and(|t| t.elapsed() > self.timeout);
        let healthy = !stuck && (livez || s.node_eligible);
        let body = format!(
            "{{\"lastUpdated\": \"{}\",\"currentTime\": \"{}\",\"nodeEligible\": {}}}",
            s.last_updated.map(rfc3339).unwrap_or_default(),
            rfc3339(SystemTime::now()),
            s.node_eligible
        );
        Status { healthy, body }
    }
}

/// `/healthz` and `/livez`, for [`crate::serve::http::serve`].
pub fn handler(health: Arc<ProxyHealth>) -> Arc<dyn Fn(&str) -> Response + Send + Sync> {
    Arc::new(move |path| match path {
        "/healthz" | "/livez" => {
            let s = health.status(path == "/livez");
            crate::serve::metrics::METRICS.probed(path == "/livez", s.healthy);
            Response {
                status: if s.healthy {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                },
                content_type: "application/json",
                headers: Vec::new(),
                body: s.body,
            }
        }
        _ => Response::not_found(),
    })
}

/// RFC 3339 in UTC with a `Z`, whole seconds, as Go's metav1.Time marshals.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_999_999);
        assert_eq!(rfc3339(t), "2026-11-30T00:53:19Z");
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn unhealthy_only_when_a_change_waits_too_long() {
        let h = ProxyHealth::new(Duration::from_millis(50));
        assert!(h.status(false).healthy, "nothing queued yet");
        h.queued();
        assert!(h.status(false).healthy, "queued just now");
        std::thread::sleep(Duration::from_millis(80));
        assert!(!h.status(false).healthy && !h.status(true).healthy, "stuck");
        h.updated();
        let s = h.status(false);
        assert!(
            s.healthy && s.body.contains("\"nodeEligible\": true"),
            "{s:?}"
        );
        h.set_node_eligible(false);
        assert!(!h.status(false).healthy, "healthz follows node eligibility");
        assert!(h.status(true).healthy, "livez does not");
    }
}
