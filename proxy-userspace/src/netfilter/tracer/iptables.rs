//! The iptables model: tables of chains of rules, written with `iptables-restore --noflush`
//! input as the iptables mode writes it, and walked as the kernel walks them.
use std::{collections::HashMap, net::SocketAddrV4};

use super::{Choices, Hook, Node, Packet, Rules, Verdict, in_range};
use crate::netfilter::iptables_save::split_words;

/// The built-in chains of each table a hook runs, in the kernel's order.
const HOOKS: &[(Hook, &[(&str, &str)])] = &[
    (Hook::Prerouting, &[("nat", "PREROUTING")]),
    (Hook::Input, &[("filter", "INPUT")]),
    (Hook::Forward, &[("filter", "FORWARD")]),
    (Hook::Output, &[("nat", "OUTPUT"), ("filter", "OUTPUT")]),
    (Hook::Postrouting, &[("nat", "POSTROUTING")]),
];

/// The tables, each chain with its rules (the words after `-A CHAIN`).
#[derive(Default)]
pub(crate) struct Iptables {
    tables: HashMap<String, HashMap<String, Vec<Vec<String>>>>,
}

impl Iptables {
    /// Applies `text` as `iptables-restore --noflush` does: a declared chain is created or
    /// emptied, `-A` appends, `-X` deletes; the other chains keep their rules.
    pub fn restore(&mut self, text: &str) {
        let mut table = None;
        for line in text.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix('*') {
                table = Some(self.tables.entry(name.to_owned()).or_default());
                continue;
            }
            if line == "COMMIT" || line.is_empty() || line.starts_with('#') {
                continue;
            }
            let chains = table.as_mut().expect("a rule before any *table line");
            if let Some(declared) = line.strip_prefix(':') {
                let name = declared.split_whitespace().next().expect("a chain name");
                chains.insert(name.to_owned(), Vec::new());
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let mut words = split_words(rest);
                let chain = words.remove(0);
                (chains.get_mut(&chain))
                    .unwrap_or_else(|| panic!("-A to the undeclared chain {chain}"))
                    .push(words);
            } else if let Some(chain) = line.strip_prefix("-X ") {
                let rules = chains.remove(chain.trim());
                assert!(
                    rules.is_some_and(|r| r.is_empty()),
                    "-X of {chain}: not empty"
                );
            } else {
                panic!("the tracer does not know the restore line {line:?}");
            }
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

    fn run(
        &self,
        table: &str,
        chain: &str,
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let Some(rules) = self.tables.get(table).and_then(|t| t.get(chain)) else {
            // A built-in chain nothing was added to; a jump to a missing chain cannot be
            // restored, so it is not met here.
            return Verdict::Continue;
        };
        for rule in rules {
            let Some(target) = matches(rule, node, packet, choices) else {
                continue;
            };
            let verdict = match target.name {
                "ACCEPT" => {
                    packet.accepted = true;
                    Verdict::Accept
                }
                "DROP" => Verdict::Drop,
                "REJECT" => Verdict::Reject,
                "RETURN" => return Verdict::Continue,
                "DNAT" => {
                    let to = target.option("--to-destination");
                    packet.translate(to.parse::<SocketAddrV4>().expect("DNAT to ip:port"));
                    Verdict::Accept
                }
                "MASQUERADE" => {
                    packet.masqueraded = true;
                    Verdict::Accept
                }
                "MARK" => {
                    let (op, value) = target.options[..2].split_first().expect("MARK option");
                    let value = mark(&value[0]);
                    match op.as_str() {
                        "--or-mark" => packet.mark |= value,
                        "--xor-mark" => packet.mark ^= value,
                        other => panic!("the tracer does not know MARK {other}"),
                    }
                    Verdict::Continue
                }
                chain => self.run(table, chain, node, packet, choices),
            };
            if verdict != Verdict::Continue {
                return verdict;
            }
        }
        Verdict::Continue
    }
}

impl Rules for Iptables {
    fn hook(&self, hook: Hook, node: &Node, packet: &mut Packet, choices: &mut Choices) -> Verdict {
        let (_, chains) = HOOKS.iter().find(|(h, _)| *h == hook).expect("a hook");
        for (table, chain) in *chains {
            if *table == "nat" && packet.nat_done && hook != Hook::Postrouting {
                continue;
            }
            match self.run(table, chain, node, packet, choices) {
                Verdict::Continue | Verdict::Return | Verdict::Accept => {}
                end => return end,
            }
        }
        Verdict::Continue
    }
}

/// A rule's target and the options after it.
struct Target<'a> {
    name: &'a str,
    options: &'a [String],
}

impl Target<'_> {
    fn option(&self, name: &str) -> &str {
        let at = (self.options.iter().position(|o| o == name))
            .unwrap_or_else(|| panic!("{} without {name}", self.name));
        &self.options[at + 1]
    }
}

/// The target of `rule` if it matches `packet` (a random match last, so that only a packet
/// the rest matches makes a choice).
fn matches<'a>(
    rule: &'a [String],
    node: &Node,
    packet: &Packet,
    choices: &mut Choices,
) -> Option<Target<'a>> {
    let mut random = false;
    let mut matched = true;
    let mut i = 0;
    while i < rule.len() {
        let negated = rule[i] == "!";
        if negated {
            i += 1;
        }
        let option = rule[i].as_str();
        let value = rule.get(i + 1).map(String::as_str).unwrap_or_default();
        let (hit, words) = match option {
            "-j" => {
                let target = Target {
                    name: value,
                    options: &rule[i + 2..],
                };
                let hit = matched && (!random || choices.take());
                return hit.then_some(target);
            }
            "-m" => (true, 2),
            "--comment" | "--mode" | "--name" | "--seconds" => (true, 2),
            "--reap" => (true, 1),
            "-p" => (value == packet.protocol, 2),
            "-s" => (in_range(value, packet.source), 2),
            "-d" => (in_range(value, packet.destination), 2),
            "--dport" => (value.parse() == Ok(packet.port), 2),
            "--src-type" | "--dst-type" => {
                assert_eq!(value, "LOCAL", "the tracer knows addrtype LOCAL only");
                let ip = match option {
                    "--src-type" => packet.source,
                    _ => packet.destination,
                };
                (node.is_local(ip), 2)
            }
            "--mark" => {
                let (value, mask) = value.split_once('/').expect("--mark value/mask");
                (packet.mark & mark(mask) == mark(value), 2)
            }
            // Every traced packet opens a connection.
            "--ctstate" => (value.split(',').any(|s| s == "NEW"), 2),
            "--probability" => {
                random = true;
                (true, 2)
            }
            // Affinity: no client was seen before.
            "--rcheck" => (false, 1),
            "--set" => (true, 1),
            other => panic!("the tracer does not know {other:?} in {rule:?}"),
        };
        matched &= hit != negated;
        i += words;
    }
    panic!("a rule without a target: {rule:?}")
}

fn mark(text: &str) -> u32 {
    let hex = text.strip_prefix("0x").expect("a hexadecimal mark");
    u32::from_str_radix(hex, 16).expect("a mark")
}
