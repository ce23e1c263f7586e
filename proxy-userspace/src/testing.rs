//! Helpers for the unit tests: the shared fixture and golden files, and the guard of tests that
//! need root.
use std::{io::Write as _, process::Command};

use crate::{
    model::{ChangeTracker, DesiredState},
    rows::ServiceRow,
    source::manifest::{self, Object},
};

/// Whether tests that write rules into the kernel can run here (root, `tool`). Otherwise
/// prints a loud `SKIPPED <test>: <reason>` line and returns false (or panics when
/// `SANDBOX_NO_SKIP=1`), as the modes' own kernel tests do.
pub(crate) fn privileged(test: &str, tool: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let reason = if unsafe { libc::geteuid() } != 0 {
        "not running as root".to_owned()
    } else {
        match Command::new(tool).arg("--version").output() {
            Ok(o) if o.status.success() => return true,
            Ok(o) => format!(
                "{tool} --version failed: {}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => format!("{tool} unavailable: {e}"),
        }
    };
    if std::env::var("SANDBOX_NO_SKIP").is_ok_and(|v| v == "1") {
        panic!("{test} cannot run: {reason} (SANDBOX_NO_SKIP=1)");
    }
    // Straight to fd 2: `eprintln!` would be captured by the test harness.
    let _ = writeln!(std::io::stderr(), "\nSKIPPED {test}: {reason}\n");
    false
}

/// Runs `f` on a thread in a network namespace of its own (its commands run there too).
pub(crate) fn in_new_netns(f: impl FnOnce() -> anyhow::Result<String> + Send + 'static) -> String {
    std::thread::spawn(move || {
        // SAFETY: unshare has no memory preconditions; it changes this thread only.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        f()
    })
    .join()
    .unwrap()
    .unwrap()
}

/// The Services every mode's golden files are rendered from (and their EndpointSlices).
pub(crate) const SERVICES: &str = include_str!("testdata/services.yaml");

/// The Services of `text` (a manifest such as [`SERVICES`]) as node1 sees them.
pub(crate) fn fixture(text: &str) -> DesiredState {
    let parsed = manifest::parse(text).expect("the fixture parses");
    assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
    let mut tracker = ChangeTracker::new();
    for object in &parsed.objects {
        match object {
            Object::Service(svc) => tracker.update_service(svc).unwrap(),
            Object::EndpointSlice(slice) => {
                tracker.update_slice(slice).unwrap();
            }
            Object::Node(_) => {}
            Object::ServiceCidr(cidr) => {
                let name = cidr.metadata.name.as_deref().unwrap_or_default();
                tracker.upsert_service_cidr(name, crate::kubernetes::service_cidrs_of(cidr));
            }
        }
    }
    let mut state = DesiredState::new("node1");
    tracker.apply(&mut state);
    state
}

/// Compares `text` with the golden file `name` in the testdata/ of `module` (`modes/iptables`,
/// `kube_proxy`: a directory under src/), or rewrites the file when UPDATE_GOLDEN is set: a
/// change of what is rendered shows in review as a change of that file.
pub(crate) fn golden(module: &str, name: &str, text: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(module)
        .join("testdata")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    if want != text {
        let first = want
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(want.lines().count().min(text.lines().count()));
        panic!(
            "{} differs from the rules rendered now, first at line {} \
             (UPDATE_GOLDEN=1 rewrites it):\n{text}",
            path.display(),
            first + 1
        );
    }
}

/// The addresses of a row's endpoints.
pub(crate) fn rule_backends(row: &ServiceRow) -> Vec<&str> {
    row.backends.iter().map(|b| b.address.as_str()).collect()
}

/// `rules` (an `iptables-restore` input) written into a network namespace of its own and saved
/// back, in each backend whose tools run here (`test` names the test in the skip notice).
pub(crate) fn saved_in_each_backend(test: &str, rules: fn() -> String) -> Vec<String> {
    let families = [crate::model::Family::V4];
    let saved = saved_in_each_tables(test, &families, move |_| rules());
    saved.into_iter().map(|(_, text)| text).collect()
}

/// `rules(family)` (an `iptables-restore --noflush` input) written into a network namespace of
/// its own and saved back, for each of `families` in each backend whose tools run here.
pub(crate) fn saved_in_each_tables(
    test: &str,
    families: &[crate::model::Family],
    rules: impl Fn(crate::model::Family) -> String + Copy + Send + 'static,
) -> Vec<(crate::netfilter::iptables::Tables, String)> {
    use crate::netfilter::iptables::{self, Backend, Tables};
    let mut saved = Vec::new();
    for backend in Backend::ALL {
        for &family in families {
            let tables = Tables { backend, family };
            let save = tables.tool("iptables-save");
            if !privileged(&format!("{test} ({save})"), &save) {
                continue;
            }
            let text = in_new_netns(move || {
                iptables::restore(tables, &rules(family))?;
                iptables::save(tables)
            });
            saved.push((tables, text));
        }
    }
    saved
}

/// The netfilter modes' IPv4 settings the golden files are rendered with: node1's address
/// 192.0.2.11, the pod range 10.244.0.0/16.
pub(crate) fn netfilter_settings() -> crate::netfilter::rules::Settings {
    netfilter_settings_of(crate::model::Family::V4)
}

/// [`netfilter_settings`] of `family`: for IPv6 node1's 2001:db8:192:2::11, the pod range
/// fd00:10:244::/56.
pub(crate) fn netfilter_settings_of(
    family: crate::model::Family,
) -> crate::netfilter::rules::Settings {
    let (node, pods) = match family {
        crate::model::Family::V4 => ("192.0.2.11", "10.244.0.0/16"),
        crate::model::Family::V6 => ("2001:db8:192:2::11", "fd00:10:244::/56"),
    };
    let node: std::net::IpAddr = node.parse().unwrap();
    crate::netfilter::rules::Settings {
        family,
        cluster_cidr: Some(pods.parse().unwrap()),
        masquerade_all: false,
        node_port_addresses: Some(vec![node]),
        node_ips: vec![node],
    }
}

/// Services of both families, for the IPv6 golden files.
pub(crate) const DUAL_STACK: &str = include_str!("testdata/dual_stack.yaml");
