//! Finding the frontend a packet (or a socket's destination) is for: a service address
//! (ClusterIP, LoadBalancer, external IP) exactly, else a NodePort when the address is one of
//! the node's. Clients inside the cluster and clients outside it may see different endpoints
//! (externalTrafficPolicy Local): the scope says which.
use aya_ebpf::maps::lpm_trie::Key;
use proxy_common::{
    Be16, Be32, NODE_ADDR_SNAT_ONLY, NODE_PORT_ADDR, SCOPE_INTERNAL, SERVICE_SOURCE_RANGES,
    SERVICE_TWO_SCOPES, SOURCE_RANGE_FRONTEND_BITS, ServiceKey, ServiceValue, SourceRangeKey,
};

use crate::maps::{NODE_ADDRS, SERVICES, SOURCE_RANGES};

/// Whether `addr` is one the node's NodePorts answer on.
#[inline(always)]
pub fn is_node_addr(addr: Be32) -> bool {
    node_addr(addr).1
}

/// Whether `addr` is the node's: one it sends flows to other nodes' endpoints from (their
/// replies come to it), and one its NodePorts answer on (most are both).
#[inline(always)]
pub fn node_addr(addr: Be32) -> (bool, bool) {
    match unsafe { NODE_ADDRS.get(addr) } {
        Some(flags) => (true, flags & NODE_ADDR_SNAT_ONLY == 0),
        None => (false, false),
    }
}

/// The frontend at `addr`:`port` as a client inside the cluster (a pod, a host-network process)
/// reaches it: any service address, and the NodePorts of this node's addresses, with the
/// endpoints kube-proxy gives such clients.
#[inline(always)]
pub fn internal(addr: Be32, port: Be16, proto: u8) -> Option<(ServiceKey, ServiceValue)> {
    let (key, svc) = lookup(addr, port, proto, || is_node_addr(addr))?;
    if svc.flags & SERVICE_TWO_SCOPES == 0 {
        return Some((key, svc));
    }
    let internal = key.with_scope(SCOPE_INTERNAL);
    // SAFETY: services values are plain data; the agent replaces them whole.
    match unsafe { SERVICES.get(internal) } {
        Some(internal_svc) => Some((internal, *internal_svc)),
        // The agent writes it first; should it be missing (a full map), the external scope
        // serves rather than the packet passing untranslated.
        None => Some((key, svc)),
    }
}

/// The frontend at `addr`:`port` as a client outside the node reaches it: a NodePort, a
/// LoadBalancer or external IP, and as with kube-proxy a ClusterIP (where the network routes
/// the service range to the nodes: BGP-advertised, or a static route).
/// `to_node`: whether `addr` is a node address (the caller has looked it up already).
#[inline(always)]
pub fn external(
    addr: Be32,
    port: Be16,
    proto: u8,
    to_node: bool,
) -> Option<(ServiceKey, ServiceValue)> {
    lookup(addr, port, proto, || to_node)
}

/// The frontend at `addr` exactly, else the NodePort `port` if `is_node_addr()` (asked only
/// then: most packets are for an exact address, or for none).
#[inline(always)]
fn lookup(
    addr: Be32,
    port: Be16,
    proto: u8,
    is_node_addr: impl FnOnce() -> bool,
) -> Option<(ServiceKey, ServiceValue)> {
    let key = ServiceKey::new(addr, port, proto, 0);
    // SAFETY: as above.
    if let Some(svc) = unsafe { SERVICES.get(key) } {
        return Some((key, *svc));
    }
    if !is_node_addr() {
        return None;
    }
    let key = ServiceKey::new(NODE_PORT_ADDR, port, proto, 0);
    let svc = unsafe { SERVICES.get(key) }.copied()?;
    Some((key, svc))
}

/// loadBalancerSourceRanges: whether the frontend `svc_key` (`svc`) is restricted and
/// `source` outside its ranges. Both scopes of a frontend share its ranges.
#[inline(always)]
pub fn source_refused(svc_key: &ServiceKey, svc: &ServiceValue, source: Be32) -> bool {
    if svc.flags & SERVICE_SOURCE_RANGES == 0 {
        return false;
    }
    let key = Key::new(
        SOURCE_RANGE_FRONTEND_BITS + 32,
        SourceRangeKey {
            addr: svc_key.addr,
            port: svc_key.port,
            proto: svc_key.proto,
            pad: 0,
            source,
        },
    );
    SOURCE_RANGES.get(key).is_none()
}
