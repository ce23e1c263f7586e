//! The one contract every proxy mode implements: make the node serve the desired state.
use std::collections::BTreeSet;

use crate::model::{DesiredState, Family, ServicePortName};

/// Which service ports a sync must look at.
#[derive(Clone, Copy, Debug)]
pub enum Scope<'a> {
    /// Everything: the first sync, one periodic sync an hour, retries after a failure and the
    /// sync after ports could not be programmed. Also removes whatever the mode finds
    /// programmed that the state does not name.
    All,
    /// Only these service ports changed since the last successful sync (none: a periodic
    /// sync, which may still check the mode's own state, such as its jumps).
    Changed(&'a BTreeSet<ServicePortName>),
}

impl Scope<'_> {
    /// Whether the sync should check what others may have undone (the jumps from the built-in
    /// chains): full syncs, and the periodic ones, in which nothing changed.
    pub fn checks_jumps(&self) -> bool {
        match self {
            Scope::All => true,
            Scope::Changed(changed) => changed.is_empty(),
        }
    }
}

pub trait Dataplane: Send {
    /// Programs the node so that the service ports in `scope` behave as `state` says. An error
    /// leaves the rest programmed; the caller retries with [`Scope::All`].
    fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()>;

    /// The IP families the mode serves: a Service port is served in those of its cluster IPs
    /// it serves (kube-proxy's rule).
    fn families(&self) -> Vec<Family> {
        vec![Family::V4]
    }

    /// Periodic work that does not depend on the state (the agent calls it about once a
    /// second), such as checking that the mode's own background work is still running.
    fn housekeeping(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
}

/// Service ports that cannot be programmed as configured (a full map, too many endpoints).
/// Retrying does not help until the configuration changes, so such a sync still counts as
/// done (for health and retries); the next sync is a full one, which tries them again.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotProgrammable(pub String);
