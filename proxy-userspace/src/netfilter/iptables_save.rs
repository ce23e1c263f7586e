//! A reader of `iptables-save` output (and of `iptables-restore` input): its rules, by table
//! and chain, for the modes' inspect readers.
use std::collections::HashMap;

use crate::rows::protocol;

/// One `-A CHAIN ...` line of `iptables-save` (or of `iptables-restore` input).
#[derive(Debug)]
pub(crate) struct SavedRule {
    pub table: String,
    pub chain: String,
    pub args: Vec<String>,
}

impl SavedRule {
    /// The value of the first of `options` that is not negated (`! -s X`).
    pub fn value(&self, options: &[&str]) -> Option<&str> {
        self.values(options).into_iter().next()
    }

    /// The values of every occurrence of `options` that is not negated.
    pub fn values(&self, options: &[&str]) -> Vec<&str> {
        let mut out = Vec::new();
        for (i, arg) in self.args.iter().enumerate() {
            let negated = i > 0 && self.args[i - 1] == "!";
            if options.contains(&arg.as_str())
                && !negated
                && let Some(value) = self.args.get(i + 1)
                && value != "!"
            {
                out.push(value.as_str());
            }
        }
        out
    }

    pub fn has(&self, flag: &str) -> bool {
        self.args.iter().any(|a| a == flag)
    }

    pub fn target(&self) -> Option<&str> {
        self.value(&["-j", "--jump", "-g", "--goto"])
    }

    pub fn comment(&self) -> Option<&str> {
        self.value(&["--comment"])
    }

    /// The destination address, without the `/32` (`/128`) iptables-save adds.
    pub fn destination(&self) -> Option<&str> {
        self.value(&["-d", "--destination"]).map(host)
    }

    pub fn dport(&self) -> Option<u16> {
        self.value(&["--dport", "--destination-port"])?.parse().ok()
    }

    pub fn protocol(&self) -> &'static str {
        self.value(&["-p", "--protocol"]).map_or("?", protocol)
    }
}

/// `10.0.0.1/32` as `10.0.0.1`, `fd00::1/128` as `fd00::1`.
fn host(addr: &str) -> &str {
    let suffix = if addr.contains(':') { "/128" } else { "/32" };
    addr.strip_suffix(suffix).unwrap_or(addr)
}

/// The `-A` lines of `text` (`iptables-save` of one or more tables); anything else is skipped.
pub(crate) fn parse_save(text: &str) -> Vec<SavedRule> {
    let mut table = String::new();
    let mut rules = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix('*') {
            table = name.trim().to_owned();
            continue;
        }
        let Some(rest) = line.strip_prefix("-A ") else {
            continue;
        };
        let mut words = split_words(rest).into_iter();
        let Some(chain) = words.next() else { continue };
        rules.push(SavedRule {
            table: table.clone(),
            chain,
            args: words.collect(),
        });
    }
    rules
}

/// Splits a rule into its words as a shell would: `"..."` quotes (with `\"` and `\\` in them)
/// hold one word.
pub(crate) fn split_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quoted = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            '\\' if quoted => {
                if let Some(next) = chars.next() {
                    word.push(next);
                }
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The rules of each chain of `table`, in order.
pub(crate) fn chains<'a>(
    rules: &'a [SavedRule],
    table: &str,
) -> HashMap<&'a str, Vec<&'a SavedRule>> {
    let mut out: HashMap<&str, Vec<&SavedRule>> = HashMap::new();
    for rule in rules.iter().filter(|r| r.table == table) {
        out.entry(rule.chain.as_str()).or_default().push(rule);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_words() {
        assert_eq!(
            split_words(r#"-m comment --comment "a \"b\" c" -j X"#),
            ["-m", "comment", "--comment", "a \"b\" c", "-j", "X"]
        );
    }
}
