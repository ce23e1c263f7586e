//! The nftables model: tables of chains, sets and verdict maps, written with the `nft -f`
//! transactions the nftables mode renders, checked as the kernel checks them, and walked as the
//! kernel walks them.
use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
};

use super::{Choices, Hook, Node, Packet, Rules, Verdict, in_range, mark, run_base_chains};
use crate::netfilter::iptables_save::split_words;

#[derive(Clone, Default)]
struct Table {
    chains: HashMap<String, Chain>,
    /// Sets and maps: each element's key (words joined by one space) and, in a map, its
    /// verdict.
    sets: HashMap<String, BTreeMap<String, String>>,
}

#[derive(Clone, Default)]
struct Chain {
    base: Option<Base>,
    rules: Vec<Vec<String>>,
}

/// A base chain's type, hook and priority.
#[derive(Clone, Copy)]
struct Base {
    nat: bool,
    hook: Hook,
    priority: i32,
}

impl Table {
    /// Whether a rule or a map element names `object` (a chain, or `@set`).
    fn refers_to(&self, object: &str) -> bool {
        let words = (self.chains.values().flat_map(|c| &c.rules).flatten())
            .flat_map(|w| w.split(' '))
            .chain(
                self.sets
                    .values()
                    .flat_map(|s| s.values())
                    .flat_map(|v| v.split(' ')),
            );
        words.into_iter().any(|w| w == object)
    }
}

/// The tables, by family and name (`ip kube-proxy`, `ip6 kube-proxy`); a packet meets those of
/// its family only.
#[derive(Clone, Default)]
pub(crate) struct Nftables {
    tables: BTreeMap<String, Table>,
}

/// Where a rule runs: its table, and the base chain it was reached from.
struct At<'a> {
    table: &'a Table,
    base: Base,
}

impl Nftables {
    /// Applies an `nft -f` transaction; panics where the kernel would refuse it.
    pub fn apply(&mut self, text: &str) {
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let words = split_words(line);
            let words: Vec<&str> = words.iter().map(String::as_str).collect();
            let [op, kind, family, name, rest @ ..] = words.as_slice() else {
                panic!("the tracer does not know the command {line:?}")
            };
            assert!(
                ["ip", "ip6"].contains(family),
                "{line:?}: the tracer knows the ip and ip6 families only"
            );
            let table = format!("{family} {name}");
            match (*op, *kind) {
                ("add", "table") => {
                    self.tables.entry(table).or_default();
                }
                ("delete", "table") => {
                    found(self.tables.remove(&table), line);
                }
                _ => self.apply_in(&table, op, kind, rest, line),
            }
        }
    }

    fn apply_in(&mut self, table: &str, op: &str, kind: &str, rest: &[&str], line: &str) {
        let t = found(self.tables.get_mut(table), line);
        let name = rest[0].to_owned();
        match (op, kind) {
            ("add", "chain") => {
                let base = match rest[1..] {
                    [] => None,
                    [
                        "{",
                        "type",
                        kind,
                        "hook",
                        hook,
                        "priority",
                        priority,
                        ";",
                        "}",
                    ] => Some(Base {
                        nat: match kind {
                            "nat" => true,
                            "filter" => false,
                            other => panic!("{line:?}: chain type {other}"),
                        },
                        hook: hook_of(hook),
                        priority: priority.parse().expect("a priority"),
                    }),
                    _ => panic!("the tracer does not know the chain {line:?}"),
                };
                let chain = t.chains.entry(name).or_default();
                if chain.base.is_none() {
                    chain.base = base;
                }
            }
            ("flush", "chain") => found(t.chains.get_mut(&name), line).rules.clear(),
            ("delete", "chain") => {
                let chain = found(t.chains.remove(&name), line);
                assert!(chain.rules.is_empty(), "{line:?}: the chain has rules");
                assert!(
                    !t.refers_to(&name),
                    "{line:?}: the chain is still referred to"
                );
            }
            ("add", "set" | "map") => {
                t.sets.entry(name).or_default();
            }
            ("flush", "set" | "map") => found(t.sets.get_mut(&name), line).clear(),
            ("delete", "set" | "map") => {
                found(t.sets.remove(&name), line);
                let used = t.refers_to(&format!("@{name}"));
                assert!(!used, "{line:?}: a rule still uses the set");
            }
            ("add", "rule") => {
                let rule = rest[1..].iter().map(|w| w.to_string()).collect();
                found(t.chains.get_mut(&name), line).rules.push(rule);
            }
            ("add" | "delete", "element") => {
                let set = found(t.sets.get_mut(&name), line);
                for (key, verdict) in elements(&rest[1..]) {
                    if op == "delete" {
                        found(set.remove(&key), line);
                    } else if let Some(old) = set.insert(key.clone(), verdict.clone()) {
                        assert_eq!(old, verdict, "{line:?}: {key} is there with another value");
                    }
                }
            }
            _ => panic!("the tracer does not know the command {line:?}"),
        }
        let referred = (t.chains.values().flat_map(|c| &c.rules).flatten())
            .filter_map(|w| w.strip_prefix('@'))
            .find(|set| !t.sets.contains_key(*set));
        assert!(
            referred.is_none(),
            "{line:?}: a rule uses the missing set {referred:?}"
        );
    }

    /// The tables, sorted: to compare two models.
    pub fn dump(&self) -> String {
        let mut lines = Vec::new();
        for (name, table) in &self.tables {
            for (chain, c) in &table.chains {
                let rules: Vec<String> = c.rules.iter().map(|r| r.join(" ")).collect();
                lines.push(format!("{name} chain {chain}: {}", rules.join(" | ")));
            }
            for (set, elements) in &table.sets {
                lines.push(format!("{name} set {set}: {elements:?}"));
            }
        }
        lines.sort();
        lines.join("\n")
    }

    /// Runs `chain`: its verdict (Continue when it ran to its end or returned).
    fn run(
        &self,
        at: &At,
        chain: &str,
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let chain = (at.table.chains.get(chain)).unwrap_or_else(|| panic!("no chain {chain}"));
        for rule in &chain.rules {
            match self.rule(at, rule, node, packet, choices) {
                Verdict::Continue => {}
                Verdict::Return => return Verdict::Continue,
                end => return end,
            }
        }
        Verdict::Continue
    }

    /// Runs one rule: Continue when it did not match or ended without a verdict.
    fn rule(
        &self,
        at: &At,
        rule: &[String],
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let words: Vec<&str> = rule.iter().map(String::as_str).collect();
        let mut w = words.as_slice();
        loop {
            // Each arm is one statement: a match that fails ends the rule, one that holds (or
            // a statement that is no match) leaves the words after it.
            w = match w {
                [] | ["comment", _] => return Verdict::Continue,
                ["ct", "state", state, rest @ ..] => {
                    let known = ["new", "established", "related", "invalid"];
                    let states: Vec<&str> = state.split(',').collect();
                    assert!(states.iter().all(|s| known.contains(s)), "ct state {state}");
                    if !states.contains(&"new") {
                        return Verdict::Continue;
                    }
                    rest
                }
                // A concatenation looked up in a verdict map.
                [_, _, ".", ..] => {
                    let at_vmap = (w.iter().position(|x| *x == "vmap")).expect("a vmap lookup");
                    let key = concat(&w[..at_vmap], packet);
                    let [map, rest @ ..] = &w[at_vmap + 1..] else {
                        panic!("vmap without a map")
                    };
                    end_of_rule(rest);
                    let map = map.strip_prefix('@').expect("vmap @map");
                    let Some(verdict) = at.table.sets[map].get(&key) else {
                        return Verdict::Continue;
                    };
                    let verdict: Vec<&str> = verdict.split(' ').collect();
                    return self.verdict(at, &verdict, node, packet, choices);
                }
                ["ip" | "ip6", field @ ("saddr" | "daddr"), rest @ ..] => {
                    let ip = packet.address(*field == "saddr");
                    let (negated, rest) = match rest {
                        ["!=", rest @ ..] => (true, rest),
                        rest => (false, rest),
                    };
                    let (set, rest) = set_of(rest);
                    let hit = match set.as_slice() {
                        [named] if named.starts_with('@') => {
                            let set = &at.table.sets[&named[1..]];
                            set.keys().any(|k| in_range(k, ip))
                        }
                        ranges => ranges.iter().any(|r| in_range(r, ip)),
                    };
                    if hit == negated {
                        return Verdict::Continue;
                    }
                    rest
                }
                [proto @ ("tcp" | "udp" | "sctp"), "dport", port, rest @ ..] => {
                    let port: u16 = (port.parse()).unwrap_or_else(|_| panic!("dport {port}"));
                    if packet.protocol != *proto || port != packet.port {
                        return Verdict::Continue;
                    }
                    rest
                }
                ["meta", "l4proto", proto, rest @ ..] => {
                    assert!(
                        ["tcp", "udp", "sctp"].contains(proto),
                        "meta l4proto {proto}"
                    );
                    if packet.protocol != *proto {
                        return Verdict::Continue;
                    }
                    rest
                }
                [
                    "fib",
                    field @ ("saddr" | "daddr"),
                    "type",
                    "local",
                    rest @ ..,
                ] => {
                    if !node.is_local(packet.address(*field == "saddr")) {
                        return Verdict::Continue;
                    }
                    rest
                }
                ["numgen", "random", "mod", n, "==", "0", rest @ ..] => {
                    let n: u32 = (n.parse()).unwrap_or_else(|_| panic!("numgen mod {n}"));
                    if !choices.take(1.0 / f64::from(n)) {
                        return Verdict::Continue;
                    }
                    rest
                }
                ["mark", "and", value, op @ ("==" | "!="), want, rest @ ..] => {
                    let hit = packet.mark & mark(value) == mark(want);
                    if hit != (*op == "==") {
                        return Verdict::Continue;
                    }
                    rest
                }
                ["mark", "set", "mark", op @ ("or" | "xor"), value, rest @ ..] => {
                    match *op {
                        "or" => packet.mark |= mark(value),
                        _ => packet.mark ^= mark(value),
                    }
                    rest
                }
                // Affinity: the first packet adds its client; nothing to trace.
                ["update", set, "{", "ip" | "ip6", "saddr", "}", rest @ ..] => {
                    let set = set.strip_prefix('@').expect("update @set");
                    assert!(
                        at.table.sets.contains_key(set),
                        "update of the missing set {set}"
                    );
                    rest
                }
                ["dnat", "to", to, rest @ ..] => {
                    end_of_rule(rest);
                    assert!(at.base.nat, "dnat outside a nat chain");
                    let to = to.parse::<SocketAddr>();
                    packet.translate(to.unwrap_or_else(|_| panic!("{rule:?}: dnat to ip:port")));
                    return Verdict::Accept;
                }
                ["masquerade", rest @ ..] => {
                    end_of_rule(rest.strip_prefix(&["fully-random"]).unwrap_or(rest));
                    assert!(
                        at.base.nat && at.base.hook == Hook::Postrouting,
                        "masquerade outside nat postrouting"
                    );
                    packet.masqueraded = true;
                    return Verdict::Accept;
                }
                verdict => return self.verdict(at, verdict, node, packet, choices),
            };
        }
    }

    /// A verdict statement (and an optional comment after it).
    fn verdict(
        &self,
        at: &At,
        words: &[&str],
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let (verdict, rest) = match words {
            ["jump" | "goto", _, rest @ ..] => (&words[..2], rest),
            [_, rest @ ..] => (&words[..1], rest),
            [] => panic!("a rule without a statement"),
        };
        end_of_rule(rest);
        match verdict {
            ["accept"] => {
                packet.accepted = true;
                Verdict::Accept
            }
            ["drop"] => Verdict::Drop,
            ["reject"] => {
                // Not on the prerouting hook (before Linux 5.9).
                assert!(
                    at.base.hook != Hook::Prerouting,
                    "reject in a prerouting chain"
                );
                Verdict::Reject
            }
            ["return"] => Verdict::Return,
            // A jump comes back here when its chain ends; a goto goes on in this chain's caller.
            ["jump", chain] => self.run(at, chain, node, packet, choices),
            ["goto", chain] => match self.run(at, chain, node, packet, choices) {
                Verdict::Continue => Verdict::Return,
                end => end,
            },
            other => panic!("the tracer does not know the statement {other:?}"),
        }
    }
}

impl Rules for Nftables {
    fn hook(
        &self,
        hook: Hook,
        nat: bool,
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let family = if packet.source.is_ipv4() {
            "ip "
        } else {
            "ip6 "
        };
        let mut chains: Vec<(Base, &Table, &str)> = (self.tables.iter())
            .filter(|(name, _)| name.starts_with(family))
            .flat_map(|(_, t)| t.chains.iter().map(move |(name, c)| (t, name, c)))
            .filter_map(|(t, name, c)| Some((c.base?, t, name.as_str())))
            .filter(|(base, _, _)| base.hook == hook)
            .collect();
        chains.sort_by_key(|(base, _, _)| base.priority);
        let priorities: Vec<i32> = chains.iter().map(|(b, _, _)| b.priority).collect();
        assert!(
            priorities.windows(2).all(|p| p[0] != p[1]),
            "base chains of one priority on {hook:?}: the kernel's order between them is not the tracer's"
        );
        let chains =
            (chains.into_iter()).map(|(base, table, chain)| (base.nat, (base, table, chain)));
        run_base_chains(chains, nat, |(base, table, chain)| {
            self.run(&At { table, base }, chain, node, packet, choices)
        })
    }
}

/// What may follow a statement that ends a rule: a comment, or nothing.
fn end_of_rule(rest: &[&str]) {
    assert!(
        matches!(rest, [] | ["comment", _]),
        "the tracer does not know {rest:?} after a rule's last statement"
    );
}

/// The object a command names; panics when the table has none.
fn found<T>(object: Option<T>, line: &str) -> T {
    object.unwrap_or_else(|| panic!("{line:?}: no such object"))
}

fn hook_of(name: &str) -> Hook {
    match name {
        "prerouting" => Hook::Prerouting,
        "input" => Hook::Input,
        "forward" => Hook::Forward,
        "output" => Hook::Output,
        "postrouting" => Hook::Postrouting,
        other => panic!("the tracer does not know the hook {other}"),
    }
}

/// The key a concatenation (`ip daddr . meta l4proto . th dport`) makes of `packet`.
fn concat(words: &[&str], packet: &Packet) -> String {
    let parts: Vec<String> = (words.split(|w| *w == "."))
        .map(|selector| match selector {
            ["ip" | "ip6", "daddr"] => packet.destination.to_string(),
            ["ip" | "ip6", "saddr"] => packet.source.to_string(),
            ["meta", "l4proto"] => packet.protocol.to_owned(),
            ["th", "dport"] => packet.port.to_string(),
            other => panic!("the tracer does not know the selector {other:?}"),
        })
        .collect();
    parts.join(" . ")
}

/// A set operand: `@name`, `{ a, b }` or one value; and the words after it.
fn set_of<'a>(words: &'a [&'a str]) -> (Vec<&'a str>, &'a [&'a str]) {
    match words {
        ["{", rest @ ..] => {
            let end = rest
                .iter()
                .position(|w| *w == "}")
                .expect("a closing brace");
            let items = rest[..end]
                .iter()
                .map(|w| w.trim_end_matches(','))
                .collect();
            (items, &rest[end + 1..])
        }
        [one, rest @ ..] => (vec![*one], rest),
        [] => panic!("a set operand is missing"),
    }
}

/// The elements of `{ key [comment "..."] [: verdict], ... }`.
fn elements(words: &[&str]) -> Vec<(String, String)> {
    let inner = match words {
        ["{", inner @ .., "}"] => inner,
        other => panic!("the tracer does not know the elements {other:?}"),
    };
    let mut out = Vec::new();
    for element in inner.join(" ").split(", ") {
        let (key, verdict) = match element.split_once(" : ") {
            Some((key, verdict)) => (key, verdict.to_owned()),
            None => (element, String::new()),
        };
        // The comment (its words were unquoted by the split above) is not part of the key.
        let key = key.split(" comment ").next().unwrap_or_default();
        out.push((key.trim().to_owned(), verdict));
    }
    out
}
