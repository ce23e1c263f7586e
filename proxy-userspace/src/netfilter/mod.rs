//! What the netfilter modes (iptables, nftables, IPVS, userspace) share.
pub mod conntrack;
pub mod iptables;
pub mod iptables_save;
pub mod rules;
pub mod stale_udp;
