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
    use std::collections::BTreeMap;

    use clap::CommandFactory;

    /// Every environment variable a command reads, with its command and default.
    fn envs() -> Vec<(String, String, Vec<String>)> {
        let mut out = Vec::new();
        let mut stack = vec![("ferry".to_string(), crate::Cli::command())];
        while let Some((path, c)) = stack.pop() {
            for a in c.get_arguments() {
                if let Some(e) = a.get_env() {
                    let d = a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
                    out.push((path.clone(), e.to_string_lossy().into_owned(), d));
                }
            }
            stack.extend(c.get_subcommands().map(|s| (format!("{path} {}", s.get_name()), s.clone())));
        }
        out
    }

    /// Issue 18: each environment variable is named once (`ferry_core::env`), read once per
    /// command, and means one thing: where several commands give it a default, the same one
    /// (`FERRY_MODEL` is required by the daemons and defaults to a catalog name in `ferry up`,
    /// which takes either).
    #[test]
    fn environment_variables_are_named_once_and_mean_one_thing() {
        let all = envs();
        let mut per_command: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        let mut defaults: BTreeMap<&str, BTreeMap<&Vec<String>, Vec<&str>>> = BTreeMap::new();
        for (cmd, env, default) in &all {
            *per_command.entry((cmd, env)).or_default() += 1;
            if !default.is_empty() {
                defaults.entry(env).or_default().entry(default).or_default().push(cmd);
            }
            assert!(ferry_cluster::env::ALL.contains(&env.as_str()), "{cmd}: {env} is not in ferry_core::env");
        }
        for ((cmd, env), n) in per_command {
            assert_eq!(n, 1, "{cmd} reads {env} for {n} flags");
        }
        for (env, by_default) in defaults {
            assert_eq!(by_default.len(), 1, "{env} has several defaults: {by_default:?}");
        }
        for env in ferry_cluster::env::ALL {
            assert!(all.iter().any(|(_, e, _)| e == env), "ferry_core::env::{env} is read by no command");
        }
    }
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

    /// Every `expr` string in a dashboard.
    fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    match (k.as_str(), x) {
                        ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                        _ => exprs(x, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| exprs(x, out)),
            _ => {}
        }
    }

    /// The Grafana dashboard (deploy/helm/ferry/dashboards/ferry.json, linked from
    /// deploy/grafana/) parses, and every metric its queries name is one Ferry exports:
    /// histograms through `_bucket`, the rest by their own name.
    #[test]
    fn the_dashboard_queries_only_metrics_ferry_exports() {
        use ferry_cluster::metrics::{ALL, Kind};
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/ferry/dashboards/ferry.json");
        let text = std::fs::read_to_string(&path).expect("the dashboard");
        let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
        let panels = dash["panels"].as_array().expect("panels");
        assert!(panels.len() >= 10, "{} panels", panels.len());
        let mut all = Vec::new();
        exprs(&dash, &mut all);
        assert!(all.len() >= panels.len(), "every panel has a query");
        let mut named = std::collections::BTreeSet::new();
        for e in &all {
            let mut rest = e.as_str();
            while let Some(i) = rest.find("ferry_") {
                let tail = &rest[i..];
                let n = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
                let name = &tail[..n];
                let series = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s));
                let (base, of_histogram) = match series {
                    Some(b) => (b, true),
                    None => (name, false),
                };
                let m =
                    ALL.iter().find(|m| m.name == base).unwrap_or_else(|| panic!("{name} in {e:?} is no Ferry metric"));
                let histogram = m.kind == Kind::Histogram;
                assert_eq!(of_histogram, histogram, "{name} in {e:?}: histograms through _bucket, _sum or _count");
                named.insert(base.to_string());
                rest = &tail[n..];
            }
        }
        for must in [
            "ferry_router_ttft_seconds",
            "ferry_router_itl_seconds",
            "ferry_request_phase_seconds",
            "ferry_queue_depth",
            "ferry_pages",
        ] {
            assert!(named.contains(must), "the dashboard shows no {must}");
        }
    }
}
