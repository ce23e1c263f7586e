//! kube-proxy's Events, posted through the API server (events.k8s.io/v1) when the agent has one:
//! `Starting` on its Node, `FailedToStartProxierHealthcheck` when the health server cannot
//! serve, `FailedToStartServiceHealthcheck` on a Service whose health check node port cannot
//! be bound. With the manifest source there is no API: the log alone says these things.
//!
//! Recording never blocks the caller: events go through a queue to one task that posts them
//! (repeats within a few minutes become a series of one Event, as client-go's recorder does).
//! A post that fails is logged, once per reason, with what the agent's role must allow.
use std::{collections::HashSet, sync::OnceLock, time::Duration};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::{mpsc, oneshot};

use crate::model::NamespacedName;

/// The controller name on every Event, as kube-proxy's.
const CONTROLLER: &str = "kube-proxy";

/// What an Event is about.
pub enum Regarding<'a> {
    /// This node (cluster-scoped: its Events go to the `default` namespace, as kube-proxy's).
    Node(&'a str),
    Service(&'a NamespacedName),
}

enum Queued {
    Event(Box<(ObjectReference, Event)>),
    /// Answered once everything queued before it has been posted (or failed).
    Flush(oneshot::Sender<()>),
}

static QUEUE: OnceLock<mpsc::UnboundedSender<Queued>> = OnceLock::new();

/// Starts posting Events through `client`, as the agent on `node_name` (their
/// `reportingInstance`). Once per process.
pub fn start(client: Client, node_name: &str) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    if QUEUE.set(tx).is_err() {
        return;
    }
    let reporter = Reporter {
        controller: CONTROLLER.into(),
        instance: Some(node_name.into()),
    };
    let recorder = Recorder::new(client, reporter);
    tokio::spawn(async move {
        let mut failed_reasons = HashSet::new();
        while let Some(queued) = rx.recv().await {
            match queued {
                Queued::Event(queued) => {
                    let (regarding, event) = *queued;
                    if let Err(e) = recorder.publish(&event, &regarding).await
                        && failed_reasons.insert(event.reason.clone())
                    {
                        tracing::warn!(
                            reason = event.reason,
                            "posting an Event: {e} (the agent's ClusterRole must allow create \
                             and patch on events in events.k8s.io, as deploy/ has it); the log \
                             keeps what it would have said"
                        );
                    }
                }
                Queued::Flush(done) => {
                    let _ = done.send(());
                }
            }
        }
    });
}

/// Records an Event of kube-proxy's (`reason`, `action`: its names) about `regarding`.
/// Nothing without an API (see the module's note): callers log what happened themselves.
pub fn record(
    regarding: Regarding<'_>,
    warning: bool,
    reason: &str,
    action: &str,
    note: Option<String>,
) {
    let Some(queue) = QUEUE.get() else { return };
    let reference = match regarding {
        Regarding::Node(name) => ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(name.into()),
            ..ObjectReference::default()
        },
        Regarding::Service(key) => ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(key.namespace.to_string()),
            name: Some(key.name.to_string()),
            ..ObjectReference::default()
        },
    };
    let event = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.into(),
        // An Event's note holds at most 1 kB.
        note: note.map(|n| n.chars().take(1000).collect()),
        action: action.into(),
        secondary: None,
    };
    let _ = queue.send(Queued::Event(Box::new((reference, event))));
}

/// Waits (at most `timeout`) until the Events recorded so far are posted: before the agent
/// exits on an error one of them reports.
pub async fn flush(timeout: Duration) {
    let Some(queue) = QUEUE.get() else { return };
    let (done, posted) = oneshot::channel();
    if queue.send(Queued::Flush(done)).is_ok() {
        let _ = tokio::time::timeout(timeout, posted).await;
    }
}
