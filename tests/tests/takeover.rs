//! The switch from kube-proxy's rules (as the netfilter modes write them) to the ebpf mode
//! breaks no connection (`proxy_tests::takeover`).
use proxy_tests::takeover;

#[test]
fn from_iptables_legacy() {
    takeover::from("takeover::from_iptables_legacy", "iptables-legacy");
}

#[test]
fn from_iptables_nft() {
    takeover::from("takeover::from_iptables_nft", "iptables-nft");
}

#[test]
fn from_nftables() {
    takeover::from("takeover::from_nftables", "nftables");
}
