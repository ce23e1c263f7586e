//! What this node's kernel offers the ebpf mode, found by probing it (a kernel's version says
//! little: distributions backport features), once, at load. A missing feature that has an older
//! form is replaced by it; one that has none switches its part off, with one log line saying
//! what users lose; a missing required one makes the load fail with the kernel it needs, so
//! that `--proxy-mode auto` moves on to a netfilter mode.
use std::sync::OnceLock;

use anyhow::bail;
use aya::{
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported},
};

use crate::rows::FeatureRow;

/// One kernel feature the ebpf mode uses.
pub struct Feature {
    pub name: &'static str,
    /// The mainline release that brought it.
    pub kernel: &'static str,
    /// What happens on a kernel without it (None: required).
    pub without: Option<&'static str>,
    /// Ok(false): the kernel lacks it; Err: the probe could not tell (no CAP_BPF).
    probe: fn() -> anyhow::Result<bool>,
}

impl Feature {
    /// What a node without it is told: the feature, its kernel, what is lost.
    pub fn lacking(&self) -> String {
        format!(
            "this kernel lacks {} (Linux {}): {}",
            self.name,
            self.kernel,
            self.without.unwrap_or("required by the ebpf mode")
        )
    }
}

pub static REDIRECT_NEIGH: Feature = Feature {
    name: "bpf_redirect_neigh",
    kernel: "5.10",
    without: None,
    probe: || {
        helper(
            ProgramType::SchedClassifier,
            BpfHelper::BPF_FUNC_redirect_neigh,
        )
    },
};
pub static MEMCG_ACCOUNTING: Feature = Feature {
    name: "memcg-accounting",
    kernel: "5.11",
    without: Some(
        "maps are charged to RLIMIT_MEMLOCK (the agent lifts it) and a map's size is capped at \
         4 GiB: the Maglev tables hold 512k chunks (32k Maglev service ports at the default \
         table size) instead of 1M",
    ),
    // libbpf's probe: bpf_ktime_get_coarse_ns came in the release that moved map memory from
    // RLIMIT_MEMLOCK to the memory cgroup.
    probe: || {
        helper(
            ProgramType::SocketFilter,
            BpfHelper::BPF_FUNC_ktime_get_coarse_ns,
        )
    },
};
pub static NETNS_COOKIE: Feature = Feature {
    name: "SO_NETNS_COOKIE",
    kernel: "5.14",
    without: Some(
        "the socket programs cannot tell the node's network namespace from pods': they are not \
         attached, and host-network clients (kubelet probes, host-network pods) do not reach \
         Services",
    ),
    // The error is said: a kernel that has it should never fail here (seen once, unexplained).
    probe: || match super::cgroup::own_netns_cookie() {
        Ok(_) => Ok(true),
        Err(e) => {
            tracing::warn!("probing SO_NETNS_COOKIE: {e}");
            Ok(false)
        }
    },
};
pub static SET_RETVAL: Feature = Feature {
    name: "bpf_set_retval",
    kernel: "5.18",
    without: Some(
        "a host-network client connecting to a Service without endpoints gets EPERM instead of \
         ECONNREFUSED (refused at once all the same)",
    ),
    probe: || helper(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval),
};
pub static TCX: Feature = Feature {
    name: "tcx-links",
    kernel: "6.6",
    without: Some("tc programs are attached as cls_bpf filters through netlink (same traffic)"),
    probe: tcx_supported,
};

/// Every feature, in the order the README's kernel table and the metric list them.
pub static ALL: [&Feature; 5] = [
    &REDIRECT_NEIGH,
    &MEMCG_ACCOUNTING,
    &NETNS_COOKIE,
    &SET_RETVAL,
    &TCX,
];

/// What the probes found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    present: [bool; ALL.len()],
}

impl Features {
    /// This kernel's features, probed on first use (which logs each missing optional one).
    pub fn of_this_kernel() -> anyhow::Result<Features> {
        static PROBED: OnceLock<Result<Features, String>> = OnceLock::new();
        let probed = PROBED.get_or_init(|| {
            let mut found = Features {
                present: [false; ALL.len()],
            };
            for (present, feature) in found.present.iter_mut().zip(ALL) {
                *present =
                    (feature.probe)().map_err(|e| format!("probing {}: {e:#}", feature.name))?;
            }
            for feature in ALL.iter().filter(|f| !found.has(f) && f.without.is_some()) {
                tracing::warn!("{}", feature.lacking());
            }
            Ok(found)
        });
        probed.clone().map_err(anyhow::Error::msg)
    }

    pub fn has(&self, feature: &Feature) -> bool {
        ALL.iter()
            .position(|f| std::ptr::eq(*f, feature))
            .is_some_and(|i| self.present[i])
    }

    /// Fails naming the first required feature missing.
    pub fn check(&self) -> anyhow::Result<()> {
        match ALL.iter().find(|f| f.without.is_none() && !self.has(f)) {
            Some(feature) => bail!(
                "{}: pick --proxy-mode nftables or iptables (auto does)",
                feature.lacking()
            ),
            None => Ok(()),
        }
    }
}

/// `inspect features`: every feature, whether `found` has it and what its absence costs.
pub fn rows(found: Features) -> Vec<FeatureRow> {
    ALL.iter()
        .map(|feature| FeatureRow {
            feature: feature.name,
            since: feature.kernel,
            present: found.has(feature),
            without: feature
                .without
                .unwrap_or("required: the ebpf mode does not load"),
        })
        .collect()
}

/// On `/metrics`: `kubeproxy_bpf_kernel_feature{feature, since}`, 1 where this kernel has it.
pub fn export(found: Features) {
    crate::serve::metrics::METRICS.add_collector(Box::new(move |out| {
        use std::fmt::Write as _;
        let name = "kubeproxy_bpf_kernel_feature";
        let help = "Kernel features the ebpf mode uses: 1 where this node's kernel has it (see \
                    the README's kernel table for what each brings)";
        crate::serve::metrics::header(out, name, help, "gauge");
        for feature in ALL {
            let _ = writeln!(
                out,
                "{name}{{feature=\"{}\",since=\"{}\"}} {}",
                feature.name,
                feature.kernel,
                u8::from(found.has(feature))
            );
        }
    }));
}

fn helper(program: ProgramType, helper: BpfHelper) -> anyhow::Result<bool> {
    is_helper_supported(program, helper).map_err(|e| {
        anyhow::Error::new(e)
            .context("loading a BPF program (needs root, or CAP_BPF and CAP_NET_ADMIN)")
    })
}

/// Whether the kernel knows tcx attach points: a query of the loopback interface's tcx ingress
/// (read only) succeeds from 6.6 on, and is refused as an unknown attach type before.
fn tcx_supported() -> anyhow::Result<bool> {
    /// The `query` member of `union bpf_attr`, up to `prog_cnt` (older kernels refuse a longer
    /// attribute whose tail they do not know unless it is zero).
    #[repr(C)]
    #[derive(Default)]
    struct QueryAttr {
        target_ifindex: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        prog_cnt: u32,
        pad: u32,
    }
    const BPF_PROG_QUERY: libc::c_long = 16;
    const BPF_TCX_INGRESS: u32 = 46;
    let mut attr = QueryAttr {
        target_ifindex: 1, // lo
        attach_type: BPF_TCX_INGRESS,
        ..Default::default()
    };
    // SAFETY: the bpf syscall reads `size_of::<QueryAttr>()` bytes of `attr` and writes only
    // its prog_cnt and attach_flags (prog_ids is null).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_QUERY,
            &raw mut attr,
            size_of::<QueryAttr>() as u32,
        )
    };
    match rc {
        0 => Ok(true),
        _ => match std::io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::EPERM) => {
                Err(anyhow::anyhow!("BPF_PROG_QUERY: {e} (needs CAP_NET_ADMIN)"))
            }
            _ => Ok(false),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine's kernel (6.18) has every feature; a kernel without some is tested in the
    /// VM (`cargo xtask vm-test --kernel 5.10`).
    #[test]
    fn this_kernel_has_every_feature() {
        if !crate::testing::privileged("this_kernel_has_every_feature", "bpftool") {
            return;
        }
        let found = Features::of_this_kernel().unwrap();
        for feature in ALL {
            assert!(found.has(feature), "{} missing", feature.name);
        }
        found.check().unwrap();
    }
}
