//! The agent's image (`deploy/image.sh`, built from Debian's packages) run as the DaemonSet runs
//! it (`proxy_tests::image`: runc, hostNetwork, the container's exact securityContext and
//! volumes): the scenario suite in the ebpf mode and two fallback modes, the takeovers from
//! kube-proxy's rules, and kube-proxy's own command line (the image's `kube-proxy` name,
//! kubeadm's config file).
use proxy_tests::{
    BACKEND_PORT, Sandbox, Shape,
    agent::{AgentRun, Launch},
    example::{MANIFEST, WEB},
    privileged,
    scenarios::{self, Stack},
    takeover, tcp_request,
};

#[test]
fn scenarios_ebpf() {
    scenarios::run_launched(
        "image::scenarios_ebpf",
        "ebpf",
        Shape::Routed,
        Stack::Ipv4,
        Launch::Image,
    );
}

/// The fallback modes' tools in the image, under the same privileges (the legacy backend needs
/// CAP_NET_RAW and the host's xtables lock); the nftables mode on dual-stack Services (both
/// of its tables).
#[test]
fn scenarios_nftables() {
    let test = "image::scenarios_nftables";
    scenarios::run_launched(
        test,
        "nftables",
        Shape::Routed,
        Stack::DualStack,
        Launch::Image,
    );
}

#[test]
fn scenarios_iptables_legacy() {
    let test = "image::scenarios_iptables_legacy";
    scenarios::run_launched(
        test,
        "iptables-legacy",
        Shape::Routed,
        Stack::Ipv4,
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

#[test]
fn takeover_from_nftables() {
    takeover::from_launched("image::takeover_from_nftables", "nftables", Launch::Image);
}

/// kube-proxy's DaemonSet with only the image changed: `/usr/local/bin/kube-proxy
/// --config=<kubeadm's config.conf> --hostname-override=node1` (tests/e2e.rs runs the same
/// outside the image, with more checks).
#[test]
fn kube_proxys_command_line() {
    if !privileged("image::kube_proxys_command_line") {
        return;
    }
    let config = include_str!("../../proxy-userspace/src/kube_proxy/testdata/kubeadm.conf");
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let agent =
        AgentRun::start_as_kube_proxy(&mut sandbox, "node1", MANIFEST, config, &[], Launch::Image)
            .expect("starting the image's kube-proxy");
    assert!(
        agent.log_text().contains("ebpf dataplane loaded"),
        "{}",
        agent.log_text()
    );
    let answer = tcp_request(&sandbox.pod("client").ns, WEB, "hi").expect("web through the agent");
    assert!(answer.starts_with("be"), "{answer}");
}
