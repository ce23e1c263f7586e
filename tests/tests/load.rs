//! Correct under change, proven under load: real traffic from the client pod to the example's
//! ClusterIPs (short TCP connections, long-lived TCP connections, UDP requests) while the
//! agent crashes and restarts, its programs are upgraded in place, and a Service's endpoints
//! roll over the way a Deployment rollout changes them. Every failure counts.
use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use aya::{
    programs::{SchedClassifier, TcAttachType},
    util::KernelVersion,
};
use proxy_tests::{
    Sandbox,
    agent::{AgentRun, add_endpoint, edit_manifest, remove_endpoint, set_conditions},
    example::{DNS, WEB, cluster},
    load::{self, LoadConfig, Report},
};

/// Load on web (short and long-lived TCP) and dns-like (UDP) from the client pod.
fn web_and_dns_load(sandbox: &Sandbox, long_conns: usize) -> load::LoadHandle {
    let mut config = LoadConfig::new(&sandbox.pod("client").ns);
    config.tcp = Some(WEB);
    config.udp = Some(DNS);
    config.long_conns = long_conns;
    // Under emulation (the 6.1 VM) restarts are slow: the load must outlast them.
    config.max_duration = proxy_tests::patience(Duration::from_secs(40));
    load::start(config).expect("starting the load")
}

/// Waits `ms` milliseconds, longer under emulation (so that traffic flows between steps).
fn sleep_ms(ms: u64) {
    std::thread::sleep(proxy_tests::patience(Duration::from_millis(ms)));
}

/// What is attached to pod interface `dev` of node1, per direction: the programs the kernel
/// runs there (tcx query: their ids and names) and the agent's pinned tcx link (its id, and the
/// program it holds, from `bpftool link`). None before Linux 6.6 (no tcx).
fn attached(sandbox: &Sandbox, agent: &AgentRun, dev: &str) -> Option<Attached> {
    if KernelVersion::current().is_ok_and(|v| v < KernelVersion::new(6, 6, 0)) {
        return None;
    }
    let index = sandbox.node1.run(|| {
        let name = std::ffi::CString::new(dev).unwrap();
        // SAFETY: a valid NUL-terminated name.
        unsafe { libc::if_nametoindex(name.as_ptr()) }
    });
    assert_ne!(index, 0, "no {dev} in node1");
    let mut out = Attached::new();
    for (direction, attach_type) in [
        ("ingress", TcAttachType::Ingress),
        ("egress", TcAttachType::Egress),
    ] {
        let programs = sandbox
            .node1
            .run(|| SchedClassifier::query_tcx(dev, attach_type))
            .unwrap_or_else(|e| panic!("tcx query of {dev} {direction}: {e}"))
            .1
            .iter()
            .map(|p| (p.id(), p.name_as_str().unwrap_or_default().to_owned()))
            .collect();
        let pin = agent
            .bpffs
            .path()
            .join(format!("links/tc-{index}-{direction}"));
        let link = proxy_tests::run(
            std::process::Command::new("bpftool")
                .args(["-j", "link", "show", "pinned"])
                .arg(&pin),
        )
        .unwrap_or_else(|e| panic!("the pinned {direction} link of {dev}: {e:#}"));
        let link: serde_json::Value = serde_json::from_str(&link).expect("bpftool's JSON");
        let link = (
            link["id"].as_u64().expect("link id") as u32,
            link["prog_id"].as_u64().expect("prog_id") as u32,
        );
        out.insert(direction, (programs, link));
    }
    Some(out)
}

/// Per direction: the attached programs (id, name), and the pinned link (id, program id).
type Attached = BTreeMap<&'static str, (Vec<(u32, String)>, (u32, u32))>;

/// Whether the programs went from `before` to `after` as an in-place upgrade: one program
/// attached per direction, a new one, through the same link.
fn upgrade_problems(when: &str, before: &Attached, after: &Attached) -> Vec<String> {
    let mut problems = Vec::new();
    for (direction, (programs, (link, link_program))) in after {
        let (old_programs, (old_link, _)) = &before[direction];
        if programs.len() != 1 {
            problems.push(format!(
                "{when}: {direction}: attached {programs:?}, not one program"
            ));
        }
        if programs.iter().any(|p| old_programs.contains(p)) {
            problems.push(format!(
                "{when}: {direction}: the old program still runs: {programs:?}"
            ));
        }
        if link != old_link {
            problems.push(format!(
                "{when}: {direction}: link {old_link} replaced by link {link} (the program must be swapped in place)"
            ));
        }
        if programs.first().map(|p| p.0) != Some(*link_program) {
            problems.push(format!(
                "{when}: {direction}: the pinned link does not hold the attached program"
            ));
        }
    }
    problems
}

/// Waits until the agent logs more syncs than `before` (2 s at most).
fn wait_for_sync(agent: &AgentRun, before: usize, what: &str) {
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(2));
    while agent.log_text().matches("sync done").count() <= before {
        assert!(
            Instant::now() < deadline,
            "the agent did not sync {what}:\n{}",
            agent.log_text()
        );
        sleep_ms(20);
    }
}

fn names(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// The backends that answered the attempts started in `from..until`.
fn answered(attempts: &[load::Attempt], from: Instant, until: Instant) -> BTreeSet<String> {
    Report::answered_by(attempts, from, until)
        .into_keys()
        .collect()
}

#[test]
fn agent_crash_restart_and_program_upgrade_under_load_lose_nothing() {
    let test = "agent_crash_restart_and_program_upgrade_under_load_lose_nothing";
    let Some((mut sandbox, mut agent)) = cluster(test) else {
        return;
    };
    let started = Instant::now();
    let load = web_and_dns_load(&sandbox, 4);
    let original = attached(&sandbox, &agent, "veth-client");
    sleep_ms(1000);

    // A crash: SIGKILL, no clean-up. The pinned programs and maps keep serving alone.
    agent.kill(&mut sandbox).unwrap();
    sleep_ms(1000);
    agent.start_again(&mut sandbox).unwrap();
    let after_crash = attached(&sandbox, &agent, "veth-client");
    sleep_ms(1000);

    // An ordinary restart (a rollout of the agent): freshly loaded programs replace the
    // attached ones in place, an upgrade of the datapath under traffic.
    agent.stop(&mut sandbox).unwrap();
    agent.start_again(&mut sandbox).unwrap();
    let upgraded_at = Instant::now();
    let upgraded = attached(&sandbox, &agent, "veth-client");
    sleep_ms(2000);
    let report = load.stop();
    println!("{test}:\n{}", report.summary());
    println!(
        "on veth-client ((program id, name), (link id, its program id)):\n  started {original:?}\n  after the crash {after_crash:?}\n  upgraded {upgraded:?}"
    );

    let mut problems = report.failures();
    match (&original, &after_crash, &upgraded) {
        (Some(original), Some(after_crash), Some(upgraded)) => {
            problems.extend(upgrade_problems(
                "the restart after the crash",
                original,
                after_crash,
            ));
            problems.extend(upgrade_problems(
                "the second restart",
                after_crash,
                upgraded,
            ));
        }
        _ => println!("{test}: no tcx before Linux 6.6: the program upgrade is not checked"),
    }
    // Traffic really flowed through all of it, on every backend.
    let web = names(&["be1", "be2", "be3"]);
    if answered(&report.short, upgraded_at, report.stopped) != web {
        problems.push("short connections after the upgrade did not reach every web backend".into());
    }
    if answered(&report.udp, upgraded_at, report.stopped) != names(&["be1", "be4"]) {
        problems.push("UDP after the upgrade did not reach every dns-like backend".into());
    }
    if report.long.iter().any(|c| c.last_answer < upgraded_at) {
        problems.push("a long-lived connection was not answered after the upgrade".into());
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n  {}\n{}\nagent log:\n{}",
        problems.len(),
        problems.join("\n  "),
        report.summary(),
        agent.log_text()
    );
    println!("{test}: {:.1}s", started.elapsed().as_secs_f64());
}

#[test]
fn a_rolling_update_of_endpoints_under_load_loses_nothing() {
    let test = "a_rolling_update_of_endpoints_under_load_loses_nothing";
    let Some((mut sandbox, agent)) = cluster(test) else {
        return;
    };
    let started = Instant::now();
    let old = [
        ("be1", "10.244.1.11"),
        ("be2", "10.244.1.12"),
        ("be3", "10.244.1.13"),
    ];
    let web_rows = |n: usize| {
        move |rows: &[proxy_userspace::rows::ServiceRow]| {
            rows.iter()
                .any(|r| r.address == "10.96.0.10:80" && r.backends.len() == n)
        }
    };
    // The long-lived connections open now, on the old endpoints (web is be1..be3).
    let load = web_and_dns_load(&sandbox, 6);
    sleep_ms(1000);

    // 1. Surge: the new pod (be4, on node2) becomes a ready endpoint.
    edit_manifest(&agent.manifest, |objects| {
        add_endpoint(objects, "web", "10.244.2.11", "node2")
    })
    .unwrap();
    agent
        .wait_for(&mut sandbox, "be4 joining web", web_rows(4))
        .unwrap();
    let surged_at = Instant::now();
    sleep_ms(1500);

    // 2. The old pods are shutting down: not ready, still serving, terminating.
    edit_manifest(&agent.manifest, |objects| {
        for (_, ip) in old {
            set_conditions(objects, "web", ip, false, true, true);
        }
    })
    .unwrap();
    agent
        .wait_for(&mut sandbox, "only be4 taking new connections", web_rows(1))
        .unwrap();
    let terminating_at = Instant::now();
    sleep_ms(1500);

    // 3. The old endpoints leave the slice (their pods keep running: connections drain).
    let syncs = agent.log_text().matches("sync done").count();
    edit_manifest(&agent.manifest, |objects| {
        for (_, ip) in old {
            remove_endpoint(objects, "web", ip);
        }
    })
    .unwrap();
    wait_for_sync(&agent, syncs, "the removal of the old endpoints");
    let removed_at = Instant::now();
    sleep_ms(2000);
    let report = load.stop();
    let timeline = format!(
        "rollout: +{:.3}s be4 added, +{:.3}s old endpoints terminating, +{:.3}s removed",
        (surged_at - report.started).as_secs_f64(),
        (terminating_at - report.started).as_secs_f64(),
        (removed_at - report.started).as_secs_f64(),
    );
    println!("{test}:\n{}{timeline}", report.summary());

    let mut problems = report.failures();
    let old_names: BTreeSet<String> = old.iter().map(|(n, _)| n.to_string()).collect();
    let surge = answered(&report.short, surged_at, terminating_at);
    if !surge.contains("be4") || surge.is_disjoint(&old_names) {
        problems.push(format!(
            "during the surge, short connections went to {surge:?} (be4 and the old endpoints expected)"
        ));
    }
    let new_conns = Report::answered_by(&report.short, terminating_at, report.stopped);
    if new_conns.is_empty() || new_conns.keys().any(|b| old_names.contains(b)) {
        problems.push(format!(
            "new connections after the old endpoints turned terminating went to {new_conns:?} (only be4 may take them)"
        ));
    }
    for c in &report.long {
        if !old_names.contains(&c.backend) {
            problems.push(format!(
                "long-lived connection {} opened on {}, not an old endpoint",
                c.index, c.backend
            ));
        }
        if c.broke.is_none() && c.last_answer < removed_at {
            problems.push(format!(
                "long-lived connection {} to {} not answered after its endpoint left the slice",
                c.index, c.backend
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems ({timeline}):\n  {}\n{}",
        problems.len(),
        problems.join("\n  "),
        report.summary(),
    );
    println!("{test}: {:.1}s", started.elapsed().as_secs_f64());
}
