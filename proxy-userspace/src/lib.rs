//! The agent. The data flow, in module order: `source` (where the cluster's objects come from)
//! feeds `model` (what the cluster wants); `sync` decides when to program; `dataplane` is the
//! one contract every mode in `modes` implements. `node` and `netfilter` are shared machinery
//! the modes use, `serve` the agent's HTTP side, `inspect` reads a mode's programming back.
pub mod agent;
pub mod command;
pub mod dataplane;
pub mod dense_map;
pub mod duration;
pub mod events;
pub mod inspect;
pub mod kube_proxy;
pub mod kubernetes;
pub mod model;
pub mod modes;
pub mod netfilter;
pub mod node;
pub mod one_or_many;
pub mod rows;
pub mod serve;
pub mod source;
pub mod sync;
#[cfg(test)]
mod testing;
