//! The iptables model: the nat and filter tables' chains of rules, written with
//! `iptables-restore --noflush` input as the iptables mode writes it, checked as
//! `iptables-restore` checks it, and walked as the kernel walks them.
use std::{collections::HashMap, net::SocketAddr};

use super::{Choices, Hook, Node, Packet, Rules, Verdict, in_range, mark, run_base_chains};
use crate::netfilter::iptables_save::split_words;

/// The built-in chains of each table a hook runs, in the kernel's order.
const HOOKS: &[(Hook, &[(&str, &str)])] = &[
    (Hook::Prerouting, &[("nat", "PREROUTING")]),
    (Hook::Input, &[("filter", "INPUT")]),
    (Hook::Forward, &[("filter", "FORWARD")]),
    (Hook::Output, &[("nat", "OUTPUT"), ("filter", "OUTPUT")]),
    (Hook::Postrouting, &[("nat", "POSTROUTING")]),
];

const BUILT_IN: &[&str] = &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
const TARGETS: &[&str] = &[
    "ACCEPT",
    "DROP",
    "REJECT",
    "RETURN",
    "DNAT",
    "MARK",
    "MASQUERADE",
];
/// The match modules the renderers use.
const MODULES: &[&str] = &[
    "comment",
    "tcp",
    "udp",
    "sctp",
    "addrtype",
    "mark",
    "conntrack",
    "statistic",
    "recent",
];

/// The tables, each chain with its rules (the words after `-A CHAIN`).
#[derive(Clone, Default)]
pub(crate) struct Iptables {
    tables: HashMap<String, HashMap<String, Vec<Vec<String>>>>,
}

impl Iptables {
    /// Applies `text` as `iptables-restore --noflush` does: a declared chain is created or
    /// emptied, `-A` appends, `-X` deletes; the other chains keep their rules. Panics where
    /// `iptables-restore` would fail.
    pub fn restore(&mut self, text: &str) {
        let mut table: Option<&str> = None;
        for line in text.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix('*') {
                assert!(
                    ["nat", "filter"].contains(&name),
                    "the tracer does not know the table {name}"
                );
                table = Some(name);
                continue;
            }
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let name = table.expect("a rule before any *table line");
            if line == "COMMIT" {
                self.check(name);
                table = None;
                continue;
            }
            let chains = self.tables.entry(name.to_owned()).or_default();
            if let Some(declared) = line.strip_prefix(':') {
                let words: Vec<&str> = declared.split_whitespace().collect();
                let [chain, policy, _counters] = words[..] else {
                    panic!("the tracer does not know the declaration {line:?}")
                };
                let built_in = BUILT_IN.contains(&chain);
                assert!(
                    policy == if built_in { "ACCEPT" } else { "-" },
                    "{line:?}: the tracer knows built-in chains with an ACCEPT policy only"
                );
                chains.insert(chain.to_owned(), Vec::new());
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let mut words = split_words(rest);
                let chain = words.remove(0);
                (chains.get_mut(&chain))
                    .unwrap_or_else(|| panic!("-A to the undeclared chain {chain}"))
                    .push(words);
            } else if let Some(chain) = line.strip_prefix("-X ") {
                let chain = chain.trim();
                let rules = chains.remove(chain);
                assert!(
                    rules.is_some_and(|r| r.is_empty()),
                    "-X of {chain}: not empty"
                );
                let used = (chains.values().flatten()).any(|rule| target(rule) == chain);
                assert!(!used, "-X of {chain}: a rule still jumps to it");
            } else {
                panic!("the tracer does not know the restore line {line:?}");
            }
        }
        assert!(table.is_none(), "a table without COMMIT");
    }

    /// What `iptables-restore` checks at COMMIT: every jump goes to a target or a chain of
    /// the table, each target in a table that has it.
    fn check(&self, table: &str) {
        let Some(chains) = self.tables.get(table) else {
            return;
        };
        for (chain, rule) in chains
            .iter()
            .flat_map(|(c, rules)| rules.iter().map(move |r| (c, r)))
        {
            let to = target(rule);
            assert!(
                TARGETS.contains(&to) || chains.contains_key(to),
                "{table} {chain}: a jump to the missing chain {to}"
            );
            let valid = match to {
                "DNAT" | "MASQUERADE" => table == "nat",
                "REJECT" => table == "filter",
                _ => true,
            };
            assert!(
                valid,
                "{table} {chain}: {to} is not valid in the {table} table"
            );
        }
    }

    /// `iptables -t table -I|-A chain args...` (the jumps from the built-in chains).
    pub fn add(&mut self, table: &str, chain: &str, first: bool, args: Vec<String>) {
        let rules = (self.tables.entry(table.to_owned()).or_default())
            .entry(chain.to_owned())
            .or_default();
        match first {
            true => rules.insert(0, args),
            false => rules.push(args),
        }
    }

    /// The rules, sorted: to compare two models.
    pub fn dump(&self) -> String {
        let mut lines: Vec<String> = (self.tables.iter())
            .flat_map(|(table, chains)| {
                chains.iter().map(move |(chain, rules)| {
                    let rules: Vec<String> = rules.iter().map(|r| r.join(" ")).collect();
                    format!("{table} {chain}: {}", rules.join(" | "))
                })
            })
            .collect();
        lines.sort();
        lines.join("\n")
    }

    fn run(
        &self,
        table: &str,
        chain: &str,
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let rules = self.tables.get(table).and_then(|t| t.get(chain));
        let Some(rules) = rules else {
            assert!(BUILT_IN.contains(&chain), "{table} {chain}: no such chain");
            return Verdict::Continue;
        };
        for rule in rules {
            let Some((target, options)) = matches(chain, rule, node, packet, choices) else {
                continue;
            };
            let verdict = match (target, options) {
                ("ACCEPT", []) => {
                    packet.accepted = true;
                    Verdict::Accept
                }
                ("DROP", []) => Verdict::Drop,
                ("REJECT", []) => Verdict::Reject,
                ("RETURN", []) => return Verdict::Continue,
                ("DNAT", [option, to]) if option == "--to-destination" => {
                    let to = to.parse::<SocketAddr>();
                    packet.translate(to.unwrap_or_else(|_| panic!("{rule:?}: DNAT to ip:port")));
                    Verdict::Accept
                }
                ("MASQUERADE", [] | [_]) => {
                    assert!(
                        options.iter().all(|o| o == "--random-fully"),
                        "{rule:?}: the tracer does not know these options"
                    );
                    packet.masqueraded = true;
                    Verdict::Accept
                }
                ("MARK", [op, value]) => {
                    match op.as_str() {
                        "--or-mark" => packet.mark |= mark(value),
                        "--xor-mark" => packet.mark ^= mark(value),
                        other => panic!("the tracer does not know MARK {other}"),
                    }
                    Verdict::Continue
                }
                (chain, []) if !TARGETS.contains(&chain) => {
                    self.run(table, chain, node, packet, choices)
                }
                _ => panic!("the tracer does not know the target of {rule:?}"),
            };
            if verdict != Verdict::Continue {
                return verdict;
            }
        }
        Verdict::Continue
    }
}

impl Rules for Iptables {
    fn hook(
        &self,
        hook: Hook,
        nat: bool,
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let (_, chains) = HOOKS.iter().find(|(h, _)| *h == hook).expect("a hook");
        let chains = chains
            .iter()
            .map(|&(table, chain)| (table == "nat", (table, chain)));
        run_base_chains(chains, nat, |(table, chain)| {
            self.run(table, chain, node, packet, choices)
        })
    }
}

/// The target of a rule (the word after `-j`).
fn target(rule: &[String]) -> &str {
    let at = rule
        .iter()
        .position(|w| w == "-j")
        .expect("a rule without -j");
    &rule[at + 1]
}

/// The target of `rule` (in `chain`) and the options after it, if the rule matches `packet`
/// (a random match last, so that only a packet the rest matches makes a choice).
fn matches<'a>(
    chain: &str,
    rule: &'a [String],
    node: &Node,
    packet: &Packet,
    choices: &mut Choices,
) -> Option<(&'a str, &'a [String])> {
    let mut probability = None;
    let mut matched = true;
    let mut i = 0;
    let name = |i: usize| -> &str { rule.get(i).map_or("", String::as_str) };
    while i < rule.len() {
        let negated = rule[i] == "!";
        if negated {
            i += 1;
        }
        let option = rule[i].as_str();
        let value = name(i + 1);
        let (hit, words) = match option {
            "-j" => {
                let hit = matched && probability.is_none_or(|p| choices.take(p));
                return hit.then_some((value, &rule[i + 2..]));
            }
            "-m" => {
                assert!(
                    MODULES.contains(&value),
                    "the tracer does not know -m {value}"
                );
                (true, 2)
            }
            "--comment" => (true, 2),
            "--mode" => {
                assert_eq!(value, "random", "the tracer knows statistic random only");
                (true, 2)
            }
            "-p" => {
                assert!(["tcp", "udp", "sctp"].contains(&value), "-p {value}");
                (value == packet.protocol, 2)
            }
            "-s" | "-d" => (in_range(value, packet.address(option == "-s")), 2),
            "--dport" => {
                let port: u16 = (value.parse()).unwrap_or_else(|_| panic!("--dport {value}"));
                (port == packet.port, 2)
            }
            "--src-type" | "--dst-type" => {
                assert_eq!(value, "LOCAL", "the tracer knows addrtype LOCAL only");
                (node.is_local(packet.address(option == "--src-type")), 2)
            }
            "--mark" => {
                let (value, mask) = value.split_once('/').expect("--mark value/mask");
                (packet.mark & mark(mask) == mark(value), 2)
            }
            // Every traced packet opens a connection.
            "--ctstate" => {
                let states: Vec<&str> = value.split(',').collect();
                let known = ["NEW", "ESTABLISHED", "RELATED", "INVALID"];
                assert!(
                    states.iter().all(|s| known.contains(s)),
                    "--ctstate {value}"
                );
                (states.contains(&"NEW"), 2)
            }
            "--probability" => {
                let p = (value.parse()).unwrap_or_else(|_| panic!("--probability {value}"));
                probability = Some(p);
                (true, 2)
            }
            // Affinity: the endpoint a client was sent to last, remembered under the name of
            // that endpoint's chain, which the rule jumps to, and which records it there.
            "--name" => {
                let remembers = rule.iter().any(|w| w == "--set");
                let expected = if remembers { chain } else { target(rule) };
                assert_eq!(value, expected, "{rule:?}: affinity under another name");
                (true, 2)
            }
            "--seconds" | "--reap" => (true, if option == "--reap" { 1 } else { 2 }),
            // No client was seen before.
            "--rcheck" => (false, 1),
            "--set" => (true, 1),
            other => panic!("the tracer does not know {other:?} in {rule:?}"),
        };
        matched &= hit != negated;
        i += words;
    }
    panic!("a rule without a target: {rule:?}")
}
