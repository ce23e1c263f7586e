//! `--pod-interfaces`: which interfaces get the pod programs. By what they are (`auto`, the
//! default): every veth or netkit device of the node's namespace that does not carry the node's
//! addresses, bridge ports included, so every CNI's pods are found whatever it names their
//! interfaces (`veth*`, `cali*`, `lxc*`, `eni*`, or after the pod). Or by name, with patterns.
//! A bridge device itself never gets them: a pod's frame would meet the programs twice, at its
//! port and at the bridge.
use std::{fmt, str::FromStr};

/// Drivers of the devices that face pods: the host side of a veth pair, or of a netkit pair.
const POD_DRIVERS: [&str; 2] = ["veth", "netkit"];

/// The driver of a Linux bridge (a CNI's `cni0`, `cbr0`, `docker0`).
pub const BRIDGE_DRIVER: &str = "bridge";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInterfaces {
    /// Every veth or netkit device that carries no node address.
    auto: bool,
    /// Interfaces named so (`*`: any run of characters).
    patterns: Vec<String>,
    /// Never these (`!pattern`), whatever else selects them.
    excluded: Vec<String>,
}

/// What the kernel says of an interface, as far as the choice needs it.
pub struct Link<'a> {
    pub name: &'a str,
    /// Its driver (ethtool's name: `veth`, `bridge`, `vxlan`...), if it has one.
    pub driver: Option<&'a str>,
    /// It carries a node address (the ones NodePorts answer on) or the default route.
    pub node_facing: bool,
}

impl PodInterfaces {
    /// Whether `link` gets the pod programs.
    pub fn selects(&self, link: &Link<'_>) -> bool {
        if glob_match(&self.excluded, link.name) || link.driver == Some(BRIDGE_DRIVER) {
            return false;
        }
        if glob_match(&self.patterns, link.name) {
            return true;
        }
        self.auto && link.driver.is_some_and(|d| POD_DRIVERS.contains(&d)) && !link.node_facing
    }

    /// Whether the choice depends on an interface's driver (else only on its name).
    pub fn by_kind(&self) -> bool {
        self.auto
    }
}

impl Default for PodInterfaces {
    fn default() -> Self {
        Self {
            auto: true,
            patterns: Vec::new(),
            excluded: Vec::new(),
        }
    }
}

impl FromStr for PodInterfaces {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut out = Self {
            auto: false,
            patterns: Vec::new(),
            excluded: Vec::new(),
        };
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.strip_prefix('!') {
                Some("") => return Err("`!` must be followed by a pattern to exclude".into()),
                Some(excluded) => out.excluded.push(excluded.to_owned()),
                None if part == "auto" => out.auto = true,
                None => out.patterns.push(part.to_owned()),
            }
        }
        if !out.auto && out.patterns.is_empty() {
            return Err(format!(
                "{s:?} selects no interface: give `auto` (every veth or netkit device without a \
                 node address), name patterns such as `veth*,eni*`, or both; `!pattern` excludes"
            ));
        }
        Ok(out)
    }
}

impl fmt::Display for PodInterfaces {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let auto = self.auto.then(|| "auto".to_owned());
        let parts: Vec<String> = auto
            .into_iter()
            .chain(self.patterns.iter().cloned())
            .chain(self.excluded.iter().map(|p| format!("!{p}")))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// Shell-style matching with `*` (any run of characters), against any of `patterns`.
fn glob_match(patterns: &[String], name: &str) -> bool {
    patterns
        .iter()
        .any(|p| match_one(p.as_bytes(), name.as_bytes()))
}

fn match_one(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| match_one(rest, &s[i..])),
        Some((c, rest)) => s.first() == Some(c) && match_one(rest, &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link<'a>(name: &'a str, driver: &'a str, node_facing: bool) -> Link<'a> {
        Link {
            name,
            driver: Some(driver),
            node_facing,
        }
    }

    #[test]
    fn auto_takes_pod_devices_by_kind() {
        let auto = PodInterfaces::default();
        assert_eq!(auto.to_string(), "auto");
        // Whatever the CNI names them: veth pairs and netkit devices facing pods.
        for name in [
            "veth1a2b",
            "cali12ab",
            "lxc0f3",
            "eni9c1f",
            "3f2a9c1e8b7d_c",
            "pod-web",
        ] {
            assert!(auto.selects(&link(name, "veth", false)), "{name}");
        }
        assert!(auto.selects(&link("nk0", "netkit", false)));
        // Never a bridge, a tunnel, the uplink (a veth too, in a container), or a NIC.
        assert!(!auto.selects(&link("cni0", "bridge", false)));
        assert!(!auto.selects(&link("flannel.1", "vxlan", false)));
        assert!(!auto.selects(&link("eth0", "veth", true)));
        assert!(!auto.selects(&link("ens5", "ena", true)));
        assert!(!auto.selects(&Link {
            name: "lo",
            driver: None,
            node_facing: false
        }));
    }

    #[test]
    fn patterns_and_exclusions() {
        let named: PodInterfaces = "veth*, cali*".parse().unwrap();
        assert!(!named.by_kind());
        assert!(named.selects(&link("cali1", "veth", false)));
        assert!(!named.selects(&link("eni1", "veth", false)));
        // A bridge never, even when its name matches (flannel's `cni0` under `cni*`).
        let cni: PodInterfaces = "cni*".parse().unwrap();
        assert!(!cni.selects(&link("cni0", "bridge", false)));
        assert!(cni.selects(&link("cni1a2b", "veth", false)));
        let some: PodInterfaces = "auto,!veth-mgmt*,eth9".parse().unwrap();
        assert_eq!(some.to_string(), "auto,eth9,!veth-mgmt*");
        assert!(!some.selects(&link("veth-mgmt0", "veth", false)));
        assert!(some.selects(&link("veth-pod", "veth", false)));
        assert!(some.selects(&link("eth9", "e1000", true)));
        for bad in ["", " , ", "!x", "!"] {
            assert!(bad.parse::<PodInterfaces>().is_err(), "{bad:?} accepted");
        }
        let globs = |p: &str, name: &str| glob_match(&[p.to_owned()], name);
        assert!(globs("veth-*", "veth-be1"));
        assert!(!globs("veth-*", "eth0"));
        assert!(globs("*", "x"));
        assert!(globs("lxc*c", "lxcabc"));
        assert!(!globs("lxc*c", "lxcab"));
        assert!(globs("eth0", "eth0"));
    }
}
