//! The agent's image (`deploy/image.sh`, built from Debian's packages) run as the DaemonSet runs
//! it (`proxy_tests::image`: runc, hostNetwork, the container's exact securityContext and
//! volumes): the scenario suite in the ebpf mode, and the takeover from kube-proxy's rules.
use proxy_tests::{Shape, agent::Launch, scenarios, takeover};

#[test]
fn scenarios_ebpf() {
    scenarios::run_launched(
        "image::scenarios_ebpf",
        "ebpf",
        Shape::Routed,
        Launch::Image,
    );
}

#[test]
fn takeover_from_iptables_nft() {
    takeover::from_launched(
        "image::takeover_from_iptables_nft",
        "iptables-nft",
        Launch::Image,
    );
}

#[test]
fn takeover_from_iptables_legacy() {
    takeover::from_launched(
        "image::takeover_from_iptables_legacy",
        "iptables-legacy",
        Launch::Image,
    );
}
