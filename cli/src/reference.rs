//! The operations guide's reference sections, generated from the code: every flag and
//! environment variable of every command (from clap), and every metric (from
//! `ferry_core::metrics::ALL`, re-exported by `ferry-cluster`). A test keeps docs/operations.md equal to them
//! (`FERRY_BLESS=1 cargo test -p ferry reference` rewrites it).

use clap::CommandFactory;

fn table(cmd: &clap::Command) -> String {
    let mut s = String::from("| flag | environment | default | meaning |\n|---|---|---|---|\n");
    for a in cmd.get_arguments() {
        let Some(long) = a.get_long() else { continue };
        if matches!(long, "help" | "version") {
            continue;
        }
        let flag = match a.get_value_names() {
            Some(v) if a.get_action().takes_values() => format!("`--{long} <{}>`", v.join(" ")),
            _ if a.get_action().takes_values() => format!("`--{long} <{}>`", a.get_id().as_str().to_ascii_uppercase()),
            _ => format!("`--{long}`"),
        };
        let env = a.get_env().map(|e| format!("`{}`", e.to_string_lossy())).unwrap_or_default();
        let default: Vec<String> = a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        let default = if default.is_empty() { String::new() } else { format!("`{}`", default.join(",")) };
        let help = a.get_long_help().or(a.get_help()).map(|h| h.to_string()).unwrap_or_default();
        s += &format!("| {flag} | {env} | {default} | {} |\n", help.replace('\n', " ").replace('|', "\\|"));
    }
    s
}

/// Every command's flags (Markdown).
pub fn flags() -> String {
    let cli = crate::Cli::command();
    let mut s = String::new();
    let daemons = ["prefill", "decode", "router"];
    for sub in cli.get_subcommands() {
        let name = sub.get_name();
        let mut cmds = vec![(format!("ferry {name}"), sub)];
        if sub.has_subcommands() {
            cmds = sub.get_subcommands().map(|c| (format!("ferry {name} {}", c.get_name()), c)).collect();
        }
        for (title, c) in cmds {
            s += &format!("\n#### `{title}`");
            if daemons.contains(&name) {
                s += &format!(" (and `ferry-{name}`, which has the same flags but `--ready-line`)");
            }
            s += "\n\n";
            if let Some(about) = c.get_about() {
                s += &format!("{about}\n\n");
            }
            s += &table(c);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    fn section(doc: &str, name: &str) -> Option<(usize, usize)> {
        let begin = format!("<!-- BEGIN {name} (generated) -->\n");
        let end = format!("<!-- END {name} -->");
        let a = doc.find(&begin)? + begin.len();
        let b = a + doc[a..].find(&end)?;
        Some((a, b))
    }

    #[test]
    fn reference_sections_of_the_operations_guide_are_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md");
        let mut doc = std::fs::read_to_string(&path).expect("docs/operations.md");
        let bless = std::env::var_os("FERRY_BLESS").is_some();
        for (name, want) in [("flags", super::flags()), ("metrics", ferry_cluster::metrics::markdown())] {
            let (a, b) =
                section(&doc, name).unwrap_or_else(|| panic!("no {name} section markers in {}", path.display()));
            if bless {
                doc.replace_range(a..b, &want);
            } else {
                assert!(
                    doc[a..b] == want,
                    "the {name} section of docs/operations.md is stale: run FERRY_BLESS=1 cargo test -p ferry reference"
                );
            }
        }
        if bless {
            std::fs::write(&path, doc).expect("write docs/operations.md");
        }
    }
}
