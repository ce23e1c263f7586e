//! One folder per proxy mode, each implementing [`crate::dataplane::Dataplane`]. No mode imports
//! another: what several use lives in `crate::node` and `crate::netfilter`.
pub mod ebpf;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod userspace;
